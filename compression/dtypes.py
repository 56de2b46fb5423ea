"""The element types a tensor may have on the wire, and their proto enum values.

All payloads are little-endian. bfloat16 arrays are numpy arrays of dtype
``ml_dtypes.bfloat16`` and travel as raw 16-bit words (numpy has no bf16 of its own).

ml_dtypes is imported only when a bfloat16 dtype is needed (:func:`bfloat16`): importing
it costs about 0.7 s of CPU, most of a daemon's start-up, and bfloat16 tensors are rare.
Checks against bfloat16 (:func:`is_bfloat16`, membership in :data:`FLOATING` and
:data:`SUPPORTED`) never import it: a bfloat16 dtype can only exist once something
imported ml_dtypes, so while it is not imported no dtype is bfloat16.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Iterator, Set
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from swarmavg.compression.errors import CodecError
from swarmavg.proto import tensor_pb2

__all__ = [
    "BFLOAT16_NAME",
    "FLOATING",
    "REDUCED_IN_FLOAT64",
    "SUPPORTED",
    "DtypeSet",
    "bfloat16",
    "dtype_from_proto",
    "dtype_to_proto",
    "is_bfloat16",
    "normalize_dtype",
]

BFLOAT16_NAME = "bfloat16"
"""What numpy calls ml_dtypes' bfloat16 (``np.dtype(ml_dtypes.bfloat16).name``)."""


@functools.cache
def bfloat16() -> np.dtype[np.generic]:
    """ml_dtypes' bfloat16 dtype, importing ml_dtypes on the first call."""
    import ml_dtypes  # off the start-up path: see the module docstring

    dtype: np.dtype[np.generic] = np.dtype(ml_dtypes.bfloat16)
    return dtype


def is_bfloat16(dtype: object) -> bool:
    """Whether ``dtype`` is the bfloat16 dtype, without importing ml_dtypes.

    Like membership in a set of dtypes, only a ``np.dtype`` matches (not the scalar type
    ``ml_dtypes.bfloat16`` nor the string ``"bfloat16"``)."""
    return "ml_dtypes" in sys.modules and isinstance(dtype, np.dtype) and dtype == bfloat16()


class DtypeSet(Set[np.dtype[np.generic]]):
    """A fixed set of dtypes, optionally with bfloat16, that answers membership and
    :attr:`names` without importing ml_dtypes. Iterating it yields bfloat16 too, which
    imports ml_dtypes: use :attr:`names` for messages."""

    names: tuple[str, ...]
    """The dtypes' numpy names, sorted."""

    def __init__(self, plain: Iterable[DTypeLike], *, with_bfloat16: bool) -> None:
        self._plain = frozenset(np.dtype(d) for d in plain)
        self._with_bfloat16 = with_bfloat16
        names = [d.name for d in self._plain] + ([BFLOAT16_NAME] if with_bfloat16 else [])
        self.names = tuple(sorted(names))

    def __contains__(self, dtype: object) -> bool:
        return dtype in self._plain or (self._with_bfloat16 and is_bfloat16(dtype))

    def __iter__(self) -> Iterator[np.dtype[np.generic]]:
        yield from self._plain
        if self._with_bfloat16:
            yield bfloat16()

    def __len__(self) -> int:
        return len(self._plain) + int(self._with_bfloat16)

    def __repr__(self) -> str:
        return f"DtypeSet({', '.join(self.names)})"

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> frozenset[Any]:
        """Set operations (``|``, ``&``, ``-``) give plain frozensets."""
        return frozenset(it)


_TO_PROTO: dict[np.dtype[np.generic], int] = {
    np.dtype(np.float32): tensor_pb2.FLOAT32,
    np.dtype(np.float16): tensor_pb2.FLOAT16,
    np.dtype(np.float64): tensor_pb2.FLOAT64,
    np.dtype(np.int8): tensor_pb2.INT8,
    np.dtype(np.uint8): tensor_pb2.UINT8,
    np.dtype(np.int32): tensor_pb2.INT32,
    np.dtype(np.int64): tensor_pb2.INT64,
}
"""Every wire dtype but bfloat16 (which :func:`dtype_to_proto` maps itself)."""
_FROM_PROTO: dict[int, np.dtype[np.generic]] = {v: k for k, v in _TO_PROTO.items()}

SUPPORTED = DtypeSet(_TO_PROTO, with_bfloat16=True)
"""Every dtype the wire format carries."""

FLOATING = DtypeSet([np.float32, np.float16, np.float64], with_bfloat16=True)
"""The dtypes lossy codecs accept, and the only ones a training process may average
through the daemon (integer tensors would be truncated by the mean)."""

REDUCED_IN_FLOAT64: frozenset[np.dtype[np.generic]] = frozenset(
    {np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64)}
)
"""Dtypes whose presence makes a reduction run in float64 (float32 is exact for the rest)."""


def normalize_dtype(dtype: DTypeLike) -> np.dtype[np.generic]:
    """Return ``dtype`` in native byte order, or raise CodecError if the wire lacks it.

    The name ``"bfloat16"`` is understood even before ml_dtypes is imported (numpy knows
    it only after)."""
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        if isinstance(dtype, str) and dtype == BFLOAT16_NAME:
            return bfloat16()
        raise CodecError(f"not a dtype: {dtype!r}") from e
    if not d.isnative:
        d = d.newbyteorder("=")
    if d not in SUPPORTED:
        raise CodecError(f"unsupported dtype {d}; supported: {', '.join(SUPPORTED.names)}")
    return d


def dtype_to_proto(dtype: DTypeLike) -> int:
    """Map a numpy dtype to its ``tensor_pb2.DType`` value.

    Raises:
        CodecError: the dtype has no wire representation.
    """
    d = normalize_dtype(dtype)
    return tensor_pb2.BFLOAT16 if is_bfloat16(d) else _TO_PROTO[d]


def dtype_from_proto(value: int) -> np.dtype[np.generic]:
    """Map a ``tensor_pb2.DType`` value to a (native byte order) numpy dtype.

    Raises:
        CodecError: unspecified or unknown value.
    """
    value = int(value)
    if value == tensor_pb2.BFLOAT16:
        return bfloat16()  # a peer sent bfloat16: now ml_dtypes is needed
    try:
        return _FROM_PROTO[value]
    except KeyError:
        raise CodecError(f"unknown or unspecified dtype enum value {value}") from None
