"""When a member's outer step comes: the swarm's work, not one member's step count.

With a fixed H every member runs H inner steps per outer step, so a swarm runs at the
speed of its slowest member: the fast ones wait for it at every sync. With a
:class:`SwarmPace`, an outer step comes when the *swarm* has processed
``target_samples`` (or after ``target_seconds`` of inner compute), and each member runs as
many inner steps as its own speed allows until then, as hivemind's ``target_batch_size``
counts samples rather than steps and Decoupled DiLoCo lets learners of unequal speed
run independently between merges weighted by the tokens each processed.

Every member plans the same round length from the rates in the progress records
(:func:`round_seconds`), so they arrive at the sync together; each plans its own step
count from its own rate (:func:`planned_steps`). The round then weights every member's
pseudo-gradient by the samples it processed (the weight the DiLoCo round already uses).

Pure and torch-free: the wrapper measures rates, this module turns them into steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_MAX_STEPS = 100_000
"""The most inner steps one outer step may take when nothing else bounds it: a rate read
from a forged or broken record must not stop a member from ever syncing."""


MAX_RATE_RATIO = 64.0
"""Another member's rate counts as at most this many times the reader's own: a record is
another daemon's word, and one that claims a huge rate would make every honest member plan
one-step rounds (a sync per step). Real swarms mix machines a few times apart in speed."""


@dataclass(frozen=True)
class SwarmPace:
    """How long a DiLoCo round lasts when it is set by the swarm's work.

    Give exactly one of ``target_samples`` and ``target_seconds``.

    Attributes:
        target_samples: samples the whole swarm processes per outer step (all members
            together); each member's share follows its speed.
        target_seconds: seconds of inner compute per outer step instead (every member
            computes that long, whatever its speed).
        min_steps: the fewest inner steps a member runs per outer step (a member too slow
            to finish one step in the round still contributes one).
        max_steps: the most inner steps a member runs per outer step.
        max_staleness: how many outer steps a late member's work may have missed and still
            be merged into its next sync (:mod:`~swarmavg.averaging.training.late_work`);
            0 discards all late work.
    """

    target_samples: int | None = None
    target_seconds: float | None = None
    min_steps: int = 1
    max_steps: int = DEFAULT_MAX_STEPS
    max_staleness: int = 1

    def __post_init__(self) -> None:
        if (self.target_samples is None) == (self.target_seconds is None):
            raise ValueError("give exactly one of target_samples and target_seconds")
        if self.target_samples is not None and not self.target_samples > 0:
            raise ValueError(f"target_samples must be positive, got {self.target_samples}")
        if self.target_seconds is not None and not (
            math.isfinite(self.target_seconds) and self.target_seconds > 0
        ):
            raise ValueError(f"target_seconds must be positive, got {self.target_seconds}")
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(
                f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}"
            )
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must not be negative, got {self.max_staleness}")


def swarm_rate(own_rate: float, other_rates: Iterable[float]) -> float:
    """The swarm's samples per second: this member's measured rate plus the others' as
    their records say.

    A rate that is not finite and positive (a member that has not measured one yet, in
    the first round) counts as this member's own: the best guess there is, and one that
    lets every member plan the first round instead of running it as if alone. Once this
    member knows its own rate, another's counts as at most :data:`MAX_RATE_RATIO` times it.
    """
    own = own_rate if math.isfinite(own_rate) and own_rate > 0 else 0.0
    cap = MAX_RATE_RATIO * own if own > 0 else math.inf
    return own + sum(min(r, cap) if math.isfinite(r) and r > 0 else own for r in other_rates)


def round_seconds(pace: SwarmPace, total_rate: float, done: int = 0) -> float | None:
    """Seconds of inner compute until the swarm reaches the pace's target; None when it
    cannot be told (nobody's rate is known).

    Args:
        pace: the swarm's pace.
        total_rate: the swarm's samples per second (:func:`swarm_rate`).
        done: samples the swarm has already processed in this round (a member that joins
            a round under way: it runs only what is left of it).
    """
    if not (math.isfinite(total_rate) and total_rate > 0):
        return pace.target_seconds if pace.target_seconds is not None and done <= 0 else None
    elapsed = max(done, 0) / total_rate
    if pace.target_seconds is not None:
        return max(pace.target_seconds - elapsed, 0.0)
    target = pace.target_samples or 0
    return max(target - max(done, 0), 0) / total_rate


def planned_steps(
    pace: SwarmPace,
    own_rate: float,
    total_rate: float,
    batch: int,
    fallback: int,
    done: int = 0,
) -> int:
    """Inner steps this member runs in a round so that it arrives when the swarm does.

    Args:
        pace: the swarm's pace.
        own_rate: this member's samples per second (0: not measured yet).
        total_rate: the swarm's, this member included (:func:`swarm_rate`).
        batch: samples behind one of this member's inner steps.
        fallback: the steps to run when the rates cannot tell (the first round).
        done: samples the swarm has already processed in this round (:func:`round_seconds`).

    Returns:
        ``round(seconds * own_rate / batch)`` within ``[min_steps, max_steps]``, or
        ``fallback`` within them when a rate is unknown.
    """
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    seconds = round_seconds(pace, total_rate, done)
    if seconds is None or not (math.isfinite(own_rate) and own_rate > 0):
        steps = fallback
    else:
        steps = round(seconds * own_rate / batch)
    return max(pace.min_steps, min(pace.max_steps, steps))


__all__ = [
    "DEFAULT_MAX_STEPS",
    "MAX_RATE_RATIO",
    "SwarmPace",
    "planned_steps",
    "round_seconds",
    "swarm_rate",
]
