"""A signed record's value is checked once: the same signed bytes again skip the decode.

A matchmaking read receives each declaration from 3 replicas, every round, and a storing
node sees it again at every refresh; `validate_record` remembers, beside the verified
signature, that these exact bytes passed their key class's value check. What it must never
do: skip a check for other bytes, remember a failure as a pass, or skip a validator that an
upper layer registered (validators may hold state, such as a revocation list).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import pytest

from swarmavg.dht import Identity, owner_suffix
from swarmavg.dht.records import StoredRecord, Subkey, pack, pack_subkey, signing_payload
from swarmavg.dht.validation import (
    DHTLimits,
    KeyClass,
    SignatureCache,
    ValidationError,
    validate_record,
)

pytestmark = pytest.mark.timeout(30)

RUN = "test"
LIMITS = DHTLimits()


class CountingCheck:
    """A key class's value check that accepts mappings with ``ok`` true, and counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, subkey: Subkey, owner: bytes, value: Any) -> bool:
        self.calls += 1
        return isinstance(value, dict) and value.get("ok") is True


class CountingValidator:
    def __init__(self) -> None:
        self.calls = 0

    def validate(self, record: StoredRecord, value: Any) -> None:
        self.calls += 1


def signed(identity: Identity, value: Any, *, expiration_in: float = 60.0) -> StoredRecord:
    now = time.time()
    record = StoredRecord(
        b"decl.x", pack_subkey(owner_suffix(identity.peer_id)), pack(value), now + expiration_in
    )
    record.public_key = identity.public_key
    record.issued = now
    record.signature = identity.sign(
        signing_payload(RUN, record.key, record.subkey, record.value, record.expiration, now)
    )
    return record


def validate(
    record: StoredRecord, key_class: KeyClass, cache: SignatureCache, validators: tuple = ()
) -> None:
    validate_record(
        record,
        LIMITS,
        time.time(),
        validators,
        run_id=RUN,
        key_classes=(key_class,),
        signatures=cache,
    )


def key_class(check: CountingCheck) -> KeyClass:
    return KeyClass("declarations", re.compile(rb"decl\..+"), check, 3600.0)


def test_the_same_signed_bytes_are_value_checked_once() -> None:
    check, cache, identity = CountingCheck(), SignatureCache(), Identity.generate()
    record = signed(identity, {"ok": True})
    for _ in range(3):
        validate(record, key_class(check), cache)
    assert check.calls == 1
    assert (cache.misses, cache.hits) == (1, 2)
    # Other bytes of the same owner (a later declaration) are checked again.
    validate(signed(identity, {"ok": True, "n": 2}), key_class(check), cache)
    assert check.calls == 2


def test_a_value_that_failed_is_refused_every_time() -> None:
    check, cache = CountingCheck(), SignatureCache()
    record = signed(Identity.generate(), {"ok": False})
    for _ in range(3):
        with pytest.raises(ValidationError, match="schema"):
            validate(record, key_class(check), cache)
    assert check.calls == 3


def test_time_checks_still_run_on_remembered_bytes() -> None:
    check, cache = CountingCheck(), SignatureCache()
    record = signed(Identity.generate(), {"ok": True}, expiration_in=60.0)
    validate(record, key_class(check), cache)
    short = KeyClass("declarations", re.compile(rb"decl\..+"), check, 10.0)
    with pytest.raises(ValidationError, match="live at most"):
        validate(record, short, cache)


def test_a_signature_made_here_is_not_taken_as_a_checked_value() -> None:
    check, cache, identity = CountingCheck(), SignatureCache(), Identity.generate()
    record = signed(identity, {"ok": False})
    payload = signing_payload(
        RUN, record.key, record.subkey, record.value, record.expiration, record.issued
    )
    cache.remember_own(record.public_key, record.signature, payload)
    with pytest.raises(ValidationError, match="schema"):
        validate(record, key_class(check), cache)


def test_registered_validators_run_every_time() -> None:
    check, cache, validator = CountingCheck(), SignatureCache(), CountingValidator()
    record = signed(Identity.generate(), {"ok": True})
    for _ in range(3):
        validate(record, key_class(check), cache, (validator,))
    assert validator.calls == 3
    assert check.calls == 3


def test_a_tampered_copy_of_remembered_bytes_is_refused() -> None:
    check, cache = CountingCheck(), SignatureCache()
    record = signed(Identity.generate(), {"ok": True})
    validate(record, key_class(check), cache)
    tampered = dataclasses.replace(record, value=pack({"ok": True, "evil": 1}))
    with pytest.raises(ValidationError, match="bad signature"):
        validate(tampered, key_class(check), cache)
