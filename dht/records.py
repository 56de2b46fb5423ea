"""Records: what the DHT stores, how values and subkeys are encoded, and how owners sign them.

A key holds either one plain value or a dictionary of subkeys, each with its own value and
expiration. Values are any msgpack-serialisable object; subkeys are ``str``, ``bytes`` or
``int``. On the wire and in storage both travel msgpack-encoded (``Record.value`` and
``Record.subkey``; an empty subkey means a plain value).

Owner-named records: a key or a subkey that ends with ``[owner:<40 hex digits>]`` names the peer
whose id those digits spell. Such a record must carry that peer's public key and its Ed25519
signature over :func:`signing_payload`, which covers the run id and the time the owner signed
it (``issued``); nobody else can write (or, by writing a later expiration, replace) it, and a
record signed in one run is refused in every other. Of two versions of an owned record the
later-issued one wins, whatever their expirations, so an owner can shorten or retire its own
record and an old version replayed later loses. See dht/validation.py for the checks.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack

T = TypeVar("T")

Subkey = str | bytes | int

OWNER_PATTERN = re.compile(rb"\[owner:([0-9a-f]{40})\]\Z")


@dataclass(frozen=True)
class ValueWithExpiration(Generic[T]):
    """A value and its absolute expiration time (seconds since the epoch, like ``time.time()``).

    For a dictionary key ``value`` is ``dict[subkey, ValueWithExpiration]`` and ``expiration``
    is the latest of its subkeys' expirations.
    """

    value: T
    expiration: float


@dataclass(slots=True)
class StoredRecord:
    """A record as stored and sent: msgpack-encoded subkey and value, plus the owner's proof."""

    key: bytes
    subkey: bytes  # msgpack-encoded subkey; b"" for a plain value
    value: bytes  # msgpack-encoded value
    expiration: float
    public_key: bytes = b""
    signature: bytes = b""
    issued: float = 0.0  # when the owner signed it; 0.0 for records that name no owner

    def order(self) -> tuple[float, float, bytes]:
        """Which of two records for the same key/subkey wins.

        Owned records: the later-issued version (the owner's newest word), so that an owner
        can replace its record by one that expires sooner and a replayed old version loses.
        Open records (``issued`` is always 0) and equal issue times: the later expiration.
        Last, the larger value bytes, so that every replica keeps the same record whatever the
        order in which copies arrive.
        """
        return (self.issued, self.expiration, self.value)

    def size(self) -> int:
        return len(self.key) + len(self.subkey) + len(self.value) + 104


def pack(obj: Any) -> bytes:
    """msgpack-encode a value (``use_bin_type``: bytes stay bytes)."""
    try:
        return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"value is not msgpack-serialisable: {e}") from e


def unpack(data: bytes, max_bytes: int) -> Any:
    """msgpack-decode peer-supplied bytes with every container bounded by ``max_bytes``.

    Raises:
        ValueError: malformed data.
    """
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=max_bytes,
            max_map_len=max_bytes,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of types on hostile input
        raise ValueError(f"malformed msgpack data: {e}") from e


def pack_subkey(subkey: Subkey) -> bytes:
    if isinstance(subkey, bool) or not isinstance(subkey, str | bytes | int):
        raise TypeError(f"a subkey is str, bytes or int, got {type(subkey).__name__}")
    return pack(subkey)


def unpack_subkey(data: bytes, max_bytes: int) -> Subkey:
    """Decode a subkey; raise ``ValueError`` unless it is a str, bytes or int."""
    subkey = unpack(data, max_bytes)
    if isinstance(subkey, bool) or not isinstance(subkey, str | bytes | int):
        raise ValueError(f"a subkey must be str, bytes or int, got {type(subkey).__name__}")
    return subkey


def owner_suffix(peer_id: bytes) -> str:
    """The suffix that makes a key or subkey owned by ``peer_id``: ``[owner:<hex>]``."""
    return f"[owner:{peer_id.hex()}]"


def named_owner(name: bytes | str | int) -> bytes | None:
    """The peer id that a key or decoded subkey names as its owner, or None."""
    if isinstance(name, int):
        return None
    raw = name.encode() if isinstance(name, str) else name
    match = OWNER_PATTERN.search(raw)
    return bytes.fromhex(match.group(1).decode()) if match else None


def subkey_owner(subkey: object) -> bytes | None:
    """The peer id that a whole owned subkey (``[owner:<hex>]`` and nothing else) belongs to.

    ``None`` for any other value, so it takes untrusted, undecoded-type input.
    """
    if not isinstance(subkey, str | bytes) or len(subkey) != len(owner_suffix(bytes(20))):
        return None
    return named_owner(subkey)


def signing_payload(
    run_id: str, key: bytes, subkey: bytes, value: bytes, expiration: float, issued: float
) -> bytes:
    """The bytes an owner signs: every field, length-prefixed, with a domain tag.

    The run id is not stored in the record: each verifier puts in its own, so a record
    signed for one run fails verification in any other (replay across runs).
    """
    if not (math.isfinite(expiration) and math.isfinite(issued)):
        raise ValueError("expiration and issued must be finite")
    run = run_id.encode()
    return b"".join(
        (
            b"swarmavg.v1.dht.record\x00",
            struct.pack(">IIII", len(run), len(key), len(subkey), len(value)),
            run,
            key,
            subkey,
            value,
            struct.pack(">dd", expiration, issued),
        )
    )
