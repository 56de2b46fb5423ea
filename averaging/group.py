"""A formed averaging group: who is in it, in which order, and what they agreed on.

Matchmaking (``averaging/matchmaking/matchmaker.py``) produces a :class:`GroupInfo`; the butterfly
all-reduce (``averaging/allreduce/runner.py``) consumes it. Every member of a group must hold an
identical ``GroupInfo`` (same member order, same codec, same schema hash): the partition
of the flattened tensors into parts and chunks is computed from it deterministically on
every member, so nothing about the layout travels on the wire during the all-reduce.

How a group is run (``run_allreduce``) and how a daemon serves ``Reduce`` for it
(``AllReduceService``, registered by ``swarmavg.averaging.service``): docs/averaging.md,
"Runner API".

Modes: a ``NODE`` sends its tensors and reduces a part; a ``CLIENT`` only
sends (it is never dialled, so its address may be ``None``); an ``AUX`` peer only reduces
and contributes nothing (its weight is 0).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from swarmavg.averaging.aggregation import MEAN, Aggregation, parse_aggregation

PEER_ID_BYTES = 20
MAX_GROUP_SIZE = 256


class Mode(enum.IntEnum):
    """What a member does in the butterfly all-reduce."""

    NODE = 0
    """Sends its tensors and reduces one part."""
    CLIENT = 1
    """Sends its tensors, reduces nothing, accepts no connections."""
    AUX = 2
    """Reduces one part, sends nothing (weight 0); lends bandwidth to the group."""

    @property
    def sends(self) -> bool:
        """Whether a member in this mode contributes tensors."""
        return self is not Mode.AUX

    @property
    def reduces(self) -> bool:
        """Whether a member in this mode may reduce a part (it also needs bandwidth > 0)."""
        return self is not Mode.CLIENT


@dataclass(frozen=True)
class Member:
    """One member of a group, as gathered by matchmaking.

    Attributes:
        peer_id: the member's 20-byte DHT id.
        address: ``HOST:PORT`` where its Averaging service listens; ``None`` for clients.
        mode: what it does in the all-reduce.
        bandwidth: its reported bandwidth (any consistent unit, e.g. MB/s); parts are
            sized in proportion to it. 0 means "reduces nothing".
        user_data: opaque bytes the member attached when joining (not used here).
        data_port: TCP port of its data plane on the host of ``address``
            (:mod:`~swarmavg.averaging.allreduce.data_server`); 0 when it serves ``Reduce``
            over gRPC only.
    """

    peer_id: bytes
    address: str | None
    mode: Mode
    bandwidth: float = 1.0
    user_data: bytes = b""
    data_port: int = 0

    def __post_init__(self) -> None:
        if len(self.peer_id) != PEER_ID_BYTES:
            raise ValueError(f"peer_id must be {PEER_ID_BYTES} bytes, got {len(self.peer_id)}")
        if not (self.bandwidth >= 0.0 and np.isfinite(self.bandwidth)):
            raise ValueError(f"bandwidth must be finite and >= 0, got {self.bandwidth}")
        if not 0 <= self.data_port <= 65535:
            raise ValueError(f"data_port must be a TCP port or 0, got {self.data_port}")
        if self.mode.reduces and self.bandwidth > 0 and not self.address:
            raise ValueError("a member that reduces a part needs an address")

    @property
    def is_reducer(self) -> bool:
        """Whether this member reduces a non-empty part (mode allows it, bandwidth > 0)."""
        return self.mode.reduces and self.bandwidth > 0


@dataclass(frozen=True)
class GroupInfo:
    """The outcome of matchmaking; identical on every member.

    Attributes:
        group_id: unique id of this round's group (any bytes, at most 64).
        members: ordered members; the position of a member is its index in the round.
        schema_hash: :func:`schema_hash` of the tensors every member averages.
        codec: registry name of the codec every chunk passes through.
        aggregation: canonical name of the rule every reducer applies
            (:attr:`~swarmavg.averaging.aggregation.Aggregation.name`).
    """

    group_id: bytes
    members: tuple[Member, ...]
    schema_hash: bytes
    codec: str = "none"
    aggregation: str = MEAN

    def __post_init__(self) -> None:
        if not 0 < len(self.group_id) <= 64:
            raise ValueError("group_id must be 1..64 bytes")
        if not 0 < len(self.members) <= MAX_GROUP_SIZE:
            raise ValueError(f"a group has 1..{MAX_GROUP_SIZE} members")
        ids = [m.peer_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ValueError("a peer appears twice in the group")
        if not any(m.is_reducer for m in self.members):
            raise ValueError("a group needs at least one member that reduces")
        if not any(m.mode.sends for m in self.members):
            raise ValueError("a group needs at least one member that sends")
        if self.rule.name != self.aggregation:
            raise ValueError(
                f"aggregation {self.aggregation!r} is not in canonical form {self.rule.name!r}"
            )

    @property
    def rule(self) -> Aggregation:
        """The parsed :attr:`aggregation` (``ValueError`` if it names no rule)."""
        return parse_aggregation(self.aggregation)

    @property
    def size(self) -> int:
        return len(self.members)

    def index_of(self, peer_id: bytes) -> int | None:
        """Position of ``peer_id`` in the group, or ``None`` when it is not a member."""
        for i, member in enumerate(self.members):
            if member.peer_id == peer_id:
                return i
        return None

    @functools.cached_property
    def senders(self) -> tuple[int, ...]:
        """Indices of the members that contribute tensors (asked per chunk in a round)."""
        return tuple(i for i, m in enumerate(self.members) if m.mode.sends)


def describe_layout(tensors: Sequence[np.ndarray], most: int = 6) -> str:
    """``2 tensors: float32[16, 4], float32[4]``: what :func:`schema_hash` digests, for a
    message (the first ``most`` tensors)."""
    shown = [f"{np.dtype(t.dtype).name}[{', '.join(map(str, t.shape))}]" for t in tensors[:most]]
    more = f", and {len(tensors) - most} more" if len(tensors) > most else ""
    count = f"{len(tensors)} tensor{'s' if len(tensors) != 1 else ''}"
    return f"{count}: {', '.join(shown)}{more}" if tensors else "no tensors"


def schema_hash(tensors: Sequence[np.ndarray]) -> bytes:
    """A 32-byte digest of the tensors' count, order, shapes and dtypes (not their values).

    Peers whose digests differ cannot average together; matchmaking rejects them before
    any data moves.
    """
    h = hashlib.sha256(b"swarmavg.schema.v1")
    h.update(struct.pack("<Q", len(tensors)))
    for array in tensors:
        name = np.dtype(array.dtype).name.encode()
        h.update(struct.pack("<Q", len(name)) + name)
        h.update(struct.pack("<Q", array.ndim))
        h.update(struct.pack(f"<{array.ndim}q", *array.shape))
    return h.digest()
