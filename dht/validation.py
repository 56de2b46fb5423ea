"""Checks every record must pass before it is stored or believed.

* Size caps (:class:`DHTLimits`) are checked on lengths, before anything is decoded.
* Owner-named records (see dht/records.py): the record's public key must hash to the owner id
  named in its key or subkey, and its signature over (run id, record, issue time) must verify.
  So an owner's record cannot be overwritten, cannot be displaced by a forged one with a later
  expiration, and cannot be replayed into another run.
* Key classes (:class:`KeyClass`): keys an upper layer relies on (the averaging layer's
  protocol keys, docs/dht.md) accept only owner-signed dictionary entries, optionally of a
  given value schema. A plain value or an unowned subkey there is refused: without this, one
  plain value with a later expiration would replace every peer's entries and then refuse new
  ones as outdated (dht/storage.py).
  A key class also caps the lifetime of its records (``KeyClass.max_ttl``): a protocol record
  that claims to live for days would otherwise sit on k replicas long after its run ended.
* Optional schema validators run last, on the decoded value.
* Signature checks are the expensive part (Ed25519, about 50-100 us each, up to 256 records
  per request); a :class:`SignatureCache` remembers the signatures that verified, so a record
  seen again (republished, cached along a lookup path, answered by several replicas) costs a
  hash instead. It also remembers which of those records then passed their key class's
  value check, so the same signed bytes are not decoded and checked again (a matchmaking
  read gets each declaration from 3 replicas, every round).

The same checks run on records a peer sends us in Store and on records returned by Find, so a
malicious peer can neither plant nor serve a forged record, and readers never merge a record
that the storing node should have refused.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from swarmavg.dht.identity import peer_id_from_public_key, verify_signature
from swarmavg.dht.records import (
    StoredRecord,
    Subkey,
    named_owner,
    signing_payload,
    unpack,
    unpack_subkey,
)


class ValidationError(ValueError):
    """A record breaks a size cap, an ownership rule or a schema."""


@dataclass(frozen=True)
class DHTLimits:
    """Caps on what peers may send and store. All sizes in bytes."""

    max_key_bytes: int = 512
    max_subkey_bytes: int = 512
    max_value_bytes: int = 64 * 1024
    max_records_per_request: int = 256
    max_keys_per_request: int = 256
    max_request_bytes: int = 4 * 1024 * 1024
    max_response_bytes: int = 3 * 1024 * 1024  # stays under gRPC's default 4 MiB receive cap
    max_ttl: float = 7 * 24 * 3600.0  # no record may claim to live longer than a week
    max_subkeys_per_key: int = 4096
    max_stored_bytes: int = 256 * 1024 * 1024
    max_peers_per_answer: int = 64

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"DHTLimits.{name} must be positive, got {value}")


class RecordValidator(Protocol):
    """An extra check on records; raise :class:`ValidationError` to reject one."""

    def validate(self, record: StoredRecord, value: Any) -> None:
        """``value`` is the decoded record value."""


class SchemaValidator:
    """Rejects values that do not satisfy a predicate registered for their key's prefix.

    Args:
        rules: key prefix (bytes) -> predicate on the decoded value. The longest matching
            prefix applies; keys without a matching prefix pass.
    """

    def __init__(self, rules: Mapping[bytes, Callable[[Any], bool]]) -> None:
        self._rules = sorted(rules.items(), key=lambda kv: -len(kv[0]))

    def validate(self, record: StoredRecord, value: Any) -> None:
        for prefix, predicate in self._rules:
            if record.key.startswith(prefix):
                ok = False
                try:
                    ok = bool(predicate(value))
                except Exception as e:  # a predicate that chokes on hostile input rejects it
                    raise ValidationError(f"schema for {prefix!r} rejects value: {e}") from e
                if not ok:
                    raise ValidationError(f"value does not match the schema for {prefix!r}")
                return


@dataclass(frozen=True)
class KeyClass:
    """A class of keys that accept only owner-signed dictionary entries.

    The DHT itself knows no key names; an upper layer registers the keys it relies on
    (``DHTConfig.key_classes``). A record under a matching key must have a subkey that names
    its owner (``[owner:<hex>]`` at its end, so the usual signature check applies) and, if
    ``check_value`` is given, a value it accepts.

    Attributes:
        name: what the keys are, for error messages ("matchmaking declarations").
        pattern: a key belongs to the class when the pattern matches the whole raw key.
        check_value: ``(decoded subkey, owner id, decoded value) -> bool``; ``False`` or an
            exception refuses the record. ``None`` accepts any value. It must be a pure
            function of its arguments: its verdict on a signed record is remembered.
        max_ttl: a record expiring more than this many seconds after it arrives is refused
            (None: only ``DHTLimits.max_ttl`` applies).
    """

    name: str
    pattern: re.Pattern[bytes]
    check_value: Callable[[Subkey, bytes, Any], bool] | None = None
    max_ttl: float | None = None

    def matches(self, key: bytes) -> bool:
        return self.pattern.fullmatch(key) is not None

    def check(self, record: StoredRecord, value: Any, limits: DHTLimits) -> None:
        """Raise :class:`ValidationError` unless ``record`` has the form this class requires.

        Call after the ownership checks of :func:`validate_record` (the owner's signature is
        then known to be good).
        """
        if not record.subkey:
            raise ValidationError(
                f"{self.name} accept only owner-signed dictionary entries, not a plain value"
            )
        subkey = unpack_subkey(record.subkey, limits.max_subkey_bytes)  # checked before
        owner = named_owner(subkey)
        if owner is None:
            raise ValidationError(
                f"{self.name} accept only subkeys that name their owner ([owner:<peer id hex>])"
            )
        if self.check_value is None:
            return
        try:
            ok = bool(self.check_value(subkey, owner, value))
        except Exception as e:  # a schema that chokes on hostile input rejects it
            raise ValidationError(f"value does not match the schema of {self.name}: {e}") from e
        if not ok:
            raise ValidationError(f"value does not match the schema of {self.name}")


class SignatureCache:
    """The last ``size`` (public key, signature, payload) triples that verified.

    Keyed by a digest of all three, so a cached signature never vouches for another payload
    or key. Only successes are remembered: a forged signature costs its sender a
    verification every time, and cannot evict anything but the oldest entries. An entry also
    says whether its record passed the value checks that follow the signature's (see
    :func:`validate_record`): those depend only on the signed bytes.
    """

    def __init__(self, size: int = 65536) -> None:
        self.size = size
        self._verified: OrderedDict[bytes, bool] = OrderedDict()  # entry -> value checked
        self.hits = 0
        self.misses = 0

    @staticmethod
    def entry(public_key: bytes, signature: bytes, payload: bytes) -> bytes:
        """The key under which a signature of ``payload`` by ``public_key`` is remembered."""
        digest = hashlib.blake2b(payload, digest_size=32, key=public_key)
        digest.update(signature)
        return digest.digest()

    def _add(self, entry: bytes) -> None:
        if self.size > 0 and entry not in self._verified:
            self._verified[entry] = False
            while len(self._verified) > self.size:
                self._verified.popitem(last=False)

    def verify(self, public_key: bytes, signature: bytes, payload: bytes) -> bool:
        return self.verify_entry(
            self.entry(public_key, signature, payload), public_key, signature, payload
        )

    def verify_entry(
        self, entry: bytes, public_key: bytes, signature: bytes, payload: bytes
    ) -> bool:
        """:meth:`verify` with ``entry``, the caller's :meth:`entry` of the same three."""
        if entry in self._verified:
            self._verified.move_to_end(entry)
            self.hits += 1
            return True
        self.misses += 1
        if not verify_signature(public_key, signature, payload):
            return False
        self._add(entry)
        return True

    def value_checked(self, entry: bytes) -> bool:
        """Whether the record of a verified ``entry`` has passed its value checks before."""
        return self._verified.get(entry, False)

    def mark_value_checked(self, entry: bytes) -> None:
        """Remember that the record of verified ``entry`` passed its value checks."""
        if entry in self._verified:
            self._verified[entry] = True

    def remember_own(self, public_key: bytes, signature: bytes, payload: bytes) -> None:
        """Enter a signature this process has just made with the key of ``public_key``.

        A node validates every record it makes before storing it, and then reads the same
        record back in answers (matchmaking reads its own declaration every round): without
        this, each of those checks paid a full Ed25519 verification (profiled at 8 peers:
        about a tenth of the daemon's signature work) for a signature it made itself. Its
        value is not taken as checked: the validation that follows checks it.
        """
        self._add(self.entry(public_key, signature, payload))


def key_class_of(key: bytes, key_classes: tuple[KeyClass, ...]) -> KeyClass | None:
    """The first class in ``key_classes`` whose pattern matches ``key``, or None."""
    for key_class in key_classes:
        if key_class.matches(key):
            return key_class
    return None


def record_owner(record: StoredRecord, limits: DHTLimits) -> bytes | None:
    """The peer id that owns ``record`` (named by its key, else by its subkey), or None.

    Raises:
        ValidationError: key and subkey name different owners, or the subkey is malformed.
    """
    key_owner = named_owner(record.key)
    subkey_owner = None
    if record.subkey:
        try:
            subkey_owner = named_owner(unpack_subkey(record.subkey, limits.max_subkey_bytes))
        except ValueError as e:
            raise ValidationError(str(e)) from e
    if key_owner and subkey_owner and key_owner != subkey_owner:
        raise ValidationError("key and subkey name different owners")
    return key_owner or subkey_owner


def check_sizes(record: StoredRecord, limits: DHTLimits) -> None:
    """Cheap checks on lengths and the expiration; run before decoding anything."""
    if not record.key or len(record.key) > limits.max_key_bytes:
        raise ValidationError(f"key must have 1..{limits.max_key_bytes} bytes")
    if len(record.subkey) > limits.max_subkey_bytes:
        raise ValidationError(f"subkey exceeds {limits.max_subkey_bytes} bytes")
    if not record.value or len(record.value) > limits.max_value_bytes:
        raise ValidationError(f"value must have 1..{limits.max_value_bytes} bytes (msgpack)")
    if not math.isfinite(record.expiration):
        raise ValidationError("expiration must be finite")


def validate_record(
    record: StoredRecord,
    limits: DHTLimits,
    now: float,
    validators: tuple[RecordValidator, ...] = (),
    *,
    run_id: str,
    key_classes: tuple[KeyClass, ...] = (),
    signatures: SignatureCache | None = None,
) -> None:
    """Run every check on one record.

    Args:
        run_id: this node's run; an owner's signature must have been made for it.
        key_classes: keys that accept only owner-signed dictionary entries.
        signatures: remembers verified signatures (None: verify every time).

    Raises:
        ValidationError: with the reason.
    """
    check_sizes(record, limits)
    if record.expiration > now + limits.max_ttl:
        raise ValidationError(f"expiration is more than {limits.max_ttl:.0f} s in the future")
    key_class = key_class_of(record.key, key_classes)
    if (
        key_class is not None
        and key_class.max_ttl is not None
        and record.expiration > now + key_class.max_ttl
    ):
        raise ValidationError(
            f"{key_class.name} live at most {key_class.max_ttl:.0f} s; this record claims "
            f"{record.expiration - now:.0f} s"
        )
    if not math.isfinite(record.issued):
        raise ValidationError("issue time must be finite")
    owner = record_owner(record, limits)
    entry: bytes | None = None  # the signature's entry in ``signatures``, once verified
    if owner is not None:
        if not record.public_key:
            raise ValidationError(f"record of owner {owner.hex()} is not signed")
        if not 0 < record.issued <= record.expiration:
            raise ValidationError("an owned record must be issued before it expires")
        try:
            signer = peer_id_from_public_key(record.public_key)
        except ValueError as e:
            raise ValidationError(str(e)) from e
        if signer != owner:
            raise ValidationError(f"record of owner {owner.hex()} signed by {signer.hex()}")
        payload = signing_payload(
            run_id, record.key, record.subkey, record.value, record.expiration, record.issued
        )
        checked_before = False
        if signatures is None:
            verified = verify_signature(record.public_key, record.signature, payload)
        else:
            entry = signatures.entry(record.public_key, record.signature, payload)
            verified = signatures.verify_entry(entry, record.public_key, record.signature, payload)
            checked_before = verified and signatures.value_checked(entry)
        if not verified:
            raise ValidationError(
                f"bad signature on record of owner {owner.hex()} (forged, altered or "
                "signed for another run)"
            )
        if checked_before and not validators:
            return  # these signed bytes passed the value checks below before
    elif record.public_key or record.signature or record.issued:
        raise ValidationError("signature or issue time on a record that names no owner")
    try:  # malformed msgpack is rejected here, not discovered by a reader later
        value = unpack(record.value, limits.max_value_bytes)
    except ValueError as e:
        raise ValidationError(str(e)) from e
    if key_class is not None:
        key_class.check(record, value, limits)
    for validator in validators:
        validator.validate(record, value)
    if entry is not None and signatures is not None:
        signatures.mark_value_checked(entry)
