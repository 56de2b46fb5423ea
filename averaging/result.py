"""What one round gives back: one record from the all-reduce up to the client.

:class:`RoundSummary` is what every caller learns of a round; the daemon's
:class:`AveragingResult` extends it with the tensors and what only the daemon sees, and the
client's ``AverageResult`` (``swarmavg.peer``) extends it with the caller's tensors and the
members' state digests. The all-reduce runner fills the daemon's record, the averager adds
the matchmaking phase, the daemon's local combiner hands the same record to every local
caller, and the control service sends its summary in the ``AverageDone`` message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from swarmavg.averaging.aggregation import MEAN
from swarmavg.averaging.request import digests_from_user_data


@dataclass(frozen=True, kw_only=True)
class RoundSummary:
    """What every caller of a round learns of it, in the daemon and in the client alike.

    Its fields are the control protocol's ``AverageDone`` fields of the same names, one
    for one (with ``state_digests`` beside them, which each record derives its own way):
    the daemon's :class:`AveragingResult` and the client's ``AverageResult`` extend it, and
    :meth:`summary_fields` / :meth:`fields_from` carry it across the control protocol
    whole, so a field added here reaches the client without being copied by hand.

    Attributes:
        group_size: members of the group.
        peers: the members' peer ids in hex, in group order.
        group_id: the group's id in hex.
        codec: the codec the group used: the one every member asked for (a follower
            refuses a group of another codec).
        partial: some chunk kept local values, or was averaged without some sender.
        timings: seconds per phase: the all-reduce's ``allreduce.prepare``,
            ``allreduce.exchange``, ``allreduce.finish`` and ``allreduce.total``; the
            averager adds ``matchmaking``, ``allreduce`` and ``total``; the daemon's
            handoff ``daemon.accept``, ``daemon.check``, ``daemon.write_back``; the client
            its own ``client.prepare`` (checks and the copy into shared memory),
            ``client.call`` (from then until the result was read) and ``client.write``.
        bytes_sent / bytes_received: payload bytes this member put on / took off the
            wire (both directions of every stream, as serialised messages).
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
        local_fraction: share of the elements (0..1) that kept this member's own values
            because no trusted average came back for them, as this member observed it.
    """

    group_size: int
    peers: list[str]
    group_id: str
    codec: str
    partial: bool
    timings: dict[str, float] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    local_callers: int = 1
    aggregation: str = MEAN
    num_adjusted: int = 0
    weights_clipped: int = 0
    local_fraction: float = 0.0

    def summary_fields(self) -> dict[str, Any]:
        """This record's :class:`RoundSummary` fields by name (``AverageDone``'s names)."""
        return {f.name: getattr(self, f.name) for f in fields(RoundSummary)}

    @staticmethod
    def fields_from(message: Any) -> dict[str, Any]:
        """The :class:`RoundSummary` fields of a message that carries them under the same
        names (the control protocol's ``AverageDone``), as plain Python values."""
        values: dict[str, Any] = {}
        for f in fields(RoundSummary):
            value = getattr(message, f.name)
            if isinstance(value, Mapping):
                value = dict(value)
            elif not isinstance(value, str | bytes | int | float):  # a repeated field
                value = list(value)
            values[f.name] = value
        # A daemon that names no rule ran the mean (the field's zero value is "").
        values["aggregation"] = values["aggregation"] or MEAN
        return values


@dataclass(frozen=True, kw_only=True)
class AveragingResult(RoundSummary):
    """The outcome of one round for this peer, as the daemon holds it.

    The all-reduce runner fills it, the averager adds the matchmaking phase, the daemon's
    local combiner hands the same record to every local caller, and the control service
    sends its :class:`RoundSummary` part in the ``AverageDone`` message.

    Attributes:
        tensors: new arrays with the caller's shapes, dtypes and order: the average for
            every chunk that came back, the caller's own values for the rest.
        gathered: every member's ``user_data`` by peer id hex (a member that attached a
            state digest has it there, tagged: see :attr:`state_digests`).
        failed_parts: parts (member indices) of which some chunk kept local values.
        dropped: senders this member's reducer dropped, with the reason.
        errors: failures of this member's own tasks in the round, each with its cause
            (also logged); a round with any is ``partial``.
        distrusted: parts whose reducer answered inconsistently, with the reason: they
            keep local values and are in ``failed_parts``.
        unconfirmed_ends: parts whose keyed stream ended before its last average with no
            end its reducer tagged (a status forged on the path, or a cut connection), with
            how it ended: the averages received before it are kept, the rest of the part
            keeps local values and the part is in ``failed_parts``.
        part_sizes: elements of the flat vector each member reduced, in member order
            (the round's partition, the same on every member).
    """

    tensors: list[np.ndarray]
    gathered: dict[str, bytes] = field(default_factory=dict)
    failed_parts: tuple[int, ...] = ()
    dropped: dict[int, str] = field(default_factory=dict)
    errors: tuple[str, ...] = ()
    distrusted: dict[int, str] = field(default_factory=dict)
    unconfirmed_ends: dict[int, str] = field(default_factory=dict)
    part_sizes: tuple[int, ...] = ()

    @property
    def state_digests(self) -> dict[str, bytes]:
        """The state digest each member attached (peer id hex -> digest); members that
        attached none are absent. The same on every member: it comes from the group."""
        return digests_from_user_data(self.gathered)
