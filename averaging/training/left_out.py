"""A member that its sync's round closed without: wait for the swarm's step, never step alone.

The leader waits for a late member only a bounded grace (docs/training.md, "when a member
is waited for"); a member that misses it is told at once (``RoundClosedError``) while the
others' round is still running. Their step is not visible yet: the swarm's epoch moves
only when they report the next one. Stepping alone with its own pseudo-gradient there
would leave this member with an anchor and outer state of its own until a later digest
check repairs it (a download). Instead it waits, bounded by one round's timeout, for the
swarm's epoch to move, and then takes the late-member path (the swarm's anchor, its work
merged or discarded by :mod:`~swarmavg.averaging.training.late_work`). Only when the
others' step does not show up by then (their round failed too, or they stopped) does it
step alone as any member of a failed round does.
"""

from __future__ import annotations

import time

from swarmavg.averaging.run_records.progress import GlobalProgress
from swarmavg.averaging.training.progress import ProgressTracker

LEFT_OUT_POLL = 0.02
"""Seconds between two reads of the progress records while waiting for the others' step:
short next to a round, and one DHT read each."""


def await_swarm_step(tracker: ProgressTracker, epoch: int, timeout: float) -> GlobalProgress:
    """Read the swarm's progress until its epoch is no longer ``epoch`` or ``timeout``
    seconds passed; the last progress read (still at ``epoch`` when the others' step did
    not show up in time)."""
    deadline = time.monotonic() + timeout
    while True:
        progress = tracker.refresh()
        left = deadline - time.monotonic()
        if progress.epoch != epoch or left <= 0:
            return progress
        time.sleep(min(LEFT_OUT_POLL, left))


__all__ = ["LEFT_OUT_POLL", "await_swarm_step"]
