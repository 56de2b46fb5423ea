"""Lossless and 16-bit float codecs: ``none``, ``float16``, ``bfloat16``, ``scaled-float16``.

Payload layouts (little-endian):

- ``none``: the raw elements in the original dtype.
- ``float16``: IEEE binary16 words; inputs are clamped to +/-65504 first, so large values
  saturate instead of becoming Inf.
- ``bfloat16``: bf16 words, rounded to nearest even, saturating at the bf16 maximum.
- ``scaled-float16``: rows of ``meta["row"]`` elements are centred and scaled to unit
  standard deviation, then stored as binary16; after them the float32 row means, then
  the float32 row standard deviations (hivemind calls this MEANSTD_16BIT).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from swarmavg.compression import halfconv
from swarmavg.compression.base import (
    Buffer,
    Codec,
    CodecInfo,
    Encoded,
    Header,
    as_input,
    check_payload_size,
    meta_int,
    require_finite,
    restore,
)
from swarmavg.compression.dtypes import FLOATING
from swarmavg.compression.errors import CodecError

__all__ = ["BFloat16Codec", "Float16Codec", "NoneCodec", "ScaledFloat16Codec"]

_F32_MAX = float(np.finfo(np.float32).max)


def _bytes_view(a: np.ndarray) -> memoryview:
    """A zero-copy byte view of a contiguous array (works for bfloat16 too)."""
    return a.view(np.uint8).data


def _frombuffer(payload: Buffer, dtype: np.dtype[Any], count: int = -1, offset: int = 0) -> Any:
    return np.frombuffer(payload, dtype=dtype.newbyteorder("<"), count=count, offset=offset)


class NoneCodec(Codec):
    """No compression: the raw little-endian elements. Takes every wire dtype.

    Floating inputs and outputs must be finite (NaN/Inf raise CodecError).
    """

    name = "none"
    decodes_finite = True
    exact = True

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=False)
        if dtype in FLOATING and not info.finite:
            require_finite(flat, "input")
        header = Header(self.name, dtype, tuple(np.shape(array)))
        return Encoded(header, _bytes_view(flat))

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        check_payload_size(header, payload, header.size * header.dtype.itemsize)
        out = _frombuffer(payload, header.dtype)  # a view: decode() copies if it must
        if header.dtype in FLOATING:
            require_finite(out, "decoded tensor")
        return out.reshape(header.shape)  # type: ignore[no-any-return]


class Float16Codec(Codec):
    """IEEE half precision, 2 bytes per element; inputs saturate at +/-65504."""

    name = "float16"

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        words = halfconv.float_to_half_words(flat)
        return Encoded(Header(self.name, dtype, tuple(np.shape(array))), _bytes_view(words))

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        check_payload_size(header, payload, header.size * 2)
        words = _frombuffer(payload, np.dtype(np.uint16))
        return halfconv.half_words_to(words, header.dtype).reshape(header.shape)


class BFloat16Codec(Codec):
    """bfloat16 (8-bit exponent, 7-bit mantissa), round to nearest even, 2 bytes/element."""

    name = "bfloat16"

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        words = halfconv.float_to_bf16_words(flat)
        return Encoded(Header(self.name, dtype, tuple(np.shape(array))), _bytes_view(words))

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        check_payload_size(header, payload, header.size * 2)
        words = _frombuffer(payload, np.dtype(np.uint16))
        return halfconv.bf16_words_to(words, header.dtype).reshape(header.shape)


def _row_length(shape: tuple[int, ...], size: int) -> int:
    """Rows run along the last axis when it is long enough to be worth its 8 bytes of
    statistics; otherwise the whole tensor is one row."""
    if len(shape) >= 2 and shape[-1] >= 64:
        return shape[-1]
    return max(size, 1)


def _tiles(rows: int, row: int) -> Iterator[tuple[int, int, int, int]]:
    """Cache-sized tiles ``(r0, r1, c0, c1)`` of a (rows, row) array, in memory order."""
    if row >= halfconv.HALF_SLAB:
        for r in range(rows):
            for c in range(0, row, halfconv.HALF_SLAB):
                yield r, r + 1, c, min(c + halfconv.HALF_SLAB, row)
    else:
        group = halfconv.HALF_SLAB // row
        for r in range(0, rows, group):
            yield r, min(r + group, rows), 0, row


class ScaledFloat16Codec(Codec):
    """Per-row mean/std normalisation, then binary16 (hivemind's MEANSTD_16BIT).

    Better than plain float16 for tensors whose values are far from 1 in magnitude
    (tiny optimizer statistics underflow float16, large ones overflow it).
    """

    name = "scaled-float16"

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        shape = tuple(np.shape(array))
        n = flat.size
        row = _row_length(shape, n)
        rows = n // row
        x = halfconv.as_float32(flat).reshape(rows, row)
        with np.errstate(over="ignore", invalid="ignore"):
            means = np.add.reduce(x, axis=1, dtype=np.float32) / np.float32(row)
        if not np.isfinite(means).all():
            raise CodecError("input contains NaN or Inf (or values beyond float32 range)")
        # Exact variance about the mean, two-pass for accuracy, slab by slab so that the
        # centred values never exist in full.
        scratch = np.empty(min(n, halfconv.HALF_SLAB), np.float32)
        squares = np.zeros(rows, np.float64)
        for r0, r1, c0, c1 in _tiles(rows, row):
            d = scratch[: (r1 - r0) * (c1 - c0)].reshape(r1 - r0, c1 - c0)
            np.subtract(x[r0:r1, c0:c1], means[r0:r1, None], out=d)
            squares[r0:r1] += np.einsum("ij,ij->i", d, d)
        stds = np.sqrt(squares / row).astype(np.float32)
        if not np.isfinite(stds).all():
            raise CodecError("input values are too large for float32 statistics")
        # A constant row has std 0: keep the scale at 1 so that z is exactly 0.
        scales = np.where(stds > 0, stds, np.float32(1)).astype(np.float32)
        inverse = (np.float32(1) / scales).astype(np.float32)
        payload = np.empty(2 * n + 8 * rows, np.uint8)
        words = payload[: 2 * n].view("<u2")
        half = halfconv.HalfScratch(n)
        for r0, r1, c0, c1 in _tiles(rows, row):
            d = scratch[: (r1 - r0) * (c1 - c0)].reshape(r1 - r0, c1 - c0)
            np.subtract(x[r0:r1, c0:c1], means[r0:r1, None], out=d)
            np.multiply(d, inverse[r0:r1, None], out=d)
            start = r0 * row + c0
            halfconv.encode_half_slab(d.reshape(-1), words[start : start + d.size], half)
        payload[2 * n : 2 * n + 4 * rows] = means.astype("<f4").view(np.uint8)
        payload[2 * n + 4 * rows :] = scales.astype("<f4").view(np.uint8)
        return Encoded(Header(self.name, dtype, shape, {"row": row}), payload.data)

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        n = header.size
        row = meta_int(header, "row", 1, max(n, 1))
        if n % row:
            raise CodecError(f"{header.codec}: row length {row} does not divide {n} elements")
        rows = n // row
        check_payload_size(header, payload, n * 2 + rows * 8)
        words = _frombuffer(payload, np.dtype(np.uint16), n)
        means = _frombuffer(payload, np.dtype(np.float32), rows, n * 2)
        scales = _frombuffer(payload, np.dtype(np.float32), rows, n * 2 + rows * 4)
        # Bound every output value before computing it: |mean| + 65504 * scale must be finite.
        with np.errstate(over="ignore", invalid="ignore"):
            bound = np.abs(means) + scales * np.float32(65504)
        if not np.isfinite(bound).all() or (scales < 0).any():
            raise CodecError(f"{header.codec}: row statistics are negative, NaN, Inf or too large")
        z = halfconv.half_words_to(words, np.dtype(np.float32)).reshape(rows, row)
        z *= scales[:, None]
        z += means[:, None]
        return restore(z.reshape(-1), header)
