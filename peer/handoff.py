"""The daemon's side of a shared-memory call: the inputs copied out, the result written in.

A client's segment is mapped in both processes, so the daemon can write the round's
result straight into it (the client reads it from its own mapping, no copy back). But
the round still reads its inputs after the first averages came back (a reducer may
answer a chunk before this member sent it, and partial rounds restore local values), so
the inputs must not live where the result is written. The daemon therefore copies them
once, out of the segment into a reused flat buffer, and checks them for NaN/Inf in the
same pass while each block is still in cache: one pass over the inputs (the copy) instead
of a separate check, a fresh result buffer (page faults), and a copy of the result back
into the segment.

The copy is laid out back to back, so that tensors of the reduction dtype form one span
that the all-reduce uses without flattening (averaging/allreduce/partition.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from swarmavg.averaging.allreduce.buffers import BufferPool
from swarmavg.averaging.errors import InvalidTensorsError
from swarmavg.compression.dtypes import FLOATING
from swarmavg.compression.kernels import all_finite
from swarmavg.compression.native import copy_finite

BLOCK_BYTES = 256 << 10
"""Bytes copied and then checked at a time: small enough to stay in the L2 cache, large
enough that numpy's per-call overhead is lost in the copy."""


def packed_layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Byte offsets of ``arrays`` packed back to back (each aligned to its itemsize, so
    tensors of one dtype touch) and the total byte size."""
    offsets: list[int] = []
    cursor = 0
    for array in arrays:
        itemsize = array.dtype.itemsize
        cursor = -(-cursor // itemsize) * itemsize
        offsets.append(cursor)
        cursor += array.nbytes
    return offsets, cursor


def copy_checked(
    sources: Sequence[np.ndarray], out: Sequence[np.ndarray], block_bytes: int = BLOCK_BYTES
) -> None:
    """Copy each source into the matching ``out`` array, checking every floating block for
    NaN/Inf right after it was copied (while it is in cache).

    Raises:
        InvalidTensorsError: naming the first tensor that holds one, and how many; ``out``
            then holds a partial copy.
    """
    for index, (src, dst) in enumerate(zip(sources, out, strict=True)):
        finite = copy_finite(src, dst)
        if finite is not None:
            if not finite:
                bad = int(src.size - np.count_nonzero(np.isfinite(src)))
                raise InvalidTensorsError(f"tensor {index} holds {bad} NaN/Inf value(s)")
            continue
        flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
        check = np.dtype(src.dtype) in FLOATING
        step = max(block_bytes // max(src.dtype.itemsize, 1), 1)
        for start in range(0, flat_src.size, step):
            block = flat_dst[start : start + step]
            np.copyto(block, flat_src[start : start + step])
            if check and not all_finite(block):
                bad = int(src.size - np.count_nonzero(np.isfinite(src)))
                raise InvalidTensorsError(f"tensor {index} holds {bad} NaN/Inf value(s)")


class InputCopy:
    """The daemon's checked copy of one call's inputs, in a buffer of ``pool``.

    :meth:`release` gives the buffer back once the round that read it is over; a call
    that ends otherwise (failed, cancelled while its round may still run) simply drops
    it, so no later call can overwrite inputs a round is still sending.
    """

    def __init__(self, sources: Sequence[np.ndarray], pool: BufferPool) -> None:
        """Take a buffer and lay views of ``sources``' shapes and dtypes out in it."""
        offsets, total = packed_layout(sources)
        self._pool = pool
        self._buffer: np.ndarray | None = pool.take(total, np.uint8)
        self.arrays = [
            self._buffer[offset : offset + src.nbytes].view(src.dtype).reshape(src.shape)
            for src, offset in zip(sources, offsets, strict=True)
        ]

    def release(self) -> None:
        """Give the buffer back for reuse (idempotent); the arrays must be unused now."""
        buffer, self._buffer = self._buffer, None
        self.arrays = []
        if buffer is not None:
            self._pool.give(buffer)


__all__ = ["BLOCK_BYTES", "InputCopy", "copy_checked", "packed_layout"]
