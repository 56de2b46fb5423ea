"""Whether a trainer has company, and when to say that it has none (pure, no network).

A trainer that sees no other trainer of its run takes every global step alone: it makes
progress, so nothing fails, and it ends with a model of its own. The usual causes are a
run id that differs from the others' (a typo, or a run id given to the wrapper that is not
the daemons'), trainers that have not started yet, or trainers that left. None of them is
an error the wrapper could raise; all of them are worth one clear line in the log.

:class:`CompanyWatch` sees, after each step, whether another daemon reports progress in the
trainer's run, and says when that has not been so for ``alone_after`` seconds: once for a
trainer that never had company, once each time the others left, and once when company
comes (back). It also says when no global step happened for ``stalled_after`` seconds while
the trainer keeps stepping (a ``target_batch_size`` the swarm takes very long to reach).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

DEFAULT_ALONE_AFTER = 60.0
"""Seconds without another trainer of the run before a trainer says it is alone: longer than
the spread of a swarm's start (each trainer imports torch and loads its data), short enough
to be read in the first minutes of a run."""
DEFAULT_STALLED_AFTER = 300.0
"""Seconds without a global step before a trainer that keeps stepping says so."""


class Event(enum.Enum):
    """What :meth:`CompanyWatch.update` has to say."""

    NEVER_MET = "never_met"
    """No other trainer of the run was ever seen, for ``alone_after`` seconds."""
    LEFT_ALONE = "left_alone"
    """The others were seen before and have been gone for ``alone_after`` seconds."""
    COMPANY = "company"
    """Another trainer is seen again after a warning."""
    STALLED = "stalled"
    """No global step for ``stalled_after`` seconds."""


@dataclass
class CompanyWatch:
    """Decides when a trainer says it is alone (see the module docstring).

    Args:
        alone_after: seconds alone before :attr:`Event.NEVER_MET` / :attr:`Event.LEFT_ALONE`
            (``inf``: never).
        stalled_after: seconds without a global step before :attr:`Event.STALLED`
            (``inf``: never).
        started: the monotonic time the trainer started.

    Raises:
        ValueError: a threshold that is not positive.
    """

    alone_after: float = DEFAULT_ALONE_AFTER
    stalled_after: float = DEFAULT_STALLED_AFTER
    started: float = 0.0

    def __post_init__(self) -> None:
        if not (self.alone_after > 0 and self.stalled_after > 0):
            raise ValueError(
                f"alone_after and stalled_after must be positive, got "
                f"{self.alone_after} and {self.stalled_after}"
            )
        self.met = False
        """Another trainer of the run was seen at least once."""
        self.alone_since: float | None = self.started
        """When the trainer was last left without company (None: it has company now)."""
        self.warned = False
        """An alone event was said and company has not come since."""
        self._epoch: int | None = None
        self._epoch_since = self.started
        self._stall_warned = False

    def alone_for(self, now: float) -> float:
        """Seconds the trainer has been without company (0: it has company)."""
        return 0.0 if self.alone_since is None else max(now - self.alone_since, 0.0)

    def update(self, has_company: bool, epoch: int, now: float) -> Event | None:
        """Take one observation (after a step); return what to say now, if anything."""
        stalled = self._stall(epoch, now)
        if has_company:
            self.met = True
            self.alone_since = None
            if self.warned:
                self.warned = False
                return Event.COMPANY
            return stalled
        if self.alone_since is None:
            self.alone_since = now
        if not self.warned and now - self.alone_since >= self.alone_after:
            self.warned = True
            return Event.LEFT_ALONE if self.met else Event.NEVER_MET
        return stalled

    def _stall(self, epoch: int, now: float) -> Event | None:
        if epoch != self._epoch:
            self._epoch, self._epoch_since, self._stall_warned = epoch, now, False
            return None
        if self._stall_warned or not math.isfinite(self.stalled_after):
            return None
        if now - self._epoch_since >= self.stalled_after:
            self._stall_warned = True
            return Event.STALLED
        return None


__all__ = ["DEFAULT_ALONE_AFTER", "DEFAULT_STALLED_AFTER", "CompanyWatch", "Event"]
