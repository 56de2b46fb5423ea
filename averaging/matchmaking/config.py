"""Settings, requests and progress events of matchmaking (used by ``matchmaker.py``)."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from swarmavg.averaging.aggregation import MEAN, canonical_aggregation
from swarmavg.averaging.group import MAX_GROUP_SIZE, Mode
from swarmavg.averaging.matchmaking.declarations import (
    DEFAULT_START_WINDOW,
    MAX_USER_DATA_BYTES,
    SCHEMA_HASH_BYTES,
)


class MatchmakingEvent(enum.Enum):
    """Progress notifications given to an observer (logs, metrics, tests)."""

    DECLARED = "declared"
    FOLLOWER_ACCEPTED = "follower-accepted"
    FOLLOWER_LEFT = "follower-left"
    JOINED_LEADER = "joined-leader"
    LEFT_LEADER = "left-leader"
    GROUP_FORMED = "group-formed"


Observer = Callable[[MatchmakingEvent, str, bytes], None]
"""Called with (event, matchmaking key, the other peer's id; own id for DECLARED/FORMED)."""


@dataclass(frozen=True)
class MatchmakerConfig:
    """Timing of the matchmaking protocol.

    Attributes:
        poll_interval: seconds between two reads of the declarations while looking.
        join_timeout: seconds a leader has to answer the first message of ``JoinGroup``.
        retry_after: seconds before asking again a peer that redirected us or disbanded.
        dht_timeout: deadline of one DHT store or get.
        max_redirects: redirects followed in a row before reading the DHT again.
        initial_latency: seconds assumed for one DHT or RPC round trip until this peer
            measured its own (the settle time derives from them, see ``closing``).
        start_window: ``(before, after)``: seconds before and after now within which a
            declared start must lie for the declaration to count.
        read_quorum: a read of the declarations merges what this many of the key's nodes
            hold (the nearest answer first), besides this peer's own copy, where it asked
            all k nearest before. Every declarer's store reaches the key's nearest nodes in
            its first wave of requests, so they hold what the farther ones do; each node
            less asked is one RPC less per peer and read.
        declaration_replicas: how many of the key's nearest nodes store a declaration
            (the DHT's default is k = 20): the reads ask the nearest ``read_quorum``, and
            the spares cover a node that fails or a reader whose view of the nearest
            differs. A declaration lives one round; each node left out is one RPC less
            per peer and round.
        expect_run_members: in the first round of a key family (no roster yet), expect
            the run's other averaging daemons (their presence entries) up to
            ``matchmaking_time``, so that trainers started seconds apart form one group
            (``roster``). Off: such a round expects only the peers it has seen declare.
    """

    poll_interval: float = 0.5
    join_timeout: float = 2.0
    retry_after: float = 0.4
    dht_timeout: float = 3.0
    max_redirects: int = 4
    initial_latency: float = 0.02
    start_window: tuple[float, float] = DEFAULT_START_WINDOW
    read_quorum: int = 3
    declaration_replicas: int = 5
    expect_run_members: bool = True

    def __post_init__(self) -> None:
        if not all(math.isfinite(w) and w > 0 for w in self.start_window):
            raise ValueError("start_window must be two positive, finite numbers of seconds")
        if not 1 <= self.read_quorum <= self.declaration_replicas:
            raise ValueError("need 1 <= read_quorum <= declaration_replicas")
        for name in (
            "poll_interval",
            "join_timeout",
            "retry_after",
            "dht_timeout",
            "initial_latency",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True)
class MatchRequest:
    """One peer's wish to average under one key.

    Attributes:
        key: full matchmaking key (see :func:`swarmavg.averaging.matchmaking.keys.matchmaking_key`).
        schema_hash: :func:`swarmavg.averaging.group.schema_hash` of the tensors.
        group_size: the most members a group led by this peer takes (itself included).
        min_group_size: the fewest members with which it closes a group at its deadline.
        codec: codec of the group when this peer leads.
        mode: this peer's averaging mode.
        bandwidth: this peer's reported bandwidth.
        user_data: opaque bytes given to every member.
        close_by: ``time.monotonic()`` instant at which this peer, as a leader, closes a
            group that is not full.
        give_up_by: ``time.monotonic()`` instant at which it stops looking and raises.
        data_port: this peer's data-plane port, advertised to the group (0: none).
        latest_close_by: ``time.monotonic()`` instant until which a leader whose round is
            the first of its family waits for the run's averagers it expects (processes
            start seconds apart); 0: ``close_by``. Within ``[close_by, give_up_by]``.
        wanted: members the caller expects (a ``group_size`` it gave; 0: none): the
            leader waits for them until ``close_by``, not only for the declared peers.
        aggregation: canonical aggregation rule; only peers of the same rule group.
        family: rounds of one loop (``step-41``, ``step-42``) share it; a leader expects
            the members of its previous round of the family (default: ``key``).
    """

    key: str
    schema_hash: bytes
    group_size: int
    min_group_size: int
    codec: str
    mode: Mode
    bandwidth: float
    user_data: bytes
    close_by: float
    give_up_by: float
    data_port: int = 0
    wanted: int = 0
    family: str = ""
    latest_close_by: float = 0.0
    aggregation: str = MEAN

    def __post_init__(self) -> None:
        if not 1 <= self.min_group_size <= self.group_size <= MAX_GROUP_SIZE:
            raise ValueError(
                f"need 1 <= min_group_size <= group_size <= {MAX_GROUP_SIZE}, got "
                f"min_group_size={self.min_group_size}, group_size={self.group_size}"
            )
        if len(self.schema_hash) != SCHEMA_HASH_BYTES:
            raise ValueError("schema_hash must be 32 bytes")
        if len(self.user_data) > MAX_USER_DATA_BYTES:
            raise ValueError(f"user_data is limited to {MAX_USER_DATA_BYTES} bytes")
        if canonical_aggregation(self.aggregation) != self.aggregation:
            raise ValueError(f"aggregation {self.aggregation!r} is not in canonical form")
        if not (self.close_by <= self.give_up_by and math.isfinite(self.give_up_by)):
            raise ValueError("need close_by <= give_up_by, both finite")
        if self.latest_close_by and not (self.close_by <= self.latest_close_by <= self.give_up_by):
            raise ValueError("need close_by <= latest_close_by <= give_up_by")
