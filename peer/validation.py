"""Checks on what a training process hands to ``average`` (client side and daemon side).

The same rules run twice: in the client, before anything is sent, and in the daemon,
which trusts no caller. Violations raise :class:`~swarmavg.peer.errors.ValidationError`
with a message that names the offending tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from swarmavg.compression.kernels import all_finite
from swarmavg.peer.errors import ValidationError
from swarmavg.proto import tensor_pb2

MAX_KEY_BYTES = 256
"""Round keys end up inside DHT keys (``{run}.{key}.{bits}``), whose size is capped."""
MAX_TENSORS = 65536
MAX_NDIM = 32
MAX_TOTAL_BYTES = 16 << 30
"""The daemon refuses to allocate more than this for one call."""

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# Averaging is defined for floating types only; integer tensors would be silently
# truncated by the mean, so they are rejected rather than guessed at.
_DTYPE_TO_PROTO: dict[np.dtype[np.generic], int] = {
    np.dtype(np.float32): tensor_pb2.FLOAT32,
    np.dtype(np.float16): tensor_pb2.FLOAT16,
    np.dtype(np.float64): tensor_pb2.FLOAT64,
    BFLOAT16: tensor_pb2.BFLOAT16,
}
_PROTO_TO_DTYPE = {v: k for k, v in _DTYPE_TO_PROTO.items()}
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "float64")


def dtype_to_proto(dtype: np.dtype[np.generic], where: str) -> int:
    """The wire enum for a supported dtype; ``ValidationError`` otherwise."""
    try:
        return _DTYPE_TO_PROTO[np.dtype(dtype)]
    except KeyError:
        raise ValidationError(
            f"{where}: unsupported dtype {np.dtype(dtype).name}; "
            f"supported: {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def dtype_from_proto(value: int, where: str) -> np.dtype[np.generic]:
    """The numpy dtype for a wire enum value; ``ValidationError`` for others."""
    try:
        return _PROTO_TO_DTYPE[value]
    except KeyError:
        raise ValidationError(f"{where}: unsupported dtype code {value}") from None


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


def validate_round_params(
    weight: float,
    group_size: int | None,
    min_group_size: int,
    timeout: float,
) -> None:
    """Check the scalar arguments of ``average``."""
    if not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise ValidationError(f"weight must be a finite number > 0, got {weight!r}")
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
        raise ValidationError(f"group_size must be None or an int >= 1, got {group_size!r}")
    if not isinstance(min_group_size, int) or min_group_size < 1:
        raise ValidationError(f"min_group_size must be an int >= 1, got {min_group_size!r}")
    if group_size is not None and min_group_size > group_size:
        raise ValidationError(
            f"min_group_size {min_group_size} is larger than group_size {group_size}"
        )
    if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        raise ValidationError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")


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
    """Reject NaN and Inf (one of them poisons the whole group's average)."""
    for i, array in enumerate(arrays):
        floating = array.dtype.kind == "f" or array.dtype == ml_dtypes.bfloat16
        if floating and not all_finite(array):
            bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
            raise ValidationError(f"tensor {i} holds {bad} NaN/Inf value(s)")


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
