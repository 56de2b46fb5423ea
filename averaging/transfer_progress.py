"""Progress of one state download: bytes, rate, ETA, so that long work is never silent.

Pure and synchronous: the sharer counts the verified bytes as chunks arrive, logs a line
every :data:`LOG_EVERY` seconds, and the control service forwards the figures to the
training process that asked (which shows a tqdm bar on a terminal, log lines otherwise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

LOG_EVERY = 5.0
"""Seconds between two progress log lines of one download."""


def format_bytes(n: float) -> str:
    """``812 B``, ``3.1 MiB``, ``1.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - unreachable


def format_seconds(seconds: float) -> str:
    """``7 s``, ``3 min``, ``1.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass
class TransferProgress:
    """Bytes of one transfer so far.

    Attributes:
        total: bytes to transfer (what is already held locally is not counted).
        done: bytes transferred and verified so far.
        started: ``time.monotonic()`` at the start.
    """

    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    _logged: float = field(default=0.0, repr=False)

    def add(self, n: int) -> None:
        """Count ``n`` more bytes."""
        self.done += n

    def elapsed(self, now: float | None = None) -> float:
        return max((time.monotonic() if now is None else now) - self.started, 0.0)

    def rate(self, now: float | None = None) -> float:
        """Bytes per second since the start (0 before any time has passed)."""
        elapsed = self.elapsed(now)
        return self.done / elapsed if elapsed > 0 else 0.0

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the rate so far; None before any byte arrived."""
        rate = self.rate(now)
        if self.done >= self.total:
            return 0.0
        return (self.total - self.done) / rate if rate > 0 else None

    def line(self, what: str, now: float | None = None) -> str:
        """``state 1a2b3c: 12.0 MiB/80.0 MiB (15%), 4.1 MiB/s, ETA 17 s``."""
        percent = 100.0 * self.done / self.total if self.total else 100.0
        eta = self.eta(now)
        return (
            f"{what}: {format_bytes(self.done)}/{format_bytes(self.total)} ({percent:.0f}%), "
            f"{format_bytes(self.rate(now))}/s, "
            f"ETA {format_seconds(eta) if eta is not None else 'unknown'}"
        )

    def due(self, now: float | None = None, every: float = LOG_EVERY) -> bool:
        """Whether a progress line is due (at most one per ``every`` seconds); marks it."""
        now = time.monotonic() if now is None else now
        if now - max(self._logged, self.started) < every:
            return False
        self._logged = now
        return True
