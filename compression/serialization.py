"""Tensor wire format: an array as a stream of TensorChunk messages, and back."""

from __future__ import annotations

from swarmavg.compression.dtypes import dtype_from_proto, dtype_to_proto
from swarmavg.compression.errors import CodecError

__all__ = ["SerializationError", "dtype_from_proto", "dtype_to_proto"]


class SerializationError(CodecError):
    """A chunk stream is truncated, reordered, duplicated, oversized or inconsistent."""
