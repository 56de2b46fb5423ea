"""What one round gives back: one record from the all-reduce up to the client.

The all-reduce runner fills it, the averager adds the matchmaking phase, the daemon's local
combiner hands the same record to every local caller, and the control service turns it
into the ``AverageDone`` message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from swarmavg.averaging.aggregation import MEAN
from swarmavg.averaging.request import digests_from_user_data


@dataclass(frozen=True)
class AveragingResult:
    """The outcome of one round for this peer.

    Attributes:
        tensors: new arrays with the caller's shapes, dtypes and order: the average for
            every chunk that came back, the caller's own values for the rest.
        group_size: members of the group.
        peers: the members' peer ids in hex, in group order.
        group_id: the group's id in hex.
        codec: the codec the group used: the one every member asked for (a follower
            refuses a group of another codec).
        partial: some chunk kept local values, or was averaged without some sender.
        timings: seconds per phase: the all-reduce's ``allreduce.prepare``,
            ``allreduce.exchange``, ``allreduce.finish`` and ``allreduce.total``; the
            averager adds ``matchmaking``, ``allreduce`` and ``total``.
        bytes_sent / bytes_received: payload bytes this member put on / took off the
            wire (both directions of every stream, as serialised messages).
        gathered: every member's ``user_data`` by peer id hex (a member that attached a
            state digest has it there, tagged: see :attr:`state_digests`).
        failed_parts: parts (member indices) of which some chunk kept local values.
        dropped: senders this member's reducer dropped, with the reason.
        errors: failures of this member's own tasks in the round, each with its cause
            (also logged); a round with any is ``partial``.
        distrusted: parts whose reducer answered inconsistently, with the reason: they
            keep local values and are in ``failed_parts``.
        local_fraction: share of the elements (0..1) that kept this member's own values
            because no trusted average came back for them, as this member observed it.
        local_callers: training processes of this machine combined into the round.
        aggregation: the canonical aggregation rule the group ran (its leader's, which
            every member checked against its own).
        num_adjusted: inputs the robust rule adjusted, summed over the parts whose result
            this member received (each part's reducer reports it): copies of a chunk
            rejected or clipped (``centered-clip``) or values dropped (``trimmed-mean``); 0
            for the mean.
        weights_clipped: senders whose weight exceeded the bound (``weight_bound`` times
            the median), summed over the same parts: one oversized sender counts once
            per part.
    """

    tensors: list[np.ndarray]
    group_size: int
    peers: list[str]
    group_id: str
    codec: str
    partial: bool
    timings: dict[str, float] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    gathered: dict[str, bytes] = field(default_factory=dict)
    failed_parts: tuple[int, ...] = ()
    dropped: dict[int, str] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    distrusted: dict[int, str] = field(default_factory=dict)
    local_fraction: float = 0.0
    local_callers: int = 1
    aggregation: str = MEAN
    num_adjusted: int = 0
    weights_clipped: int = 0

    @property
    def state_digests(self) -> dict[str, bytes]:
        """The state digest each member attached (peer id hex -> digest); members that
        attached none are absent. The same on every member: it comes from the group."""
        return digests_from_user_data(self.gathered)
