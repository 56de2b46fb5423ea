"""Reusable, already faulted-in buffers for the data path (issue 21).

A 64 MB round used to allocate its large buffers afresh every round (the reducer's
accumulator, the daemon's copy of a client's inputs). Memory that large comes straight
from ``mmap`` and goes back to the kernel when freed, so every round paid a page fault
per 4 KiB page on first touch (as much CPU as a copy of the same bytes) and the kernel's
zeroing of each page. A training loop averages the same layout every step, so a pool
that keeps the last few buffers of each size takes the faults out of the hot path.

Bounded: at most ``max_idle_bytes`` are kept idle (the least recently returned go first),
so a daemon that once averaged a big model and then a small one does not hold the big
buffers forever beyond that cap.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

DEFAULT_MAX_IDLE_BYTES = 512 << 20
"""Idle bytes a pool keeps for reuse; a buffer returned beyond this is freed."""


class BufferPool:
    """Byte buffers by exact size, taken for one round and given back after it.

    Thread-safe: buffers are taken on the event loop and given back from executor
    threads too. A buffer's contents are whatever its last user left: callers overwrite
    it completely (or only read what they wrote).
    """

    def __init__(self, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES) -> None:
        if max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0, got {max_idle_bytes}")
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: OrderedDict[int, list[np.ndarray]] = OrderedDict()  # oldest size first
        self._idle_bytes = 0
        self.reused = 0
        """How many takes were served from idle buffers (tests and benchmarks read it)."""

    def take(self, count: int, dtype: np.dtype | type[np.generic]) -> np.ndarray:
        """A 1-D array of ``count`` elements of ``dtype``: an idle buffer when one of that
        byte size exists, else a new one (uninitialised either way)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        with self._lock:
            stack = self._idle.get(nbytes)
            raw = stack.pop() if stack else None
            if raw is not None:
                self._idle_bytes -= nbytes
                self.reused += 1
                if not stack:
                    del self._idle[nbytes]
        if raw is None:
            raw = np.empty(nbytes, dtype=np.uint8)
        return raw.view(dtype)

    def give(self, buffer: np.ndarray) -> None:
        """Return a buffer that :meth:`take` handed out; nobody may use it afterwards."""
        raw = buffer.reshape(-1).view(np.uint8)
        nbytes = raw.nbytes
        if nbytes == 0 or nbytes > self.max_idle_bytes:
            return
        with self._lock:
            self._idle.setdefault(nbytes, []).append(raw)
            self._idle.move_to_end(nbytes)
            self._idle_bytes += nbytes
            while self._idle_bytes > self.max_idle_bytes:
                size, stack = next(iter(self._idle.items()))
                stack.pop(0)
                self._idle_bytes -= size
                if not stack:
                    del self._idle[size]

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


__all__ = ["DEFAULT_MAX_IDLE_BYTES", "BufferPool"]
