"""160-bit node and key ids and the XOR metric (paper section 2.1).

Ids travel as 20 raw bytes and are compared as Python ints: ``distance(a, b) = a ^ b``.
A key's id is the SHA-1 of the key's bytes, the same hash that maps a public key to a peer id,
so keys and peers share one keyspace.
"""

from __future__ import annotations

import hashlib
import random

ID_BITS = 160
ID_BYTES = ID_BITS // 8
MAX_ID = 1 << ID_BITS


def id_to_int(node_id: bytes) -> int:
    """Return the integer value of a 20-byte id.

    Raises:
        ValueError: the id is not 20 bytes.
    """
    if len(node_id) != ID_BYTES:
        raise ValueError(f"an id has {ID_BYTES} bytes, got {len(node_id)}")
    return int.from_bytes(node_id, "big")


def int_to_id(value: int) -> bytes:
    """Return the 20-byte id of an integer in ``[0, 2**160)``."""
    if not 0 <= value < MAX_ID:
        raise ValueError("id out of range")
    return value.to_bytes(ID_BYTES, "big")


def key_to_bytes(key: str | bytes) -> bytes:
    """Return the bytes of a DHT key (UTF-8 for ``str``)."""
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, bytes):
        return key
    raise TypeError(f"a DHT key is str or bytes, got {type(key).__name__}")


def key_id(key: bytes) -> bytes:
    """Return the 20-byte id under which ``key`` is stored: ``sha1(key)``."""
    return hashlib.sha1(key).digest()


def distance(a: int, b: int) -> int:
    """The XOR metric (paper 2.1): symmetric, zero only for equal ids, and unidirectional."""
    return a ^ b


def random_id_in_range(lower: int, upper: int, rng: random.Random | None = None) -> int:
    """Return a uniformly random id in ``[lower, upper)``; used to refresh a bucket (paper 2.3)."""
    if not 0 <= lower < upper <= MAX_ID:
        raise ValueError(f"bad id range [{lower}, {upper})")
    return (rng or random).randrange(lower, upper)
