"""``verbose=True`` on the training wrappers: a progress line now and then.

The line says the epoch, how far the swarm is towards the next global step, the swarm's
throughput and the time to that step, e.g.::

    epoch 12: 3072/4096 samples (75%), swarm 512.0 samples/s from 4 peers, next step in ~2 s

It goes through the library's logger at INFO (``swarmavg.averaging.training.verbose``), so
``swarmavg.peer.enable_logging()`` (or the script's own logging setup) makes it visible.
A line is written when the epoch changes and otherwise at most every ``every`` seconds, so
a fast training loop does not flood the log.
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

    Args:
        every: seconds between two lines within one epoch (a new epoch always logs).
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
        self._epoch: int | None = None
        self._last = -math.inf

    def update(
        self,
        epoch: int,
        samples: int,
        target: int,
        samples_per_second: float,
        peers: int,
        eta: float,
    ) -> bool:
        """Write the line if the epoch changed or ``every`` seconds passed; say whether."""
        now = self._clock()
        if epoch == self._epoch and now - self._last < self.every:
            return False
        self._epoch, self._last = epoch, now
        self._logger.info(
            "%s", progress_line(epoch, samples, target, samples_per_second, peers, eta)
        )
        return True
