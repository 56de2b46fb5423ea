"""``verbose=True`` on the training wrappers: a progress line now and then.

The line says the epoch, how far the swarm is towards the next global step, the swarm's
throughput and the time to that step, e.g.::

    epoch 12: 3072/4096 samples (75%), swarm 512.0 samples/s from 4 peers, next step in ~2 s

It goes through the library's logger at INFO (``swarmavg.averaging.training.verbose``), so
``swarmavg.peer.enable_logging()`` (or the script's own logging setup) makes it visible.
A line is written at most every ``every`` seconds (:class:`ProgressLog`), so a fast training
loop does not flood the log, and never at an epoch's empty start.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_EVERY = 10.0
"""Seconds between two lines within one epoch."""


def eta_text(seconds: float) -> str:
    """``~2 s``, ``~3 min``, ``unknown`` (nobody is making progress), ``due now``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "unknown"
    if seconds == 0:
        return "due now"
    if seconds < 1:
        return "<1 s"
    if seconds < 90:
        return f"~{seconds:.0f} s"
    if seconds < 5400:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"


def progress_line(
    epoch: int, samples: int, target: int, samples_per_second: float, peers: int, eta: float
) -> str:
    """The line :class:`ProgressLog` writes (see the module docstring)."""
    share = f" ({min(samples / target, 1.0):.0%})" if target > 0 else ""
    eta_part = eta_text(eta)
    when = "next step due now" if eta_part == "due now" else f"next step in {eta_part}"
    return (
        f"epoch {epoch}: {samples}/{target} samples{share}, swarm "
        f"{samples_per_second:.1f} samples/s from {peers} peer{'s' if peers != 1 else ''}, "
        f"{when}"
    )


class ProgressLog:
    """Decides when a wrapper writes its progress line, and writes it.

    A line is written at the first update and then at most every ``every`` seconds. A line
    that falls due at the step that began a new epoch waits for the next step, so that it
    shows how far the epoch got instead of its empty start (an epoch of one step is
    logged anyway, at its second due step). The throughput is smoothed over about
    ``every`` seconds: the swarm's figure is a sum of the processes' recent rates, which
    jumps as rounds pause them. A line after global steps says how many were taken since
    the previous line.

    Args:
        every: seconds between two lines.
        clock: monotonic seconds (tests pass their own).
        logger: where the lines go.

    Raises:
        ValueError: ``every`` not positive.
    """

    def __init__(
        self,
        every: float = DEFAULT_EVERY,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        if not every > 0:
            raise ValueError(f"every must be positive, got {every}")
        self.every = every
        self._clock = clock
        self._logger = logger
        self._epoch: int | None = None  # at the previous update
        self._logged_epoch: int | None = None  # at the previous line
        self._last = -math.inf
        self._deferred = False
        self.rate: float | None = None
        """The smoothed swarm throughput (None before the first update)."""
        self._rate_at = 0.0

    def _smooth(self, samples_per_second: float, now: float) -> float:
        if self.rate is None or not math.isfinite(self.rate):
            self.rate = samples_per_second
        else:
            weight = 1.0 - math.exp(-max(now - self._rate_at, 0.0) / self.every)
            self.rate += weight * (samples_per_second - self.rate)
        self._rate_at = now
        return self.rate

    def update(
        self,
        epoch: int,
        samples: int,
        target: int,
        samples_per_second: float,
        peers: int,
        eta: float,
    ) -> bool:
        """Write the line if it is due (see the class docstring); say whether."""
        now = self._clock()
        rate = self._smooth(samples_per_second, now)
        new_epoch = self._epoch is not None and epoch != self._epoch
        self._epoch = epoch
        if self._logged_epoch is not None and now - self._last < self.every:
            return False
        if new_epoch and not self._deferred:
            self._deferred = True
            return False
        steps = 0 if self._logged_epoch is None else max(epoch - self._logged_epoch, 0)
        self._deferred = False
        self._logged_epoch, self._last = epoch, now
        line = progress_line(epoch, samples, target, rate, peers, eta)
        if steps:
            line += f" ({steps} global step{'s' if steps != 1 else ''} since the last line)"
        self._logger.info("%s", line)
        return True
