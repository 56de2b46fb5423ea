"""Network work a training step hands off: newest first, one at a time, never reordered.

A training wrapper tells the swarm things that only matter once they are current: the
state it publishes for late joiners, its progress record. Waiting for the daemon's answer
at each of them puts the network on the training step; running them unordered could let
an older state land after a newer one. :class:`LatestWork` runs such jobs on one thread of
its own, in the order they were handed over, and when a job is handed over while an
earlier one still waits to start, the earlier one is dropped: what it would have said is
out of date, and its arguments are let go at once (a publish's are a copy of the whole
state). So at most one job runs and one waits, the last job handed over always runs,
and nothing older lands after it. A job that fails is logged (the next one replaces what
it would have done); :meth:`LatestWork.close` waits for the work left within a deadline
and drops what has not started by then.

The caller hands over a job that only reads its arguments: a snapshot taken on its own
thread (a copy of the state, a record), never the live tensors that keep training.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from swarmavg.averaging.signal_mask import leave_signals_to_main_thread

log = logging.getLogger(__name__)


class LatestWork:
    """One background thread for one kind of job, newest first (module docstring).

    Args:
        name: what the jobs are, for the thread's name and the log lines
            (``"state publish"``).

    Thread-safe for the submitting side; the jobs run on the thread this object owns.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None  # made on first use
        self._futures: list[Future[Any]] = []
        """The jobs handed over and not known to be done (the last one is the newest)."""
        self._newest: list[Any] = []
        """The newest job's ``[job, args, kwargs]``, emptied when it is dropped or starts."""
        self._closed = False
        self.submitted = 0
        self.dropped = 0
        """Jobs replaced by a newer one before they started."""
        self.failed = 0
        self.last_error = ""

    def submit(self, job: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``job(*args, **kwargs)`` after the job running now; a job that was still
        waiting to start is dropped (its future is cancelled).

        Raises:
            RuntimeError: after :meth:`close`.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submitted after close()")
            if self._executor is None:
                prefix = "swarmavg-" + self.name.replace(" ", "-")
                self._executor = ThreadPoolExecutor(
                    1, thread_name_prefix=prefix, initializer=leave_signals_to_main_thread
                )
            # One thread: every job before the newest has started (it cannot be
            # cancelled) or waits (it can); only the newest can be waiting.
            self._drop_waiting()
            held = [job, args, kwargs]
            future = self._executor.submit(self._run_held, held)
            self._newest = held
            self._futures = [f for f in self._futures if not f.done()] + [future]
            self.submitted += 1
            return future

    def _drop_waiting(self) -> None:
        """Cancel the newest job if it has not started (under the lock), and let go of
        its arguments: the executor keeps a cancelled job in its queue until the running
        one ends, and a publish's arguments are a copy of the whole state."""
        if self._futures and self._futures[-1].cancel():
            self.dropped += 1
            self._newest.clear()

    def _run_held(self, held: list[Any]) -> Any:
        with self._lock:
            job, args, kwargs = held
            held.clear()  # from here the job's own frame holds what it needs
        return self._run(job, args, kwargs)

    def _run(self, job: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return job(*args, **kwargs)
        except Exception as exc:  # the next job replaces what this one would have done
            with self._lock:
                self.failed += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("a background %s failed: %s", self.name, self.last_error)
            return None

    def busy(self) -> bool:
        """Whether a job runs or waits."""
        with self._lock:
            return any(not f.done() for f in self._futures)

    def settle(self, timeout: float) -> bool:
        """Wait until every job handed over so far has run (or was dropped), at most
        ``timeout`` seconds; True when none is left."""
        deadline = time.monotonic() + timeout
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except CancelledError:
                continue
            except FutureTimeout:
                return False
        return True

    def close(self, timeout: float) -> bool:
        """Let the work left finish within ``timeout`` seconds, then drop what has not
        started and stop the thread (idempotent). A job still running past the deadline
        is left to its own call deadline, logged; True when everything finished."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        finished = self.settle(timeout)
        with self._lock:
            executor, self._executor = self._executor, None
            self._drop_waiting()
        if not finished:
            log.warning(
                "a background %s did not finish within %.1fs of close(); left to its deadline",
                self.name,
                timeout,
            )
        if executor is not None:
            executor.shutdown(wait=finished, cancel_futures=True)
        return finished


__all__ = ["LatestWork"]
