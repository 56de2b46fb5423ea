"""Moshpit group bits: which matchmaking key a peer uses in its next round.

Moshpit SGD (Ryabinin et al. 2021, section 3.1) arranges N = g^d peers on a virtual
d-dimensional grid with side g. In round r, peers that share every coordinate except
coordinate r average together (a group of g). After d rounds every peer holds the exact
global mean: each round averages along one axis, and averaging along all d axes of the
grid is the global mean.

Here a peer's position is a bit string (``group_bits``) that is part of its matchmaking key
``{run}.{key}.0b{group_bits}``. Only peers with equal bits meet. After each round the peer
shifts ``log2(g)`` new bits into the string from its index in the group, so the oldest
coordinate (the one just averaged over) drops out and a coordinate that differs between
the members of the group comes in. With ``len(group_bits) = (d - 1) * log2(g)``, the peers
that meet in the next round come from ``g`` different groups of this round, which is exactly
the grid walk above.

Why the index passes through a permutation seeded by the group id (as hivemind's
``GroupKeyManager`` does): when a group is smaller than ``2**bits_per_round`` the plain
index would always pick the low buckets; the permutation spreads members over all
buckets while keeping the values within one group distinct, which is what the exact-mean
property needs.
"""

from __future__ import annotations

import hashlib
import math
import struct

MAX_GROUP_BITS = 64


def validate_bits(bits: str) -> str:
    """Return ``bits`` when it is a string of '0'/'1' of length <= 64; else ValueError."""
    if len(bits) > MAX_GROUP_BITS or any(c not in "01" for c in bits):
        raise ValueError(
            f"group bits must be at most {MAX_GROUP_BITS} characters of 0/1, got {bits!r}"
        )
    return bits


def matchmaking_key(run_id: str, key: str, group_bits: str) -> str:
    """The DHT key under which peers of ``run_id`` averaging ``key`` declare themselves."""
    if not key:
        raise ValueError("the averaging key must be a non-empty string")
    return f"{run_id}.{key}.0b{validate_bits(group_bits)}"


def bits_for_group_size(group_size: int) -> int:
    """How many bits one round of groups of ``group_size`` can tell apart: ceil(log2(g))."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return math.ceil(math.log2(group_size)) if group_size > 1 else 0


def bucket_for_member(group_id: bytes, index: int, group_size: int, nbits: int) -> int:
    """The bucket in ``[0, 2**nbits)`` that member ``index`` of a group moves to.

    Members of one group always get distinct buckets when ``group_size <= 2**nbits``
    (they take distinct entries of one permutation seeded by ``group_id``).
    """
    if not 0 <= index < group_size:
        raise ValueError(f"index {index} outside a group of {group_size}")
    num_buckets = 1 << nbits
    if group_size > num_buckets:
        # More members than buckets: fold indices so every bucket stays used evenly.
        index %= num_buckets
    order = sorted(
        range(num_buckets),
        key=lambda b: hashlib.sha256(group_id + struct.pack("<Q", b)).digest(),
    )
    return order[index]


def next_group_bits(bits: str, group_id: bytes, index: int, group_size: int) -> str:
    """The bits a peer uses after finishing a round at ``index`` of a group.

    The string keeps its length; ``min(len(bits), ceil(log2(group_size)))`` new bits are
    shifted in at the end and as many old bits drop out at the front.
    """
    validate_bits(bits)
    if not bits:
        return bits
    nbits = min(len(bits), bits_for_group_size(group_size))
    if nbits == 0:
        return bits
    bucket = bucket_for_member(group_id, index, group_size, nbits)
    new = format(bucket, f"0{nbits}b")
    return (bits + new)[-len(bits) :]


def companions(bits: str, group_id: bytes, index: int, group_size: int) -> frozenset[int]:
    """Indices of the members of a group (``index`` included) whose bits after the round
    equal member ``index``'s: the ones it meets again under its next key. Without group
    bits that is everyone."""
    mine = next_group_bits(bits, group_id, index, group_size)
    return frozenset(
        j for j in range(group_size) if next_group_bits(bits, group_id, j, group_size) == mine
    )


class GroupKeyManager:
    """Holds one peer's current group bits and advances them after every round.

    Not thread-safe; owned by one :class:`~swarmavg.averaging.averager.Averager`.
    """

    def __init__(self, run_id: str, initial_bits: str = "") -> None:
        self.run_id = run_id
        self.group_bits = validate_bits(initial_bits)

    def key_for(self, key: str) -> str:
        """The matchmaking DHT key for averaging ``key`` with the current bits."""
        return matchmaking_key(self.run_id, key, self.group_bits)

    def on_group_formed(self, group_id: bytes, index: int, group_size: int) -> frozenset[int]:
        """Advance the bits after a round at position ``index`` in a group of ``group_size``;
        return the indices of the members that move to the same bits (:func:`companions`)."""
        together = companions(self.group_bits, group_id, index, group_size)
        self.group_bits = next_group_bits(self.group_bits, group_id, index, group_size)
        return together
