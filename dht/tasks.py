"""Owned background tasks, and bounded steps of a shutdown sequence.

Every task has an owner that cancels and awaits it (STYLE, asyncio). A component that
starts work it does not await on the spot (a ping of a full bucket's oldest contact, a
cache store, one data-plane connection, one local batch) spawns it into its
:class:`TaskSet` and closes the set when it stops. Nobody else awaits such a task, so a
failure is logged the moment the task ends: otherwise its exception would be lost (or
surface only as "Task exception was never retrieved" when it is garbage collected).

This is the lowest package that runs tasks, so ``averaging`` and ``peer`` use it too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine, Iterator
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class TaskSet:
    """The background tasks one component owns.

    Create and use it inside the running event loop. A finished task leaves the set by
    itself; one that raised is logged (with its traceback) as it finishes. :meth:`close`
    cancels and awaits every task and may be called any number of times; the set stays
    usable afterwards (a task spawned later is closed by the next :meth:`close`), so a
    component that must refuse new work after closing keeps its own flag.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Start ``coro`` as a task owned by this set and return the task.

        Args:
            coro: the coroutine to run.
            name: the task's name (shown in logs and by ``asyncio.all_tasks``).
        """
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background task %s failed", task.get_name(), exc_info=exc)

    def __len__(self) -> int:
        """How many tasks are still running."""
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        """The tasks still running (a snapshot: spawning or finishing meanwhile is safe)."""
        return iter(list(self._tasks))

    def cancel(self) -> None:
        """Ask every task to stop, without waiting (see :meth:`close`)."""
        for task in list(self._tasks):
            task.cancel()

    async def close(self) -> None:
        """Cancel every task and wait until each has finished. Idempotent.

        Tasks spawned while closing (e.g. from another task's cleanup) are cancelled
        too. A task's exception is logged, not raised. If the caller itself is cancelled
        while waiting, ``CancelledError`` propagates; the tasks keep their cancellation.
        """
        while pending := [t for t in self._tasks if not t.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending)

    async def join(self) -> None:
        """Wait, without cancelling them, until every task (also those spawned meanwhile)
        has finished. A task's exception is logged, not raised."""
        while pending := [t for t in self._tasks if not t.done()]:
            await asyncio.wait(pending)


async def bounded_step(awaitable: Awaitable[Any], seconds: float, what: str) -> None:
    """Await one shutdown step for at most ``seconds`` (at least 0.1); log and move on if
    it times out or fails, so that one slow or broken step cannot stall the steps after it.

    Args:
        awaitable: the step (e.g. ``server.stop(0.2)``); cancelled if it overruns.
        seconds: its time limit.
        what: the step's name in the warning.

    Raises:
        CancelledError: the caller was cancelled (never swallowed).
    """
    try:
        await asyncio.wait_for(awaitable, timeout=max(seconds, 0.1))
    except TimeoutError:
        log.warning("%s did not finish within %.1f s", what, seconds)
    except Exception:
        log.warning("%s failed", what, exc_info=True)
