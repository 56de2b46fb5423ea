"""The shared-memory handoff of a call: the client's checked copy in, the result in place.

The client copies its tensors into a segment mapped in both processes and checks them for
NaN/Inf in the same pass (:func:`copy_checked`, each block while it is still in cache).
The daemon then averages in the segment itself: the round reads each chunk of the inputs
where the client wrote them and writes the averages over them (``run_allreduce`` with
``out`` being the inputs), so the client reads its result from its own mapping. The
client says that it checked (``AverageStart.inputs_checked``), so the daemon does not scan
the segment again: the round's codec checks each chunk as it encodes it (with ``none``, the
reducer that averages it does), and a caller that lied fails mid-round while its group
goes on without it (``FiniteCheck.AS_ENCODED``). A call that does not say so is scanned,
read-only, in a thread while matchmaking declares this peer. The daemon never copies the
inputs out (passes over S saved, and S less memory per call).

In place is safe because the round never needs a chunk's local values after that chunk's
average arrived: a reducer averages a chunk only once this member's copy of it arrived, or
after dropping this member (whose later chunks it then refuses); a reply is checked whole
before it is written; a chunk no reducer returned was never written over. What changes is
a reducer distrusted mid-part: the chunks it returned before keep their averages
(``run_allreduce``). A client that writes its segment while its own call runs only
corrupts what its daemon sends, as any peer could: every member checks what it receives.

Segments are laid out back to back (:func:`packed_layout`), so that tensors of the
reduction dtype form one span that the all-reduce uses without flattening
(averaging/allreduce/partition.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


__all__ = ["BLOCK_BYTES", "copy_checked", "packed_layout"]
