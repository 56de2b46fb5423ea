"""What memory an array returned by the client lives in (for the shared-memory tests)."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np


def in_shared_memory(array: np.ndarray) -> bool:
    """Whether ``array`` is a view of a memory mapping (a segment), not heap memory."""
    owner: Any = array
    while isinstance(owner, np.ndarray):
        owner = owner.base
    return isinstance(owner, memoryview) and isinstance(owner.obj, mmap.mmap)
