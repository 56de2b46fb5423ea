"""Reusable, already faulted-in buffers for the data path.

A 64 MB round used to allocate its large buffers afresh every round (the reducer's
accumulator, the daemon's copy of a client's inputs). Memory that large comes straight
from ``mmap`` and goes back to the kernel when freed, so every round paid a page fault
per 4 KiB page on first touch (as much CPU as a copy of the same bytes) and the kernel's
zeroing of each page. A training loop averages the same layout every step, so a pool
that keeps the last few buffers of each size takes the faults out of the hot path.

Bounded: at most ``max_idle`` buffers and ``max_idle_bytes`` are kept idle (the least
recently returned go first), so a daemon that once averaged a big model and then a small
one does not hold the big buffers beyond that cap.
"""

from __future__ import annotations

import threading

import numpy as np

DEFAULT_MAX_IDLE_BYTES = 256 << 20
"""Idle bytes a pool keeps for reuse; buffers returned beyond this are freed."""


class BufferPool:
    """Byte buffers taken for one round and given back after it.

    A buffer fits a request of ``n`` bytes when it holds between ``n`` and ``SLACK * n``
    bytes, and new buffers get ``HEADROOM`` more than asked: a reducer's part size follows
    the members' measured bandwidths, so it drifts a little from round to round, and an
    exact-size pool would miss every time while keeping the misses idle.

    Thread-safe: buffers are taken on the event loop and given back from executor
    threads too. A buffer's contents are whatever its last user left: callers overwrite
    it completely (or only read what they wrote).
    """

    SLACK = 1.5
    HEADROOM = 1.125

    def __init__(self, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES, max_idle: int = 2) -> None:
        if max_idle_bytes < 0 or max_idle < 0:
            raise ValueError("max_idle_bytes and max_idle must be >= 0")
        self.max_idle_bytes = max_idle_bytes
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[np.ndarray] = []  # whole allocations, least recently given first
        self.reused = 0
        """How many takes were served from idle buffers (tests and benchmarks read it)."""

    def take(self, count: int, dtype: np.dtype | type[np.generic]) -> np.ndarray:
        """A 1-D array of ``count`` elements of ``dtype``: part of an idle buffer that fits,
        else of a new one (uninitialised either way)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        raw = None
        with self._lock:
            fitting = [
                (b.nbytes, i)
                for i, b in enumerate(self._idle)
                if nbytes <= b.nbytes <= max(self.SLACK * nbytes, 64)
            ]
            if fitting:
                raw = self._idle.pop(min(fitting)[1])
                self.reused += 1
        if raw is None:
            size = nbytes if nbytes < (1 << 20) else int(nbytes * self.HEADROOM)
            raw = np.empty(size, dtype=np.uint8)
        return raw[:nbytes].view(dtype)

    def give(self, buffer: np.ndarray) -> None:
        """Return a buffer that :meth:`take` handed out; nobody may use it afterwards."""
        raw = buffer
        while isinstance(raw.base, np.ndarray):
            raw = raw.base  # the whole allocation behind the view take() returned
        if raw.dtype != np.uint8 or raw.ndim != 1 or raw.base is not None:
            return  # not one of ours: let it go
        if raw.nbytes == 0 or raw.nbytes > self.max_idle_bytes:
            return
        with self._lock:
            if any(b is raw for b in self._idle):
                return
            self._idle.append(raw)
            while len(self._idle) > self.max_idle or self.idle_bytes_locked() > self.max_idle_bytes:
                self._idle.pop(0)

    def idle_bytes_locked(self) -> int:
        return sum(b.nbytes for b in self._idle)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self.idle_bytes_locked()

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()


__all__ = ["DEFAULT_MAX_IDLE_BYTES", "BufferPool"]
