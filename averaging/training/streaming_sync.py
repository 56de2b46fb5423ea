"""One Streaming DiLoCo fragment sync in flight: everything it asks the network, off the step.

When a sync starts, the training thread only takes a snapshot (the fragment's parameters)
and hands :func:`run_sync` to the sync's thread; the inner steps go on at once. On that
thread the sync reads the swarm's progress (is this member behind? how many members does
the round wait for?) while its own progress record is being stored, computes the
fragment's pseudo-gradient from the snapshot and the digest of the shared state, waits for
the store, and runs the round. ``overlap_steps`` inner steps later the training thread
takes the :class:`SyncOutcome` and applies it (or catches up).

Why reading the live anchor and outer optimizer state on the sync's thread is safe: only
applying a sync (or catching up, or a repair) changes them, and each of those happens on
the training thread after this sync's outcome was taken; until then they are the state
of the epoch the sync belongs to, the one the round's members share and digest.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from swarmavg.averaging.run_records.progress import GlobalProgress
from swarmavg.averaging.training.left_out import await_swarm_step
from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.averaging.training.swarm import RoundResultLike, SwarmLink

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SyncOutcome:
    """What a sync's thread found and did.

    Attributes:
        progress: the swarm's progress read when the sync started.
        behind: the swarm is not at this sync's epoch (it passed it, or this member is
            ahead of its majority): no round ran, or it closed without this member and the
            swarm stepped meanwhile (catch up instead).
        local: this member's pseudo-gradient of the fragment (empty when ``behind``).
        digest: the shared state's digest attached to the round (empty when ``behind``).
        result: the round's result; None when it failed, or ran alone (one member).
        error: why the round failed ("" otherwise).
        seconds: the round's time.
    """

    progress: GlobalProgress
    behind: bool
    local: list[np.ndarray]
    digest: bytes
    result: RoundResultLike | None
    error: str
    seconds: float


@dataclass
class RankSync:
    """Hierarchical mode: a fragment sync as every rank of the machine tracks it (only the
    leader runs its round; the others know when it lands from the shared step count)."""

    fragment: int
    start: list[torch.Tensor]
    """The fragment's parameters when the sync started (the machine's mean: the same on
    every rank)."""
    waited: int = 0


@dataclass
class PendingSync:
    """A fragment sync whose work runs on the sync's thread."""

    epoch: int
    fragment: int
    start: list[torch.Tensor]
    """The fragment's parameters when the sync started (a copy)."""
    future: Future[SyncOutcome]
    samples: int
    """This member's samples counted when the sync started (its round's weight)."""
    waited: int = 0


def run_sync(
    tracker: ProgressTracker,
    link: SwarmLink,
    epoch: int,
    *,
    local: Callable[[], list[np.ndarray]],
    digest: Callable[[], bytes],
    with_schedule: Callable[[list[np.ndarray]], list[np.ndarray]],
    weight: float,
    reported: Future[Any] | None = None,
) -> SyncOutcome:
    """Sync ``epoch`` on the sync's thread (module docstring).

    Args:
        tracker: reads the swarm's progress (the training thread does not read it while a
            sync is in flight).
        link: runs the round under ``diloco.{epoch}``.
        local: computes the fragment's pseudo-gradient from the snapshot.
        digest: computes the shared state's digest.
        with_schedule: adds what the round carries besides the pseudo-gradient.
        weight: this member's samples (the round's weight).
        reported: the store of this member's record for this sync (waited for before the
            round declares).
    """
    # The read takes this member's own record from memory, so it runs while the store of
    # that record is still on its way (one round trip to the DHT instead of two).
    progress = tracker.refresh()
    if progress.epoch != epoch:  # behind the swarm, or ahead of its majority
        return SyncOutcome(progress, True, [], b"", None, "", 0.0)
    arrays, mine = local(), digest()
    expected = progress.round_members(tracker.peer_id)
    if len(expected) <= 1:
        return SyncOutcome(progress, False, arrays, mine, None, "", 0.0)
    # The others count this member in their rounds from its record: it must be in the DHT
    # before this round declares (as when the store blocked the step), or a member that
    # reads right after would find it a sync behind and take itself for alone.
    if reported is not None:
        with contextlib.suppress(CancelledError, FutureTimeout):
            reported.result(timeout=link.timeout)
    failed, left_out = link.stats.failed, link.stats.left_out
    started = time.monotonic()
    result = link.average(
        with_schedule(arrays),
        key=f"diloco.{epoch}",
        weight=weight,
        group_size=len(expected),
        warn=False,
        state_digest=mine,
        expected=expected,
    )
    if result is None and len(expected) > progress.num_peers:
        # it waited for processes catching up that did not come (round_members)
        link.no_shows.note(expected, [tracker.peer_id])
    error = link.stats.last_error if link.stats.failed > failed else ""
    seconds = time.monotonic() - started
    if result is None and link.stats.left_out > left_out:
        # Their round closed without us and is still running: wait here, off the training
        # thread, for their step, which the sync's outcome then catches up with (left_out).
        after = await_swarm_step(tracker, epoch, link.timeout)
        if after.epoch != epoch:
            return SyncOutcome(after, True, [], b"", None, error, seconds)
    return SyncOutcome(progress, False, arrays, mine, result, error, seconds)


__all__ = ["PendingSync", "RankSync", "SyncOutcome", "run_sync"]
