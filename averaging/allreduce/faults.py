"""Fault injection seam for the butterfly all-reduce (a fixture for tests and benchmarks).

A :class:`FaultPlan` is passed to :func:`swarmavg.averaging.allreduce.runner.run_allreduce`;
the runner consults it at two points (before it sends a chunk of its tensors, before it
returns an averaged chunk of its own part). Production code passes ``None`` and never
pays for it. Tests and benchmarks use it to make one member misbehave the way a dying
or stalled peer does, without copying any production code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Fault(enum.Enum):
    """What the faulty member does once the plan triggers."""

    STOP_SENDING = "stop-sending"
    """Stop writing its chunks to every reducer; its streams stay open (a stalled sender)."""
    STOP_REDUCING = "stop-reducing"
    """Stop returning averaged chunks of its own part; streams stay open (a stalled reducer)."""
    CRASH = "crash"
    """Drop every stream at once, in and out, and fail the round (a killed process)."""
    REDUCER_RAISES = "reducer-raises"
    """The task returning averaged chunks of its own part raises (a bug, a codec that
    fails on the average): the round must log it and report the part as not averaged."""


@dataclass(frozen=True)
class FaultPlan:
    """Trigger ``fault`` after ``after_chunks`` chunks.

    For ``STOP_SENDING`` and ``CRASH`` the count is the chunks this member has sent to
    each reducer; for ``STOP_REDUCING`` it is the averaged chunks of its part returned.
    """

    fault: Fault
    after_chunks: int = 0

    def __post_init__(self) -> None:
        if self.after_chunks < 0:
            raise ValueError("after_chunks must be >= 0")

    def stops_sending(self, sent: int) -> bool:
        """Whether the sender must not send its chunk number ``sent`` (0-based)."""
        return self.fault is Fault.STOP_SENDING and sent >= self.after_chunks

    def crashes(self, sent: int) -> bool:
        """Whether the member crashes instead of sending chunk number ``sent``."""
        return self.fault is Fault.CRASH and sent >= self.after_chunks

    def reducer_raises(self, returned: int) -> bool:
        """Whether the reducer raises instead of returning averaged chunk ``returned``."""
        return self.fault is Fault.REDUCER_RAISES and returned >= self.after_chunks

    def stops_reducing(self, returned: int) -> bool:
        """Whether the reducer must not return averaged chunk number ``returned``."""
        return self.fault is Fault.STOP_REDUCING and returned >= self.after_chunks


class InjectedFault(RuntimeError):
    """Raised inside a task of the round where its fault plan says (``REDUCER_RAISES``)."""


class InjectedCrash(RuntimeError):
    """Raised by the runner of a member whose fault plan made it crash."""
