"""The bandwidth a peer advertises in matchmaking: set by the user, or measured from rounds.

Part sizes follow the members' advertised bandwidths
(:mod:`~swarmavg.averaging.allreduce.load_balancing`). A constant guess makes every peer
look alike, and next to a peer whose user set ``--bandwidth 250`` a constant of 100 is off
by whatever the real links are. So a peer that is not told its bandwidth measures it: after
each round it takes the bytes the round moved in its busier direction (links are full
duplex; the load-balancing model counts one direction) over the round's exchange time,
and keeps an exponentially smoothed estimate of those samples, clamped to sane bounds.

What the measurement can and cannot see: a round lasts as long as its slowest member, so
a sample is the throughput this peer *achieved*, a lower bound of its link that the group's
bottleneck sets. The averager feeds the bytes this peer would have moved with an equal part
(``load_balancing.equal_share_factor``), not the bytes its own part made it move: otherwise
the member with the largest part reads as the fastest in every round, its part grows to the
cap on links that are all alike, and the group waits for it. Measured peers of one group
therefore report the same figure; the gain is that the figures are real MB/s, comparable
with the ones users set, and that they follow a peer's achieved throughput across groups
and over time. A user who knows the link is better served by setting it.

What a member measures also leans with its part: the round's last bytes are the replies of
the busiest reducer, which every other member waits for and the busiest does not, so the
member with the largest part ends its exchange first and reads as the fastest; and a first
sample's noise stays in the figures while they climb together from it. Each member following
its own samples therefore keeps apart from its group on links that are all alike (on the
test bed one of four members kept a part 1.28x to 1.5x the others', round after round, and
every round waited for it). So a member whose estimate lies within :data:`GROUP_BAND` of the
median of its group's claims takes its sample as a reading of the group's common rate: the
estimate moves from that median, not from its own last value, toward the sample (by
``smoothing``), and a sample within :data:`SAME_RATE` of the median leaves it at the median:
the members' figures become one in one round and stay one while their level follows the
samples that differ from it by more than a round's noise. A member whose estimate lies
outside the band (a link that really differs, a member next to a user's figure) moves its
own estimate as usual.

Samples that say little about bandwidth are left out: rounds that moved less than
``min_bytes`` (their time is latency, not throughput) and partial rounds (their exchange
waited for a member that stalled). Until the first sample, the estimate is a conservative
``initial`` value: an unmeasured peer takes a smaller part rather than stalling a group.

Pure and synchronous: no clock, no I/O; the averager feeds it what its rounds observed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

MB = 1_000_000
"""Bandwidths are in MB/s (10^6 bytes per second), the unit of ``--bandwidth``."""

DEFAULT_INITIAL = 10.0
"""MB/s advertised before the first measured round (about 80 Mbit/s: a modest uplink)."""

DEFAULT_BOUNDS = (0.1, 10_000.0)
"""Measured values are clamped to 0.1 MB/s (a poor mobile link) .. 10 GB/s (beyond 40GbE)."""

DEFAULT_SMOOTHING = 0.25
"""Weight of a new sample in the exponential moving average: one slow round moves the
estimate a quarter of the way, so a hiccup is not taken for the new normal."""

GROUP_BAND = 1.25
"""An estimate within this factor of the group's median claim is one of a group of alike
members, and its sample reads the group's common rate (see above)."""

SAME_RATE = 1.1
"""A sample of such a member within this factor of the group's median is that rate, within
a round's noise: the member then advertises the median itself. Part sizes amplify claims
(with four members a 2.5 % higher claim makes a 7.5 % larger part), so alike members that
differ by their samples' noise still wait for the largest part; equal figures do not."""

DEFAULT_MIN_BYTES = 8 << 20
"""Rounds that moved less than this (8 MiB) in their busier direction are not measured: their
time is mostly round trips. On the test bed's 12.5 MB/s links at 50 ms RTT a round that
moved 1.5 MB read 2.1-2.4 MB/s; that first sample replaced the starting value, and the
members' figures took ten rounds to climb back to the 10 MB/s that 16 MB rounds read. 8 MiB
take 0.67 s at 12.5 MB/s: several round trips of a 100 ms link."""


class ThroughputEstimator:
    """This peer's advertised bandwidth in MB/s: the user's figure, or a measured one.

    With ``fixed`` set, :attr:`value` is always ``fixed`` and :meth:`observe` ignores every
    sample. Otherwise :attr:`value` starts at ``initial``; the first accepted sample
    replaces it (the initial value is a placeholder, not evidence) and later samples are
    blended in with weight ``smoothing``. Every value is clamped to ``bounds``.
    """

    def __init__(
        self,
        fixed: float | None = None,
        *,
        initial: float = DEFAULT_INITIAL,
        bounds: tuple[float, float] = DEFAULT_BOUNDS,
        smoothing: float = DEFAULT_SMOOTHING,
        min_bytes: int = DEFAULT_MIN_BYTES,
    ) -> None:
        """Args:
        fixed: the bandwidth the user set (MB/s, finite and >= 0); ``None``: measure.
        initial: MB/s advertised until the first accepted sample.
        bounds: ``(low, high)`` MB/s that measured values are clamped to; ``0 < low <= high``.
        smoothing: weight of a new sample, in ``(0, 1]``.
        min_bytes: smallest sample (bytes in the busier direction) that counts.

        Raises:
            ValueError: a parameter outside the ranges above.
        """
        low, high = bounds
        if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
            raise ValueError(f"bounds must be finite with 0 < low <= high, got {bounds}")
        if not low <= initial <= high:
            raise ValueError(f"initial {initial} must lie within bounds {bounds}")
        if fixed is not None and not (math.isfinite(fixed) and fixed >= 0):
            raise ValueError(f"bandwidth must be finite and >= 0, got {fixed}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if min_bytes < 1:
            raise ValueError(f"min_bytes must be >= 1, got {min_bytes}")
        self._fixed = fixed
        self._bounds = (float(low), float(high))
        self._smoothing = float(smoothing)
        self._min_bytes = int(min_bytes)
        self._value = float(initial)
        self._samples = 0

    @property
    def measured(self) -> bool:
        """Whether the value comes from rounds (``False``: the user set it)."""
        return self._fixed is None

    @property
    def value(self) -> float:
        """The bandwidth to advertise, in MB/s."""
        return self._value if self._fixed is None else self._fixed

    @property
    def samples(self) -> int:
        """Rounds that went into the measured value so far (0 when set, or before any)."""
        return self._samples

    def observe(
        self,
        nbytes: int,
        seconds: float,
        *,
        partial: bool = False,
        group: Sequence[float] = (),
    ) -> bool:
        """Feed one round: ``nbytes`` moved in its busier direction in ``seconds``.

        Args:
            nbytes: payload bytes of the round in the direction that moved more.
            seconds: the round's exchange time (data on the wire, not matchmaking).
            partial: the round lost a member; such a round is not measured.
            group: the bandwidths the round's reducers claimed (this member's among them);
                while the estimate lies within :data:`GROUP_BAND` of their median, the
                sample moves it from that median (see the module's doc). Empty: from
                this member's own estimate.

        Returns:
            Whether the sample changed the estimate (``False`` when the bandwidth is set,
            the round was partial, too small, or its time not positive and finite).
        """
        if (
            self._fixed is not None
            or partial
            or nbytes < self._min_bytes
            or not (math.isfinite(seconds) and seconds > 0)
        ):
            return False
        low, high = self._bounds
        sample = min(max(nbytes / MB / seconds, low), high)
        claims = [c for c in group if math.isfinite(c) and c > 0]
        median = statistics.median(claims) if len(claims) > 1 else 0.0
        # One of a group of alike members (else: its own link, its own estimate).
        alike = median > 0 and median / GROUP_BAND <= self._value <= median * GROUP_BAND
        base = median if alike else self._value
        if self._samples == 0:
            self._value = sample
        elif alike and median / SAME_RATE <= sample <= median * SAME_RATE:
            self._value = median  # the group's rate within a sample's noise: all say the same
        else:
            self._value = min(max(base + self._smoothing * (sample - base), low), high)
        self._samples += 1
        return True
