"""The daemon's allocator keeps the memory a round frees, so the next round does not
page-fault it back in (page faults out of the hot path).

A 64 MB round allocates and frees megabytes at a time: every received chunk's body, every
averaged chunk, every reply. glibc's malloc serves blocks above its mmap threshold with
fresh ``mmap`` s and gives freed space at the top of a heap back to the kernel once it
passes the trim threshold. Both thresholds adapt (the first free of a large block raises
them to about its size), but a round frees far more at once than the adapted trim
threshold, so every round handed tens of MB back and faulted them in again: about 6,000
page faults per daemon per 4-peer round, each one a kernel entry plus a page zeroed,
measured at 17% more system time (docs/benchmarks-data-path.md).

The daemon fixes both thresholds at start: blocks up to 32 MiB (glibc's largest mmap
threshold on 64-bit) come from the heap, and up to 64 MiB of freed heap stays mapped for
reuse. That bounds what the daemon holds between rounds beyond its peak use; it never
raises the peak. Buffers larger than 32 MiB (a whole 64 MB input copy) still come from
``mmap``; the daemon pools those itself (:mod:`swarmavg.averaging.allreduce.buffers`).

A user who sets glibc's own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``
keeps their values. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter numbers (``malloc.h``)."""

MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (glibc's maximum on 64-bit systems)."""
TRIM_THRESHOLD = 64 << 20
"""Freed heap kept mapped for reuse, at most (per arena, at the top of its heap)."""

USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""glibc's environment variables for the same thresholds: when set, they win."""


def glibc_version() -> str | None:
    """``"2.36"`` on glibc, ``None`` on any other C library."""
    try:
        found = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not found or not found.startswith("glibc "):
        return None
    return found.removeprefix("glibc ")


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module docstring).

    Returns whether they were set: ``False`` on other C libraries, when the user set
    either threshold through glibc's environment variables, or when glibc refused.
    """
    if any(name in environ for name in USER_SETTINGS):
        return False
    if glibc_version() is None:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success. The mmap threshold first: setting either one turns
    # off glibc's adaptive thresholds, and a refused mmap threshold would leave the
    # trim threshold alone at its small default.
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        log.debug("glibc refused the mmap threshold %d", MMAP_THRESHOLD)
        return False
    if mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        log.debug("glibc refused the trim threshold %d", TRIM_THRESHOLD)
        return False
    return True


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "glibc_version", "keep_freed_memory"]
