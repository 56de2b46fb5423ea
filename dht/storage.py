"""Local record storage: expiring plain values and dictionaries of subkeys (docs/dht.md).

Rules (pure, synchronous, unit-tested):

* Per key: either one plain value or a dictionary of subkeys.
* A record replaces another for the same key (and subkey) only when it wins
  :meth:`StoredRecord.order`: for owner-signed records the later issue time (the owner's
  newer version, even if it expires sooner), else the later expiration; ties broken by value
  bytes so that every replica converges on the same record whatever the arrival order.
  Storing the very same record again reports ``STORED`` and changes nothing (stores are
  idempotent).
* A plain value replaces a dictionary only when it expires later than every subkey; a subkey
  replaces a plain value only when it expires later than that value. Later expiration wins.
* Expired records are never returned and are dropped by :meth:`Storage.sweep`.
* Caps: subkeys per key and total stored bytes; over a cap a store reports ``FULL``. A full
  key makes room for a holder (address range) with fewer subkeys there than the one with
  most, by dropping that one's first-expiring subkey (:meth:`Storage._evict_for`).
* Quotas per source (quotas.py): a record stored on behalf of a peer counts against that
  peer's id and address range (bytes, records, subkeys per key); over a quota a store reports
  ``FULL`` too, and ``last_refusal`` says why.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from swarmavg.dht.ids import key_id
from swarmavg.dht.quotas import QuotaLedger, Source, StorageQuotas
from swarmavg.dht.records import StoredRecord
from swarmavg.proto import dht_pb2

STORED = dht_pb2.STORE_STATUS_STORED
OUTDATED = dht_pb2.STORE_STATUS_OUTDATED
EXPIRED = dht_pb2.STORE_STATUS_EXPIRED
FULL = dht_pb2.STORE_STATUS_FULL


def _holder(source: Source) -> tuple[str, bytes | str]:
    """Whom a stored subkey counts for in a full key's fair share: its range, or its
    peer id when the range is exempt (local) or unknown."""
    if source.range_name is not None:
        return ("range", source.range_name)
    return ("id", source.peer_id)


@dataclass(slots=True)
class _Entry:
    """Everything stored under one key id."""

    plain: StoredRecord | None = None
    subkeys: dict[bytes, StoredRecord] = field(default_factory=dict)
    plain_source: Source | None = None  # who stored the plain value (None: this node)
    sources: dict[bytes, Source] = field(default_factory=dict)  # subkey -> who stored it
    cached: bool = False  # only a copy cached along a lookup path: not republished
    received: float = 0.0  # time.monotonic() of the last accepted store (paper 2.5)

    def records(self) -> Iterator[StoredRecord]:
        if self.plain is not None:
            yield self.plain
        yield from self.subkeys.values()

    def latest_expiration(self) -> float:
        return max((r.expiration for r in self.records()), default=float("-inf"))


class Storage:
    """Records of one node, indexed by key id (``sha1(key)``)."""

    def __init__(
        self,
        max_subkeys_per_key: int = 4096,
        max_bytes: int = 256 * 1024 * 1024,
        quotas: StorageQuotas | None = None,
    ):
        self.max_subkeys_per_key = max_subkeys_per_key
        self.max_bytes = max_bytes
        self.bytes_used = 0
        self.ledger = QuotaLedger(quotas or StorageQuotas(), max_bytes)
        self.last_refusal = ""  # why the last FULL answer was given
        self.evicted = 0  # subkeys dropped from full keys for a holder with fewer there
        self._entries: dict[bytes, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def num_records(self) -> int:
        """Records held (a dictionary value counts one per subkey; expired ones not yet
        swept included), for ``status`` and metrics."""
        return sum((e.plain is not None) + len(e.subkeys) for e in self._entries.values())

    def put(
        self,
        record: StoredRecord,
        now: float | None = None,
        cached: bool = False,
        key_id_: bytes | None = None,
        source: Source | None = None,
    ) -> dht_pb2.StoreStatus:
        """Store ``record`` if it wins; return a ``StoreStatus`` value.

        Args:
            now: ``time.time()`` reading (default: now).
            source: the peer that asked us to store it (None: this node itself, no quota).
            cached: the record is a lookup-path cache copy (paper 2.3), not to be republished.
                A key that also receives a regular store stops being a cache entry.
            key_id_: ``sha1(record.key)`` when the caller already has it.
        """
        now = time.time() if now is None else now
        if record.expiration <= now:
            return EXPIRED
        kid = key_id(record.key) if key_id_ is None else key_id_
        entry = self._entries.get(kid)
        if entry is None:
            entry = self._entries[kid] = _Entry(cached=cached)
        status = self._put_into(entry, kid, record, now, source)
        if status == FULL and self.bytes_used + record.size() > self.max_bytes:
            self.sweep(now)  # make room from expired records, then try once more
            entry = self._entries.setdefault(kid, _Entry(cached=cached))
            status = self._put_into(entry, kid, record, now, source)
        if status == STORED:
            entry.received = time.monotonic()
            entry.cached = entry.cached and cached
        elif not any(True for _ in entry.records()):
            del self._entries[kid]
        return status

    def _put_into(
        self, entry: _Entry, kid: bytes, record: StoredRecord, now: float, source: Source | None
    ) -> dht_pb2.StoreStatus:
        ledger = self.ledger
        if not record.subkey:
            if entry.plain is not None and entry.plain.expiration > now:
                if record.order() == entry.plain.order():
                    return STORED  # the same record again: idempotent, nothing to change
                if record.order() < entry.plain.order():
                    return OUTDATED
            if any(r.expiration >= record.expiration for r in entry.subkeys.values()):
                return OUTDATED
            freed = sum(r.size() for r in entry.records())
            if self.bytes_used - freed + record.size() > self.max_bytes:
                return self._full("this node's storage is full")
            if source is not None:
                own = entry.plain.size() if entry.plain and entry.plain_source == source else 0
                refusal = ledger.refusal(source, kid, record.size(), False, own)
                if refusal is not None:
                    return self._over_quota(refusal)
            self._release_all(entry, kid)
            self.bytes_used += record.size() - freed
            entry.plain, entry.subkeys, entry.plain_source = record, {}, source
            ledger.charge(source, kid, record.size(), False, 1)
            return STORED
        if (
            entry.plain is not None
            and entry.plain.expiration > now
            and entry.plain.expiration >= record.expiration
        ):
            return OUTDATED
        old = entry.subkeys.get(record.subkey)
        if old is not None and old.expiration > now:
            if record.order() == old.order():
                return STORED  # the same record again: idempotent
            if record.order() < old.order():
                return OUTDATED
        if old is None and len(entry.subkeys) >= self.max_subkeys_per_key:
            self._drop_expired_subkeys(entry, kid, now)
            if len(entry.subkeys) >= self.max_subkeys_per_key and not self._evict_for(
                entry, kid, source
            ):
                return self._full(f"the key holds {len(entry.subkeys)} subkeys, the most allowed")
        freed = (old.size() if old is not None else 0) + (
            entry.plain.size() if entry.plain is not None else 0
        )
        if self.bytes_used - freed + record.size() > self.max_bytes:
            return self._full("this node's storage is full")
        if source is not None:
            same = old is not None and entry.sources.get(record.subkey) == source
            own = old.size() if old is not None and same else 0
            refusal = ledger.refusal(source, kid, record.size(), not same, own)
            if refusal is not None:
                return self._over_quota(refusal)
        if entry.plain is not None:
            ledger.charge(entry.plain_source, kid, entry.plain.size(), False, -1)
        if old is not None:
            ledger.charge(entry.sources.pop(record.subkey, None), kid, old.size(), True, -1)
        self.bytes_used += record.size() - freed
        entry.plain, entry.plain_source = None, None
        entry.subkeys[record.subkey] = record
        if source is not None:
            entry.sources[record.subkey] = source
        ledger.charge(source, kid, record.size(), True, 1)
        return STORED

    def _evict_for(self, entry: _Entry, kid: bytes, source: Source | None) -> bool:
        """Make room in a full key for one subkey of ``source``: drop the record of the
        most-represented holder (an address range, or a peer id of an exempt range) that
        expires first, if that holder has more subkeys here than ``source``'s would have
        with its record. Return whether a subkey was dropped.

        Quotas bound what one range holds under a key (``max_subkeys_per_source`` times
        ``per_range_factor``), but a few networks together still filled a key; with this
        rule a declarer always gets its place while any other holder has more: the key
        fills up with a fair share per holder rather than first come, first served. This
        node's own records have no holder and are never dropped.
        """
        counts = collections.Counter(_holder(s) for s in entry.sources.values())
        if not counts:
            return False
        top, most = counts.most_common(1)[0]
        mine = counts[_holder(source)] if source is not None else 0
        if most <= mine + 1:  # no holder has more than the newcomer would: first come
            return False
        subkey = min(
            (k for k, s in entry.sources.items() if _holder(s) == top),
            key=lambda k: (entry.subkeys[k].expiration, k),
        )
        dropped = entry.subkeys.pop(subkey)
        self.bytes_used -= dropped.size()
        self.ledger.charge(entry.sources.pop(subkey), kid, dropped.size(), True, -1)
        self.evicted += 1
        return True

    def _full(self, reason: str) -> dht_pb2.StoreStatus:
        self.last_refusal = reason
        return FULL

    def _over_quota(self, reason: str) -> dht_pb2.StoreStatus:
        self.ledger.refused += 1
        return self._full(reason)

    def _release_all(self, entry: _Entry, kid: bytes) -> None:
        """Release the quota of every record of ``entry`` (before they are replaced)."""
        if entry.plain is not None:
            self.ledger.charge(entry.plain_source, kid, entry.plain.size(), False, -1)
        for subkey, rec in entry.subkeys.items():
            self.ledger.charge(entry.sources.get(subkey), kid, rec.size(), True, -1)
        entry.sources.clear()

    def _drop_expired_subkeys(self, entry: _Entry, kid: bytes, now: float) -> None:
        for subkey, rec in list(entry.subkeys.items()):
            if rec.expiration <= now:
                del entry.subkeys[subkey]
                self.bytes_used -= rec.size()
                self.ledger.charge(entry.sources.pop(subkey, None), kid, rec.size(), True, -1)

    def get(self, kid: bytes, now: float | None = None) -> list[StoredRecord]:
        """The unexpired records under key id ``kid``: ``[plain]``, the subkeys, or ``[]``."""
        entry = self._entries.get(kid)
        if entry is None:
            return []
        now = time.time() if now is None else now
        return [r for r in entry.records() if r.expiration > now]

    def sweep(self, now: float | None = None) -> int:
        """Drop every expired record; return how many were dropped."""
        now = time.time() if now is None else now
        dropped = 0
        for kid in list(self._entries):
            entry = self._entries[kid]
            if entry.plain is not None and entry.plain.expiration <= now:
                self.bytes_used -= entry.plain.size()
                self.ledger.charge(entry.plain_source, kid, entry.plain.size(), False, -1)
                entry.plain, entry.plain_source = None, None
                dropped += 1
            before = len(entry.subkeys)
            self._drop_expired_subkeys(entry, kid, now)
            dropped += before - len(entry.subkeys)
            if entry.plain is None and not entry.subkeys:
                del self._entries[kid]
        return dropped

    def to_republish(self, min_quiet: float, now: float | None = None) -> list[StoredRecord]:
        """Unexpired, non-cache records of keys nobody stored to us for ``min_quiet`` seconds.

        Paper 2.5: a node that received a store recently may assume the others did too, and
        skips republishing that key this round.
        """
        mono = time.monotonic()
        now = time.time() if now is None else now
        out: list[StoredRecord] = []
        for entry in self._entries.values():
            if entry.cached or mono - entry.received < min_quiet:
                continue
            out.extend(r for r in entry.records() if r.expiration > now)
        return out

    def mark_republished(self, kid: bytes) -> None:
        entry = self._entries.get(kid)
        if entry is not None:
            entry.received = time.monotonic()
