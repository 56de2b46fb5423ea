"""``local_steps="auto"``: the sync interval chosen from measured step and round times.

DiLoCo's H (inner steps between two outer steps) trades bytes and idle time against
convergence: a small H sends more and, when the round is slow, waits more; a large H
drifts further between syncs. With ``local_steps="auto"`` the wrapper measures how long
one inner step and one round take and picks the smallest H that keeps communication
hidden, within bounds the user can set.

The rules are pure functions of two numbers: the *ratio* ``round_seconds /
step_seconds`` (how many inner steps one round costs):

* :func:`diloco_local_steps` (synchronous DiLoCo, the round blocks): the smallest H whose
  round costs at most ``overhead`` (default 5%) of the H inner steps' compute,
  ``H = ceil(ratio / overhead)``, clamped to ``bounds``.
* :func:`streaming_schedule` (Streaming DiLoCo, the round overlaps later inner steps): the
  round is hidden when it ends within ``overlap_steps`` inner steps, so
  ``overlap_steps = ceil(margin * ratio)`` (margin 1.5 for jitter), and a fragment syncs
  every ``H / F >= overlap_steps + 1`` steps: ``H = F * (overlap_steps + 1)`` at least,
  clamped to ``bounds`` and rounded to a multiple of F.

**Every member picks the same H.** A member measures its own times, so the members'
ratios differ a little; if each chose from its own, a member near a rounding boundary
would pick another H and wait for the others at every round. So the ratio travels
with the round: each member appends two one-element tensors to its pseudo-gradient,
``known * ratio`` and ``known`` (``known`` is 1 once it has timed a round, else 0),
and the averaged pair is the same on every member, bit for bit (rounds end identical).
The swarm's ratio is their quotient (the weighted mean over the members that have
measured one), and the next H follows from it by the pure rule above: the same on
every member. One-element tensors pass every codec (top-k keeps at least one element
per tensor, blockwise codecs scale by that element), so they carry the ratio through
``sparseloco`` and 4-bit codecs too, at the codec's precision (plenty for a schedule).

The first outer step uses ``bounds[0]`` inner steps (nothing is measured yet). A round
that failed or came back partial leaves H as it was. H is part of the published state
and of ``state_dict()``, so a late joiner or a restored checkpoint continues with the
swarm's H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_BOUNDS = (10, 500)
"""Default (lowest, highest) H: 500 is the DiLoCo paper's H; below 10 the outer step is
about as frequent as per-step averaging and DiLoCo's advantage is gone."""
DEFAULT_OVERHEAD = 0.05
"""Synchronous DiLoCo: the share of compute a blocking round may cost."""
DEFAULT_MARGIN = 1.5
"""Streaming DiLoCo: overlap this many times the measured round, for jitter."""


def check_bounds(bounds: tuple[int, int]) -> tuple[int, int]:
    """``bounds`` as ints, or ValueError when not ``1 <= lowest <= highest``."""
    low, high = int(bounds[0]), int(bounds[1])
    if not 1 <= low <= high:
        raise ValueError(f"local_steps bounds must satisfy 1 <= lowest <= highest, got {bounds}")
    return low, high


def diloco_local_steps(
    ratio: float,
    *,
    overhead: float = DEFAULT_OVERHEAD,
    bounds: tuple[int, int] = DEFAULT_BOUNDS,
) -> int:
    """The smallest H whose blocking round costs at most ``overhead`` of H inner steps.

    Args:
        ratio: seconds per round over seconds per inner step (>= 0).
        overhead: allowed round time as a share of the compute between rounds (> 0).
        bounds: (lowest, highest) H.
    """
    if not overhead > 0:
        raise ValueError(f"overhead must be positive, got {overhead}")
    low, high = check_bounds(bounds)
    if not math.isfinite(ratio) or ratio < 0:
        return high if ratio == math.inf else low
    return max(low, min(high, math.ceil(ratio / overhead - 1e-9)))


@dataclass(frozen=True)
class StreamingSchedule:
    """Streaming DiLoCo's schedule: H and the inner steps each round overlaps."""

    local_steps: int
    overlap_steps: int


def streaming_schedule(
    ratio: float,
    fragments: int,
    *,
    margin: float = DEFAULT_MARGIN,
    bounds: tuple[int, int] = DEFAULT_BOUNDS,
) -> StreamingSchedule:
    """H (a multiple of ``fragments``) and ``overlap_steps`` so that a round is hidden.

    ``overlap_steps = ceil(margin * ratio)`` (at least 1), H the smallest multiple of F of
    at least ``bounds[0]`` whose period H / F exceeds it; when that H is above
    ``bounds[1]``, H is the largest multiple of F within it (at least F * 2) and the
    overlap as long as that period allows (the round is then not fully hidden: the
    bound wins).

    Raises:
        ValueError: ``fragments`` < 1, ``margin`` <= 0, bad bounds, or bounds too low
            for F fragments of at least 2 steps each.
    """
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    if not margin > 0:
        raise ValueError(f"margin must be positive, got {margin}")
    low, high = check_bounds(bounds)
    if high < 2 * fragments:
        raise ValueError(
            f"the highest local_steps ({high}) must allow {fragments} fragments of at least "
            "2 inner steps each"
        )
    if not math.isfinite(ratio) or ratio < 0:
        ratio = math.inf if ratio == math.inf else 0.0
    overlap = max(1, math.ceil(margin * ratio - 1e-9)) if math.isfinite(ratio) else high
    period = max(overlap + 1, math.ceil(low / fragments), 2)
    longest = high // fragments
    if period > longest:
        period = longest
    return StreamingSchedule(local_steps=period * fragments, overlap_steps=min(overlap, period - 1))


class RoundTimer:
    """What a member has measured: seconds per inner step and per round.

    Inner steps are timed between two ``step()`` calls outside the syncs (a moving mean
    over the current outer step); a round is timed around the averaging call.
    """

    def __init__(self) -> None:
        self.step_seconds = 0.0
        self.steps = 0
        self.round_seconds: float | None = None

    def add_step(self, seconds: float) -> None:
        self.steps += 1
        self.step_seconds += (seconds - self.step_seconds) / self.steps

    def add_round(self, seconds: float) -> None:
        self.round_seconds = seconds

    def reset_steps(self) -> None:
        self.steps = 0
        self.step_seconds = 0.0

    def ratio_pair(self) -> tuple[float, float]:
        """``(known * ratio, known)``, the two numbers this member sends (module docstring)."""
        if self.round_seconds is None or self.steps == 0 or self.step_seconds <= 0:
            return 0.0, 0.0
        return self.round_seconds / self.step_seconds, 1.0


def swarm_ratio(weighted: float, known: float) -> float | None:
    """The swarm's ratio from the averaged pair, or None when no member knew one."""
    if not (math.isfinite(weighted) and math.isfinite(known)) or known <= 1e-6:
        return None
    return max(0.0, weighted / known)


__all__ = [
    "DEFAULT_BOUNDS",
    "DEFAULT_MARGIN",
    "DEFAULT_OVERHEAD",
    "RoundTimer",
    "StreamingSchedule",
    "check_bounds",
    "diloco_local_steps",
    "streaming_schedule",
    "swarm_ratio",
]
