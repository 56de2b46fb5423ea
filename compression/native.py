"""The compiled codec kernels, when this installation has them.

``compression/_native.c`` is built by ``pip install`` where a C compiler is present and
skipped where it is not (it is declared optional). Every kernel there is bit-identical
to the numpy code it replaces, so peers with and without it interoperate exactly; the
numpy code remains the reference and the fallback.

``SWARMAVG_NATIVE=0`` in the environment turns the kernels off (to compare, or to rule
them out when debugging).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["FLOATS", "check_copy", "copy_finite", "kernels", "takes", "weighted_sum"]

FLOATS: tuple[np.dtype[Any], ...] = (np.dtype(np.float32), np.dtype(np.float64))
"""The float dtypes the compiled finite scan and checked copy take (float16 and bfloat16
take numpy's code)."""
_HALF = np.dtype(np.float16)


def _load() -> ModuleType | None:
    if os.environ.get("SWARMAVG_NATIVE", "1") == "0":
        return None
    try:
        from swarmavg.compression import _native
    except ImportError:
        return None
    return _native


kernels: ModuleType | None = _load()
"""The ``_native`` module, or None: then every codec runs its numpy kernels."""


def takes(*arrays: np.ndarray) -> bool:
    """Whether the kernels are built and can read these arrays' raw buffers: every array
    contiguous, in native byte order, and aligned unless the build takes any address (a
    payload at an odd offset of a message)."""
    return kernels is not None and all(
        a.flags.c_contiguous
        and a.dtype.isnative
        and (a.flags.aligned or bool(kernels.any_alignment))
        for a in arrays
    )


def copy_finite(src: np.ndarray, dst: np.ndarray) -> bool | None:
    """Copy ``src`` into ``dst`` and check it for NaN/Inf in one compiled pass, where the
    kernel applies: both arrays of one shape and one dtype of :data:`FLOATS`, and
    :func:`takes` them (memcpy's speed; a numpy copy and check read the data twice).

    Returns:
        Whether every value is finite (``dst`` holds the whole copy either way), or
        ``None`` when the kernel does not apply: nothing was copied, and the caller
        copies and checks with numpy.
    """
    copy = getattr(kernels, "copy_finite", None)  # absent from an older build
    if (
        copy is None
        or src.dtype not in FLOATS
        or dst.dtype != src.dtype
        or src.shape != dst.shape
        or not takes(src, dst)
    ):
        return None
    return bool(copy(src.reshape(-1), dst.reshape(-1), src.dtype.itemsize))


def check_copy(
    src: np.ndarray,
    own: np.ndarray,
    out: np.ndarray | None,
    backup: np.ndarray | None,
    sums: np.ndarray,
) -> bool | None:
    """In one compiled pass: copy ``src`` into ``out`` and ``own`` into ``backup`` (either
    ``None``: not copied; ``own`` may be ``out`` itself, read before it is written) and
    write into ``sums`` the part check's sums comparing ``src`` with ``own``
    (:func:`~swarmavg.compression.kernels.check_sums` gives the same bits with numpy).

    Returns:
        Whether every value of ``src`` is finite (everything written either way), or
        ``None`` when the kernel does not apply (arrays of one length, one dimension and
        one dtype of :data:`FLOATS`, ``sums`` 5 float64, and :func:`takes` them all):
        nothing was written.
    """
    kernel = getattr(kernels, "check_copy", None)  # absent from an older build
    arrays = [a for a in (src, own, out, backup) if a is not None]
    if (
        kernel is None
        or src.dtype not in FLOATS
        or any(a.dtype != src.dtype or a.shape != src.shape or a.ndim != 1 for a in arrays)
        or sums.dtype != np.float64
        or sums.shape != (5,)
        or not takes(*arrays, sums)
    ):
        return None
    return bool(kernel(src, out, own, backup, src.dtype.itemsize, sums))


def weighted_sum(
    copies: Sequence[np.ndarray], weights: Sequence[float], d: float, out: np.ndarray
) -> bool | None:
    """``out = (copies[0] * weights[0] + copies[1] * weights[1] + ...) / d`` in one
    compiled pass (``d`` 0: no division; ``out`` may be one of the copies), each operation
    rounded in the arrays' dtype, in that order, as numpy rounds ``acc = x0 * w0``,
    ``acc += x1 * w1``, ... and ``acc / d``: the same bits. The weights are taken as that
    dtype's values (the caller rounds them to it).

    With a float32 ``out``, a copy may be float16 (codec ``float16``'s words as received):
    its values are widened exactly where they are added, as decoding them first would
    give, without a decoded array. An Inf/NaN among them makes the result count as not
    finite, as its decoded value would have.

    Returns:
        Whether every value of ``out`` is finite, or ``None`` when the kernel does not
        apply (at least one copy, arrays of one dtype of :data:`FLOATS` (or float16 into
        float32), one length, one dimension, and :func:`takes` them): nothing was
        written, and the caller computes with numpy.
    """
    kernel = getattr(kernels, "weighted_sum", None)  # absent from an older build
    arrays = (*copies, out)
    if (
        kernel is None
        or not copies
        or len(weights) != len(copies)
        or out.dtype not in FLOATS
        or any(x.shape != out.shape or x.ndim != 1 for x in arrays)
        or not takes(*arrays)
    ):
        return None
    halves = bytes(x.dtype == _HALF for x in copies)
    if any(x.dtype != out.dtype for x, half in zip(copies, halves, strict=True) if not half):
        return None
    if any(halves):
        if out.dtype != np.float32 or not getattr(kernels, "weighted_sum_halves", False):
            return None
        return bool(kernel(copies, weights, d, out.dtype.itemsize, out, halves))
    return bool(kernel(copies, weights, d, out.dtype.itemsize, out))
