"""Flatten tensors into one reduction vector, cut it into parts and chunks, and back.

Pure, synchronous logic shared by every member of a group. Every member computes the same
:class:`TensorLayout` and :class:`PartPlan` from the same inputs, so the layout never
travels on the wire: a chunk is named only by (part, chunk index).

Reduction precision (docs/averaging.md): floats narrower than 32 bits (float16, bfloat16) and
small integers (int8, uint8) are widened to float32; float64 and wide integers (int32,
int64) make the whole vector float64. Integer results are rounded to nearest and
clipped to the dtype's range; int64 values beyond 2**53 lose precision.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from swarmavg.compression.dtypes import REDUCED_IN_FLOAT64, SUPPORTED

DEFAULT_CHUNK_BYTES = 1024 * 1024
"""Chunk target of :func:`chunk_elements_for` when none is given. Rounds choose theirs
from the group's links (:mod:`~swarmavg.averaging.allreduce.chunking`) unless
``AllReduceConfig.chunk_bytes`` is set: smaller chunks cost more CPU per byte (per-message
overhead), bigger ones save CPU but slow rounds on 100 Mbit/s links, which volunteers
have (docs/benchmarks-data-path.md, docs/benchmarks-testbed.md)."""
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 3 * 1024 * 1024
"""Largest chunk target accepted: an encoded chunk plus its message headers must stay
under gRPC's 4 MiB message cap, which the data plane enforces too (``MAX_BODY``)."""
MIN_CHUNK_ELEMENTS = 1024


def reduction_dtype(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The dtype in which tensors of ``dtypes`` are reduced: float64 or float32."""
    for dtype in dtypes:
        if np.dtype(dtype) not in SUPPORTED:
            raise ValueError(f"unsupported dtype {dtype}; supported: {list(SUPPORTED.names)}")
    if any(np.dtype(d) in REDUCED_IN_FLOAT64 for d in dtypes):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


@dataclass(frozen=True)
class TensorLayout:
    """Where each tensor lives inside the flat reduction vector."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]
    total: int
    dtype: np.dtype

    @classmethod
    def of(cls, tensors: Sequence[np.ndarray]) -> TensorLayout:
        """The layout of ``tensors`` (their order, shapes and dtypes; not their values).

        Raises:
            ValueError: an empty list, or a dtype that cannot be averaged.
        """
        if len(tensors) == 0:
            raise ValueError("nothing to average: the tensor list is empty")
        dtypes = tuple(np.dtype(t.dtype) for t in tensors)
        offsets = []
        total = 0
        for t in tensors:
            offsets.append(total)
            total += int(t.size)
        return cls(
            shapes=tuple(tuple(int(d) for d in t.shape) for t in tensors),
            dtypes=dtypes,
            offsets=tuple(offsets),
            total=total,
            dtype=reduction_dtype(dtypes),
        )

    def matches(self, tensors: Sequence[np.ndarray]) -> bool:
        """Whether ``tensors`` have exactly this layout's shapes and dtypes."""
        return len(tensors) == len(self.shapes) and all(
            tuple(t.shape) == s and np.dtype(t.dtype) == d
            for t, s, d in zip(tensors, self.shapes, self.dtypes, strict=True)
        )


def flatten(tensors: Sequence[np.ndarray], layout: TensorLayout) -> np.ndarray:
    """Copy ``tensors`` into a new 1-D vector of ``layout.dtype`` (inputs are not touched)."""
    if not layout.matches(tensors):
        raise ValueError("tensors do not match the layout")
    out = np.empty(layout.total, dtype=layout.dtype)
    for t, offset in zip(tensors, layout.offsets, strict=True):
        out[offset : offset + t.size] = np.asarray(t).reshape(-1)
    return out


def unflatten(vector: np.ndarray, layout: TensorLayout, *, copy: bool = True) -> list[np.ndarray]:
    """Cut ``vector`` back into arrays with the layout's shapes and dtypes.

    Floats are cast with round-to-nearest; integers are rounded and clipped to range.
    With ``copy=True`` the returned arrays never share memory with ``vector``; with
    ``copy=False`` a tensor whose dtype is the vector's is returned as a view of it (for
    callers that own ``vector`` and hand it over).
    """
    if vector.shape != (layout.total,):
        raise ValueError(f"vector has shape {vector.shape}, layout needs ({layout.total},)")
    result = []
    for shape, dtype, offset in zip(layout.shapes, layout.dtypes, layout.offsets, strict=True):
        size = math.prod(shape)
        piece = vector[offset : offset + size]
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            # float64 cannot hold int64's max exactly; clip below it, then cast.
            hi = float(info.max) if info.bits < 64 else float(np.nextafter(2.0**63, 0))
            piece = np.clip(np.rint(piece), float(info.min), hi)
        if not copy and piece.dtype == dtype:
            result.append(piece.reshape(shape))
        else:
            result.append(np.array(piece, dtype=dtype, copy=True).reshape(shape))
    return result


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def contiguous_span(tensors: Sequence[np.ndarray], layout: TensorLayout) -> np.ndarray | None:
    """A 1-D view over ``tensors`` when they already lie back to back in memory, in the
    reduction dtype, in one buffer (one contiguous tensor, or views cut from one flat
    buffer in order); ``None`` otherwise. Writable when the buffer is.

    This is what lets a caller hand the all-reduce memory it already holds (the daemon's
    copy of a client's inputs, a client's shared memory as the result) without a copy.
    """
    if not tensors or not layout.matches(tensors):
        return None
    arrays = [np.asarray(t) for t in tensors]
    if any(a.dtype != layout.dtype or not a.flags.c_contiguous for a in arrays):
        return None
    if len(arrays) == 1:
        return arrays[0].reshape(-1)
    arrays = [a for a in arrays if a.size]  # an empty view's address means nothing
    if not arrays:
        return None
    start = cursor = _address(arrays[0])
    for a in arrays:
        if _address(a) != cursor:
            return None
        cursor += a.nbytes
    root = arrays[0]
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not root.flags.c_contiguous:
        return None
    offset = start - _address(root)
    if offset < 0 or offset + (cursor - start) > root.nbytes:
        return None
    span: np.ndarray = root.reshape(-1).view(np.uint8)[offset : offset + cursor - start]
    return span.view(layout.dtype)


def flat_view(tensors: Sequence[np.ndarray], layout: TensorLayout) -> np.ndarray | None:
    """A read-only 1-D view of tensors already laid out as the reduction vector (one
    contiguous tensor in the reduction dtype, or :func:`contiguous_span`'s case).

    Saves the copy of :func:`flatten` in the common case of one big float32 tensor;
    ``None`` when a copy is needed.
    """
    span = contiguous_span(tensors, layout)
    if span is None:
        return None
    view = span.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True)
class PartPlan:
    """The flat vector cut into one contiguous part per member, each part into chunks.

    Attributes:
        bounds: ``(start, end)`` of each member's part in the flat vector; empty
            (``start == end``) for members that reduce nothing.
        chunk_elements: elements per chunk; the last chunk of a part may be shorter.
    """

    bounds: tuple[tuple[int, int], ...]
    chunk_elements: int

    @classmethod
    def build(cls, part_sizes: Sequence[int], chunk_elements: int) -> PartPlan:
        """Parts of ``part_sizes`` elements laid out in member order."""
        if chunk_elements <= 0:
            raise ValueError("chunk_elements must be positive")
        bounds = []
        start = 0
        for size in part_sizes:
            if size < 0:
                raise ValueError("part sizes must be >= 0")
            bounds.append((start, start + int(size)))
            start += int(size)
        return cls(tuple(bounds), int(chunk_elements))

    @property
    def total(self) -> int:
        return self.bounds[-1][1] if self.bounds else 0

    @functools.cached_property
    def _sizes(self) -> tuple[tuple[int, int], ...]:
        """``(elements, chunks)`` of every part: asked several times per chunk in a round."""
        return tuple(
            (end - start, -(-(end - start) // self.chunk_elements)) for start, end in self.bounds
        )

    def part_size(self, part: int) -> int:
        return self._sizes[part][0]

    def num_chunks(self, part: int) -> int:
        """Number of chunks of ``part`` (0 for an empty part)."""
        return self._sizes[part][1]

    def chunk_bounds(self, part: int, chunk: int) -> tuple[int, int]:
        """``(start, end)`` of ``chunk`` relative to the start of ``part``."""
        size, chunks = self._sizes[part]
        if not 0 <= chunk < chunks:
            raise IndexError(f"part {part} has no chunk {chunk}")
        start = chunk * self.chunk_elements
        return start, min(start + self.chunk_elements, size)

    def chunk_span(self, part: int, chunk: int) -> slice:
        """Where ``chunk`` of ``part`` lies in the flat vector."""
        start, end = self.chunk_bounds(part, chunk)
        base = self.bounds[part][0]
        return slice(base + start, base + end)

    def chunk_size(self, part: int, chunk: int) -> int:
        """Elements of ``chunk`` of ``part`` (how much work its coding is)."""
        start, end = self.chunk_bounds(part, chunk)
        return end - start


def chunk_elements_for(bytes_per_element: float, target_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Elements per chunk so that an encoded chunk is about ``target_bytes`` on the wire.

    ``bytes_per_element`` is the codec's encoded size per element (e.g. 4.0 for float32
    without compression, ~1.0 for 8-bit codecs).
    """
    if not (bytes_per_element > 0 and math.isfinite(bytes_per_element)):
        raise ValueError("bytes_per_element must be positive and finite")
    if target_bytes <= 0:
        raise ValueError("target_bytes must be positive")
    elements = int(target_bytes / bytes_per_element)
    # Round down to a multiple of 1024 so blockwise codecs see whole blocks.
    return max(MIN_CHUNK_ELEMENTS, elements // 1024 * 1024)
