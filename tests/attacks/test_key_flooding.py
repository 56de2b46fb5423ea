"""Matchmaking key flooding from a few networks (medium).

A key holds at most 4096 subkeys (``DHTLimits.max_subkeys_per_key``); one peer id may hold
256 of them and one address range 4 times that (dht/quotas.py). Four networks, four ids
each, filled a matchmaking key, and every honest declarer after them was refused ``FULL``:
nobody new could be matched under that key until the flood expired.

Now a full key makes room for a holder with fewer subkeys there than the most-represented
one, by dropping that holder's first-expiring subkey (dht/storage.py): whatever the number of
networks flooding, an honest declarer gets its place, and the flooders keep a fair share.
"""

from __future__ import annotations

from swarmavg.dht.ids import key_id
from swarmavg.dht.quotas import Source, StorageQuotas
from swarmavg.dht.records import StoredRecord, pack, pack_subkey, unpack
from swarmavg.dht.storage import FULL, STORED, Storage

KEY = b"run.step.0b"
NOW = 1_000_000.0
SUBKEYS = 4096
QUOTAS = StorageQuotas()
FLOOD_RANGES = [f"198.51.{i}.0/24" for i in range(4)]  # the attacker's four networks


def declaration(name: str, expiration: float) -> StoredRecord:
    return StoredRecord(KEY, pack_subkey(name.encode()), pack(name), expiration)


def flood(storage: Storage, ranges: list[str]) -> int:
    """Fill the key from ``ranges``, each at its quota (4 ids x 256 subkeys); return how
    many subkeys were stored."""
    stored = 0
    per_range = QUOTAS.per_range_factor
    for r, range_name in enumerate(ranges):
        for i in range(per_range):
            source = Source(bytes([r, i]) * 10, range_name)
            for j in range(QUOTAS.max_subkeys_per_source):
                record = declaration(f"flood-{r}-{i}-{j}", NOW + 600 + j)
                stored += storage.put(record, now=NOW, source=source) == STORED
    return stored


def _name(record: StoredRecord) -> str:
    return str(unpack(record.value, 1 << 10))


def test_four_networks_do_not_lock_honest_declarers_out_of_a_key() -> None:
    """Control: an honest declaration stores in an empty key. Attack: four networks fill
    the key to its 4096 subkeys; an honest declarer from a fifth network, and then one
    more from the same honest network, still store (before: ``FULL`` for both)."""
    control = Storage(SUBKEYS, quotas=QUOTAS)
    honest = Source(b"h" * 20, "203.0.113.0/24")
    assert control.put(declaration("honest-0", NOW + 60), now=NOW, source=honest) == STORED

    storage = Storage(SUBKEYS, quotas=QUOTAS)
    assert flood(storage, FLOOD_RANGES) == SUBKEYS
    assert len(storage.get(key_id(KEY), NOW)) == SUBKEYS
    for i in range(2):
        declarer = Source(bytes([0xAA, i]) * 10, "203.0.113.0/24")
        status = storage.put(declaration(f"honest-{i}", NOW + 60), now=NOW, source=declarer)
        assert status == STORED, storage.last_refusal
    names = {_name(r) for r in storage.get(key_id(KEY), NOW)}
    assert {"honest-0", "honest-1"} <= names
    assert len(names) == SUBKEYS  # the key stays at its cap: flooders' subkeys made room


def test_a_full_key_keeps_a_fair_share_per_network() -> None:
    """The flooding networks can take the key back from each other but not from a
    network that holds fewer: after a second flood round every network but the flooders'
    keeps what it stored, and the flood never drops below a fair share."""
    storage = Storage(SUBKEYS, quotas=QUOTAS)
    flood(storage, FLOOD_RANGES)
    honest = [Source(bytes([0xBB, i]) * 10, f"203.0.{i}.0/24") for i in range(8)]
    for i, source in enumerate(honest):
        assert storage.put(declaration(f"honest-{i}", NOW + 60), now=NOW, source=source) == STORED
    # The flooders store again, fresh subkeys from their ids (quota room freed by evictions).
    for r, range_name in enumerate(FLOOD_RANGES):
        source = Source(bytes([r, 0]) * 10, range_name)
        for j in range(64):
            storage.put(declaration(f"again-{r}-{j}", NOW + 900), now=NOW, source=source)
    names = {_name(r) for r in storage.get(key_id(KEY), NOW)}
    assert {f"honest-{i}" for i in range(8)} <= names
    # The most-represented network (a flooder) is the one that paid for every place.
    assert storage.evicted >= 8


def test_a_full_key_refuses_the_most_represented_network() -> None:
    """A network that already holds the most subkeys of a full key gets ``FULL`` rather
    than taking another's place."""
    storage = Storage(64, quotas=StorageQuotas(max_subkeys_per_source=16, per_range_factor=4))
    big = Source(b"b" * 20, "198.51.100.0/24")
    small = Source(b"s" * 20, "203.0.113.0/24")
    for j in range(56):
        source = Source(bytes([j // 16]) * 20, big.range_name)
        assert storage.put(declaration(f"big-{j}", NOW + 600), now=NOW, source=source) == STORED
    for j in range(8):
        assert storage.put(declaration(f"small-{j}", NOW + 600), now=NOW, source=small) == STORED
    assert storage.put(declaration("big-more", NOW + 600), now=NOW, source=big) == FULL
    assert storage.put(declaration("small-more", NOW + 600), now=NOW, source=small) == STORED
