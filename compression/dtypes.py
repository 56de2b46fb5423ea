"""The element types a tensor may have on the wire, and their proto enum values.

All payloads are little-endian. bfloat16 arrays are numpy arrays of dtype
``ml_dtypes.bfloat16`` and travel as raw 16-bit words (numpy has no bf16 of its own).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from swarmavg.compression.errors import CodecError
from swarmavg.proto import tensor_pb2

__all__ = [
    "BFLOAT16",
    "FLOATING",
    "REDUCED_IN_FLOAT64",
    "SUPPORTED",
    "dtype_from_proto",
    "dtype_to_proto",
    "normalize_dtype",
]

BFLOAT16: np.dtype[np.generic] = np.dtype(ml_dtypes.bfloat16)

_TO_PROTO: dict[np.dtype[np.generic], int] = {
    np.dtype(np.float32): tensor_pb2.FLOAT32,
    np.dtype(np.float16): tensor_pb2.FLOAT16,
    BFLOAT16: tensor_pb2.BFLOAT16,
    np.dtype(np.float64): tensor_pb2.FLOAT64,
    np.dtype(np.int8): tensor_pb2.INT8,
    np.dtype(np.uint8): tensor_pb2.UINT8,
    np.dtype(np.int32): tensor_pb2.INT32,
    np.dtype(np.int64): tensor_pb2.INT64,
}
_FROM_PROTO: dict[int, np.dtype[np.generic]] = {v: k for k, v in _TO_PROTO.items()}

SUPPORTED: frozenset[np.dtype[np.generic]] = frozenset(_TO_PROTO)
"""Every dtype the wire format carries."""

FLOATING: frozenset[np.dtype[np.generic]] = frozenset(
    {np.dtype(np.float32), np.dtype(np.float16), BFLOAT16, np.dtype(np.float64)}
)
"""The dtypes lossy codecs accept, and the only ones a training process may average
through the daemon (integer tensors would be truncated by the mean)."""

REDUCED_IN_FLOAT64: frozenset[np.dtype[np.generic]] = frozenset(
    {np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64)}
)
"""Dtypes whose presence makes a reduction run in float64 (float32 is exact for the rest)."""


def normalize_dtype(dtype: DTypeLike) -> np.dtype[np.generic]:
    """Return ``dtype`` in native byte order, or raise CodecError if the wire lacks it."""
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        raise CodecError(f"not a dtype: {dtype!r}") from e
    if not d.isnative:
        d = d.newbyteorder("=")
    if d not in _TO_PROTO:
        names = ", ".join(sorted(str(k) for k in _TO_PROTO))
        raise CodecError(f"unsupported dtype {d}; supported: {names}")
    return d


def dtype_to_proto(dtype: DTypeLike) -> int:
    """Map a numpy dtype to its ``tensor_pb2.DType`` value.

    Raises:
        CodecError: the dtype has no wire representation.
    """
    return _TO_PROTO[normalize_dtype(dtype)]


def dtype_from_proto(value: int) -> np.dtype[np.generic]:
    """Map a ``tensor_pb2.DType`` value to a (native byte order) numpy dtype.

    Raises:
        CodecError: unspecified or unknown value.
    """
    try:
        return _FROM_PROTO[int(value)]
    except KeyError:
        raise CodecError(f"unknown or unspecified dtype enum value {value}") from None
