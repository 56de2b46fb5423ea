"""Checks on what a training process hands to ``average`` (client side and daemon side).

The same rules run twice: in the client, before anything is sent, and in the daemon,
which trusts no caller. Violations raise :class:`~swarmavg.peer.client.errors.ValidationError`
with a message that names the offending tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from swarmavg.averaging.errors import InvalidTensorsError
from swarmavg.averaging.request import MAX_KEY_BYTES, check_finite
from swarmavg.compression import dtypes
from swarmavg.compression.dtypes import FLOATING
from swarmavg.compression.errors import CodecError
from swarmavg.peer.client.errors import ValidationError

MAX_TENSORS = 65536
MAX_NDIM = 32
MAX_TOTAL_BYTES = 16 << 30
"""The daemon refuses to allocate more than this for one call."""

SUPPORTED_DTYPES = FLOATING.names
"""What a training process may average: the floating wire dtypes. Integer tensors would be
silently truncated by the mean, so they are rejected rather than guessed at."""


def dtype_to_proto(dtype: np.dtype[np.generic], where: str) -> int:
    """The wire enum for a dtype a training process may average; ``ValidationError`` otherwise."""
    if np.dtype(dtype) not in FLOATING:
        raise ValidationError(
            f"{where}: unsupported dtype {np.dtype(dtype).name}; "
            f"supported: {', '.join(SUPPORTED_DTYPES)}"
        )
    return dtypes.dtype_to_proto(dtype)


def dtype_from_proto(value: int, where: str) -> np.dtype[np.generic]:
    """The numpy dtype for a wire enum value of a floating dtype; ``ValidationError`` else."""
    try:
        dtype = dtypes.dtype_from_proto(value)
    except CodecError:
        dtype = None
    if dtype is None or dtype not in FLOATING:
        raise ValidationError(f"{where}: unsupported dtype code {value}")
    return dtype


def validate_key(key: object) -> str:
    """A non-empty string of at most ``MAX_KEY_BYTES`` UTF-8 bytes."""
    if not isinstance(key, str):
        raise ValidationError(f"key must be a str, not {type(key).__name__}")
    if not key:
        raise ValidationError("key must not be empty")
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise ValidationError(f"key is {size} bytes long; the limit is {MAX_KEY_BYTES}")
    return key


def validate_layout(dtypes: Sequence[np.dtype[np.generic]], shapes: Sequence[Sequence[int]]) -> int:
    """Check a tensor list's layout; return its total size in bytes."""
    if len(dtypes) == 0:
        raise ValidationError("tensors must be a non-empty list")
    if len(dtypes) > MAX_TENSORS:
        raise ValidationError(f"{len(dtypes)} tensors; the limit is {MAX_TENSORS}")
    total = 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        dtype_to_proto(dtype, f"tensor {i}")
        if len(shape) > MAX_NDIM:
            raise ValidationError(f"tensor {i}: {len(shape)} dimensions; the limit is {MAX_NDIM}")
        if any(d < 0 for d in shape):
            raise ValidationError(f"tensor {i}: negative dimension in shape {tuple(shape)}")
        numel = math.prod(shape)
        total += numel * np.dtype(dtype).itemsize
        if total > MAX_TOTAL_BYTES:
            raise ValidationError(f"tensors exceed {MAX_TOTAL_BYTES} bytes in total")
    return total


def validate_finite(arrays: Sequence[np.ndarray]) -> None:
    """Reject NaN and Inf (:func:`swarmavg.averaging.request.check_finite`, as a
    ``ValidationError``)."""
    try:
        check_finite(arrays)
    except InvalidTensorsError as exc:
        raise ValidationError(str(exc)) from None


def validate_arrays(arrays: Sequence[np.ndarray]) -> int:
    """Layout and finiteness of numpy arrays; return their total byte size."""
    total = validate_layout([a.dtype for a in arrays], [a.shape for a in arrays])
    validate_finite(arrays)
    return total


def same_layout(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> str | None:
    """``None`` when ``a`` and ``b`` have the same dtypes and shapes, else the difference."""
    if len(a) != len(b):
        return f"{len(a)} tensors vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"tensor {i}: {x.dtype.name}{list(x.shape)} vs {y.dtype.name}{list(y.shape)}"
    return None
