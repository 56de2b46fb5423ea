"""Storage rules: expiration, later-wins, dictionary merge, caps; and record validation."""

from __future__ import annotations

import pytest

from swarmavg.dht.identity import Identity
from swarmavg.dht.ids import key_id
from swarmavg.dht.records import (
    StoredRecord,
    named_owner,
    owner_suffix,
    pack,
    pack_subkey,
    signing_payload,
)
from swarmavg.dht.storage import EXPIRED, FULL, OUTDATED, STORED, Storage
from swarmavg.dht.validation import (
    DHTLimits,
    SchemaValidator,
    ValidationError,
    validate_record,
)

NOW = 1_000_000.0
RUN = "test"


def rec(value: object, expiration: float, key: bytes = b"k", subkey: object = None) -> StoredRecord:
    sub = b"" if subkey is None else pack_subkey(subkey)  # type: ignore[arg-type]
    return StoredRecord(key, sub, pack(value), expiration)


def values(storage: Storage, key: bytes = b"k", now: float = NOW) -> list[bytes]:
    return [r.value for r in storage.get(key_id(key), now)]


def test_later_expiration_replaces_earlier() -> None:
    s = Storage()
    assert s.put(rec(1, NOW + 10), NOW) == STORED
    assert s.put(rec(2, NOW + 5), NOW) == OUTDATED
    assert values(s) == [pack(1)]
    assert s.put(rec(3, NOW + 20), NOW) == STORED
    assert values(s) == [pack(3)]
    # identical record again: idempotent, nothing changes
    assert s.put(rec(3, NOW + 20), NOW) == STORED
    assert s.bytes_used == rec(3, NOW + 20).size()


def test_equal_expiration_ties_break_the_same_way_in_any_order() -> None:
    a, b = rec("a", NOW + 10), rec("b", NOW + 10)
    s1, s2 = Storage(), Storage()
    s1.put(a, NOW)
    s1.put(b, NOW)
    s2.put(b, NOW)
    s2.put(a, NOW)
    assert values(s1) == values(s2)


def test_expired_values_disappear() -> None:
    s = Storage()
    assert s.put(rec(1, NOW - 1), NOW) == EXPIRED
    assert s.put(rec(1, NOW + 10), NOW) == STORED
    assert values(s, now=NOW + 11) == []
    # an expired record no longer blocks an earlier-expiring newer one
    assert s.put(rec(2, NOW + 15), NOW + 12) == STORED
    assert s.sweep(NOW + 16) == 1
    assert len(s) == 0
    assert s.bytes_used == 0


def test_dictionary_subkeys_merge_and_expire_separately() -> None:
    s = Storage()
    assert s.put(rec("x", NOW + 10, subkey="a"), NOW) == STORED
    assert s.put(rec("y", NOW + 20, subkey="b"), NOW) == STORED
    assert s.put(rec("old", NOW + 5, subkey="a"), NOW) == OUTDATED
    assert sorted(values(s)) == sorted([pack("x"), pack("y")])
    assert values(s, now=NOW + 15) == [pack("y")]
    assert s.sweep(NOW + 15) == 1
    assert values(s, now=NOW + 15) == [pack("y")]


def test_plain_and_dictionary_later_expiration_wins() -> None:
    s = Storage()
    s.put(rec("plain", NOW + 10), NOW)
    assert s.put(rec("sub", NOW + 5, subkey=1), NOW) == OUTDATED
    assert s.put(rec("sub", NOW + 15, subkey=1), NOW) == STORED
    assert values(s) == [pack("sub")]
    s.put(rec("sub2", NOW + 30, subkey=2), NOW)
    assert s.put(rec("plain", NOW + 20), NOW) == OUTDATED  # a subkey lives longer
    assert s.put(rec("plain", NOW + 40), NOW) == STORED
    assert values(s) == [pack("plain")]
    assert s.bytes_used == rec("plain", NOW + 40).size()


def test_caps() -> None:
    s = Storage(max_subkeys_per_key=2)
    assert s.put(rec(1, NOW + 10, subkey=1), NOW) == STORED
    assert s.put(rec(1, NOW + 10, subkey=2), NOW) == STORED
    assert s.put(rec(1, NOW + 10, subkey=3), NOW) == FULL
    assert s.put(rec(1, NOW + 11, subkey=2), NOW) == STORED  # updating an existing subkey is fine
    small = Storage(max_bytes=300)
    assert small.put(rec(b"x" * 150, NOW + 10, key=b"a"), NOW) == STORED
    assert small.put(rec(b"x" * 150, NOW + 10, key=b"b"), NOW) == FULL
    assert len(small) == 1
    # once the first expires, its room is reused
    assert small.put(rec(b"x" * 150, NOW + 30, key=b"b"), NOW + 11) == STORED


def test_republish_skips_recently_received_and_cached() -> None:
    s = Storage()
    s.put(rec(1, NOW + 10, key=b"a"), NOW)
    s.put(rec(1, NOW + 10, key=b"c"), NOW, cached=True)
    assert s.to_republish(min_quiet=3600, now=NOW) == []
    assert [r.key for r in s.to_republish(min_quiet=0, now=NOW)] == [b"a"]


# ---- validation ----

LIMITS = DHTLimits()


def signed(  # type: ignore[no-untyped-def]
    identity: Identity,
    key: bytes,
    subkey: object,
    value: object,
    exp: float,
    issued: float = NOW,
    run_id: str = RUN,
):
    sub = b"" if subkey is None else pack_subkey(subkey)  # type: ignore[arg-type]
    val = pack(value)
    sig = identity.sign(signing_payload(run_id, key, sub, val, exp, issued))
    return StoredRecord(key, sub, val, exp, identity.public_key, sig, issued)


def test_owner_names() -> None:
    ident = Identity.generate()
    assert named_owner("x" + owner_suffix(ident.peer_id)) == ident.peer_id
    assert named_owner(b"x" + owner_suffix(ident.peer_id).encode()) == ident.peer_id
    assert named_owner(owner_suffix(ident.peer_id) + "x") is None
    assert named_owner(5) is None


@pytest.mark.parametrize("where", ["key", "subkey"])
def test_owner_records_need_the_owner_signature(where: str) -> None:
    owner, thief = Identity.generate(), Identity.generate()
    name = "slot" + owner_suffix(owner.peer_id)
    key = name.encode() if where == "key" else b"k"
    subkey = name if where == "subkey" else None
    good = signed(owner, key, subkey, {"x": 1}, NOW + 10)
    validate_record(good, LIMITS, NOW, run_id=RUN)

    forged = signed(thief, key, subkey, {"x": 2}, NOW + 20)  # signed by someone else
    with pytest.raises(ValidationError, match="signed by"):
        validate_record(forged, LIMITS, NOW, run_id=RUN)
    stolen_key = StoredRecord(
        key, good.subkey, pack({"x": 2}), NOW + 20, owner.public_key, thief.sign(b"junk"), NOW
    )
    with pytest.raises(ValidationError, match="bad signature"):
        validate_record(stolen_key, LIMITS, NOW, run_id=RUN)
    tampered = StoredRecord(
        key, good.subkey, good.value, NOW + 99, owner.public_key, good.signature, NOW
    )
    with pytest.raises(ValidationError, match="bad signature"):
        validate_record(tampered, LIMITS, NOW, run_id=RUN)
    unsigned = StoredRecord(key, good.subkey, good.value, NOW + 10, issued=NOW)
    with pytest.raises(ValidationError, match="not signed"):
        validate_record(unsigned, LIMITS, NOW, run_id=RUN)


def test_size_caps_and_expiration_limits() -> None:
    limits = DHTLimits(max_key_bytes=8, max_value_bytes=16, max_subkey_bytes=8, max_ttl=100)
    validate_record(rec(1, NOW + 10), limits, NOW, run_id=RUN)
    with pytest.raises(ValidationError, match="key"):
        validate_record(rec(1, NOW + 10, key=b"k" * 9), limits, NOW, run_id=RUN)
    with pytest.raises(ValidationError, match="value"):
        validate_record(rec(b"v" * 20, NOW + 10), limits, NOW, run_id=RUN)
    with pytest.raises(ValidationError, match="subkey"):
        validate_record(rec(1, NOW + 10, subkey="s" * 10), limits, NOW, run_id=RUN)
    with pytest.raises(ValidationError, match="future"):
        validate_record(rec(1, NOW + 1000), limits, NOW, run_id=RUN)
    with pytest.raises(ValidationError, match="finite"):
        validate_record(rec(1, float("nan")), limits, NOW, run_id=RUN)
    with pytest.raises(ValidationError, match="msgpack"):
        validate_record(StoredRecord(b"k", b"", b"\xc1", NOW + 1), limits, NOW, run_id=RUN)
    with pytest.raises(ValidationError, match="subkey must be"):
        validate_record(StoredRecord(b"k", pack([1]), pack(1), NOW + 1), limits, NOW, run_id=RUN)


def test_schema_validator() -> None:
    schema = SchemaValidator({b"progress.": lambda v: isinstance(v, dict) and "step" in v})
    validate_record(
        rec({"step": 1}, NOW + 1, key=b"progress.x"), LIMITS, NOW, (schema,), run_id=RUN
    )
    validate_record(rec("anything", NOW + 1, key=b"other"), LIMITS, NOW, (schema,), run_id=RUN)
    with pytest.raises(ValidationError, match="schema"):
        validate_record(
            rec({"no": 1}, NOW + 1, key=b"progress.x"), LIMITS, NOW, (schema,), run_id=RUN
        )


def test_owner_signature_covers_the_run_and_the_issue_time() -> None:
    owner = Identity.generate()
    subkey = owner_suffix(owner.peer_id)
    good = signed(owner, b"k", subkey, 1, NOW + 10, issued=NOW)
    validate_record(good, LIMITS, NOW, run_id=RUN)
    with pytest.raises(ValidationError, match="another run"):
        validate_record(good, LIMITS, NOW, run_id="other")
    backdated = StoredRecord(
        good.key, good.subkey, good.value, good.expiration, good.public_key, good.signature, 1.0
    )
    with pytest.raises(ValidationError, match="bad signature"):
        validate_record(backdated, LIMITS, NOW, run_id=RUN)
    late = signed(owner, b"k", subkey, 1, NOW + 10, issued=NOW + 11)
    with pytest.raises(ValidationError, match="issued before it expires"):
        validate_record(late, LIMITS, NOW, run_id=RUN)
    open_but_dated = StoredRecord(b"k", b"", pack(1), NOW + 10, issued=NOW)
    with pytest.raises(ValidationError, match="names no owner"):
        validate_record(open_but_dated, LIMITS, NOW, run_id=RUN)


def test_an_owners_newer_version_wins_even_when_it_expires_sooner() -> None:
    owner = Identity.generate()
    subkey = owner_suffix(owner.peer_id)
    old = signed(owner, b"k", subkey, "old", NOW + 100, issued=NOW)
    new = signed(owner, b"k", subkey, "new", NOW + 5, issued=NOW + 1)
    s = Storage()
    assert s.put(old, NOW) == STORED
    assert s.put(new, NOW) == STORED
    assert s.put(old, NOW) == OUTDATED  # a replay of the old version
    assert values(s) == [pack("new")]
