"""Where a round's result lives: the caller's ``out``, the inputs themselves, or new memory.

The runner decodes replies straight into the flat view this module finds for ``out``
(:func:`result_target`), or averages in place when ``out`` is the inputs' own memory
(:func:`same_vector`). The part check keeps our values in a buffer laid out like the inputs
(:func:`aligned_like`), and every copy of checked values goes through :func:`copy_into`.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
from numpy.lib.array_utils import byte_bounds

from swarmavg.averaging.allreduce.buffers import BufferPool
from swarmavg.averaging.allreduce.partition import TensorLayout, contiguous_span
from swarmavg.compression.native import copy_finite

__all__ = ["aligned_like", "copy_into", "result_target", "same_vector"]


def copy_into(out: np.ndarray, values: np.ndarray) -> None:
    """``out[...] = values`` through the compiled checked copy where it applies: its
    stores bypass the caches for copies of 256 KiB and more (a reply's chunk), so the
    destination is not read first as memmove's stores read it (the replies'
    copies into the caller's memory were 6.5% of a daemon's CPU at 8 peers). What it
    says of finiteness is not needed here: the values were checked already."""
    if copy_finite(values, out) is None:
        np.copyto(out, values)


def aligned_like(buffers: BufferPool, vector: np.ndarray) -> np.ndarray:
    """A buffer of ``vector``'s length and dtype from ``buffers``, at the same address
    modulo 32 bytes: a chunk of it is 32-byte aligned where that chunk of ``vector`` is, so
    the compiled pass that keeps our values there streams its stores (check_copy)."""
    item = vector.dtype.itemsize
    raw = buffers.take(vector.size + 32 // item, vector.dtype)
    shift = (vector.ctypes.data - raw.ctypes.data) % 32
    if shift % item:  # the vector is not aligned to its items: any place will do
        return raw[: vector.size]
    start = shift // item
    return raw[start : start + vector.size]


def result_target(
    out: Sequence[np.ndarray] | None, tensors: Sequence[np.ndarray], layout: TensorLayout
) -> np.ndarray | None:
    """The flat view of ``out`` that replies decode into, ``None`` when ``out`` is not
    one span of the reduction dtype (then the result is copied into it at the end).

    Raises:
        ValueError: ``out`` has another layout, is read-only, or overlaps ``tensors``
            without being exactly them (the round still reads the inputs after the first
            replies came back; in place, it reads each chunk only before its average).
    """
    if out is None:
        return None
    if not layout.matches(out):
        raise ValueError("out does not have the tensors' shapes and dtypes")
    if not all(o.flags.writeable for o in out):
        raise ValueError("out is read-only")
    if not _same_memory(out, tensors) and _extents_overlap(out, tensors):
        raise ValueError("out overlaps the input tensors")
    return contiguous_span(out, layout)


def same_vector(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat vectors span the same memory (the result is the inputs)."""
    return a.size == b.size and a.size > 0 and byte_bounds(a) == byte_bounds(b)


def _same_memory(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Whether ``a`` and ``b`` are the same arrays of memory, pairwise (in place)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and x.strides == y.strides
        and byte_bounds(x) == byte_bounds(y)
        for x, y in zip(a, b, strict=True)
    )


def _extents_overlap(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Whether any array of ``a`` spans memory that an array of ``b`` spans (each taken
    from its lowest to its highest byte): O((len(a) + len(b)) log len(b))."""
    union: list[list[int]] = []  # b's extents merged, sorted, disjoint
    for lo, hi in sorted(byte_bounds(x) for x in b if x.size):
        if union and lo < union[-1][1]:
            union[-1][1] = max(union[-1][1], hi)
        else:
            union.append([lo, hi])
    starts = [lo for lo, _ in union]
    for x in a:
        if not x.size:
            continue
        lo, hi = byte_bounds(x)
        k = bisect.bisect_left(starts, hi) - 1  # the last of b's extents starting below hi
        if k >= 0 and union[k][1] > lo:
            return True
    return False
