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
    check_output,
    check_payload_size,
    meta_int,
    require_finite,
    restore,
)
from swarmavg.compression.dtypes import FLOATING, is_bfloat16
from swarmavg.compression.errors import CodecError
from swarmavg.compression.native import copy_finite, takes
from swarmavg.compression.native import kernels as native

__all__ = ["BFloat16Codec", "Float16Codec", "NoneCodec", "ScaledFloat16Codec"]

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)


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
        values, checked = self.decode_payload_unchecked(header, payload)
        if not checked:
            require_finite(values, "decoded tensor")
        return values

    def decode_payload_unchecked(self, header: Header, payload: Buffer) -> tuple[np.ndarray, bool]:
        """A view of the payload (``decode()`` copies if it must), unchecked: a scan here
        would be a pass of its own."""
        check_payload_size(header, payload, header.size * header.dtype.itemsize)
        out = _frombuffer(payload, header.dtype)
        return out.reshape(header.shape), header.dtype not in FLOATING

    def decode_payload_into(self, header: Header, payload: Buffer, out: np.ndarray) -> None:
        """float32/float64: copy and check in one compiled pass where the kernels are built
        (the all-reduce decodes every averaged chunk it receives into the result this way);
        otherwise the check, then the copy."""
        check_output(header, out)
        check_payload_size(header, payload, header.size * header.dtype.itemsize)
        values = _frombuffer(payload, header.dtype)
        flat = out.reshape(-1)
        finite = copy_finite(values, flat)
        if finite is not None:
            if not finite:
                raise CodecError("decoded tensor contains NaN or Inf")
            return
        if header.dtype in FLOATING:
            require_finite(values, "decoded tensor")
        np.copyto(flat, values)


class Float16Codec(Codec):
    """IEEE half precision, 2 bytes per element; inputs saturate at +/-65504."""

    name = "float16"
    decodes_finite = True  # Inf/NaN words are refused
    decodes_into_cleanly = True  # decode_payload_into checks every word before it writes

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        words = halfconv.float_to_half_words(flat)
        return Encoded(Header(self.name, dtype, tuple(np.shape(array))), _bytes_view(words))

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        check_payload_size(header, payload, header.size * 2)
        words = _frombuffer(payload, np.dtype(np.uint16))
        return halfconv.half_words_to(words, header.dtype).reshape(header.shape)

    def decode_payload_unchecked(self, header: Header, payload: Buffer) -> tuple[np.ndarray, bool]:
        """For a float32 header, the words themselves as float16, unchecked: they widen
        exactly, and the all-reduce's mean reads them where it adds them (half the bytes
        of decoded values, no array written and read back) and checks them there."""
        if header.dtype != np.float32:
            return super().decode_payload_unchecked(header, payload)
        check_payload_size(header, payload, header.size * 2)
        return _frombuffer(payload, np.dtype(np.float16)).reshape(header.shape), False

    def decode_payload_into(self, header: Header, payload: Buffer, out: np.ndarray) -> None:
        if header.dtype != np.float32:
            super().decode_payload_into(header, payload, out)
            return
        check_output(header, out)
        check_payload_size(header, payload, header.size * 2)
        words = _frombuffer(payload, np.dtype(np.uint16))
        halfconv.half_words_into(words, out.reshape(-1), check_first=True)

    def encode_payload_and_values(
        self, array: np.ndarray, info: CodecInfo
    ) -> tuple[Encoded, np.ndarray]:
        """The words and their decoded values from one rounding pass (no decode).

        float16 inputs are their own words, so their values are the input itself.
        """
        flat, dtype = as_input(array, floating_only=True)
        shape = tuple(np.shape(array))
        header = Header(self.name, dtype, shape)
        if dtype == np.float16:
            words = halfconv.float_to_half_words(flat)  # a view, checked for Inf/NaN
            return Encoded(header, _bytes_view(words)), flat.reshape(shape)
        words, values = halfconv.float_to_half_words_and_values(flat)
        return Encoded(header, _bytes_view(words)), _widen(values, dtype).reshape(shape)

    def round_trip(self, array: np.ndarray, info: CodecInfo) -> np.ndarray:
        """The rounded values without the words (one pass of float32 arithmetic)."""
        flat, dtype = as_input(array, floating_only=True)
        shape = tuple(np.shape(array))
        if dtype == np.float16:
            halfconv.float_to_half_words(flat)  # raises on Inf/NaN, as encoding does
            return flat.reshape(shape)
        return _widen(halfconv.round_to_half(flat), dtype).reshape(shape)


def _widen(values: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """float32 values of binary16 words as ``dtype``, cast exactly as the decoder casts
    them (float64 widens exactly; bfloat16 rounds to nearest even)."""
    return values if dtype == np.float32 else values.astype(dtype)


class BFloat16Codec(Codec):
    """bfloat16 (8-bit exponent, 7-bit mantissa), round to nearest even, 2 bytes/element."""

    name = "bfloat16"
    decodes_finite = True  # Inf/NaN words are refused

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        words = halfconv.float_to_bf16_words(flat)
        return Encoded(Header(self.name, dtype, tuple(np.shape(array))), _bytes_view(words))

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        check_payload_size(header, payload, header.size * 2)
        words = _frombuffer(payload, np.dtype(np.uint16))
        return halfconv.bf16_words_to(words, header.dtype).reshape(header.shape)

    def encode_payload_and_values(
        self, array: np.ndarray, info: CodecInfo
    ) -> tuple[Encoded, np.ndarray]:
        """The words, and their values widened without re-checking them (the encoder
        never writes Inf/NaN words); bfloat16 inputs are their own values. float16
        inputs take the default path (their decoding saturates at the float16 range)."""
        flat, dtype = as_input(array, floating_only=True)
        if dtype == np.float16:
            return super().encode_payload_and_values(array, info)
        shape = tuple(np.shape(array))
        words = halfconv.float_to_bf16_words(flat)
        encoded = Encoded(Header(self.name, dtype, shape), _bytes_view(words))
        if is_bfloat16(dtype):
            return encoded, flat.reshape(shape)  # the words are the input's own
        return encoded, halfconv.bf16_words_to_unchecked(words, dtype).reshape(shape)


def _row_length(shape: tuple[int, ...], size: int) -> int:
    """Rows run along the last axis when it is long enough to be worth its 8 bytes of
    statistics; otherwise the whole tensor is one row (also when it is empty: the decoder
    accepts only row lengths up to the element count)."""
    if len(shape) >= 2 and shape[-1] >= 64 and size:
        return shape[-1]
    return max(size, 1)


_STATS_SLAB = 1 << 17
"""Elements per tile of the scaled-float16 encoder. Each numpy call costs 1-2 us, and
the encoder makes 13 per tile: tiles of 2**17 elements keep that under 10% of the
time, while the tile and its 6 bytes per element of scratch stay in L2 (or close to
it, in a large L3); 2**16 measured about 10% slower, 2**18 no faster."""

_TWO_M112 = np.float32(2.0**-112)
_TINY_SQUARES = 2.0**-100
"""Below this, a float32 sum of squared deviations may have lost precision to
subnormals (each term's error is up to 2**-150): such rows are summed in float64."""
_SUBNORMAL_VARIANCE = 2.0**-252  # (2**-126)**2: the variance of a std at float32's tiny
_MIN_FAST_INVERSE = np.float32(2.0**-14)  # inverse * 2**-112 is still a normal float32
_FAST_BOUND = 32768.0  # |z| below this (with margin) never rounds to binary16 Inf


def _tiles(rows: int, row: int, size: int) -> Iterator[tuple[int, int, int, int]]:
    """Cache-sized tiles ``(r0, r1, c0, c1)`` of a (rows, row) array, in memory order:
    whole rows grouped up to ``size`` elements, or segments of ``size`` of one long row."""
    if row >= size:
        for r in range(rows):
            for c in range(0, row, size):
                yield r, r + 1, c, min(c + size, row)
    else:
        group = size // row
        for r in range(0, rows, group):
            yield r, min(r + group, rows), 0, row


class _RowStats:
    """Per-row mean, sum of squared deviations and a bound on ``|x - mean|``, in one pass.

    Rows that fit in one tile get the exact two-pass statistics (float32 pairwise mean,
    then the squares of the deviations from it) while the tile is in cache. Longer rows
    are split into segments whose two-pass statistics are combined exactly in float64
    (Chan et al.'s pairwise update), so the input is read from memory once.

    ``spread[r]`` bounds ``|x - means[r]|`` over row r: within a segment centred on c,
    ``|x - c| <= sqrt(sum((x - c)**2))``, plus ``|c - means[r]|`` (float64, rounding up
    to a few ulps; callers keep a factor 2 of margin).
    """

    def __init__(self, x: np.ndarray) -> None:
        rows, row = x.shape
        self.means = np.zeros(rows, np.float32)
        self.squares = np.zeros(rows, np.float64)
        self.spread = np.zeros(rows, np.float64)
        scratch = np.empty(min(x.size, _STATS_SLAB), np.float32)
        seg_sums: list[float] = []
        seg_counts: list[int] = []
        seg_squares: list[float] = []
        seg_centres: list[float] = []
        with np.errstate(over="ignore", invalid="ignore"):
            for r0, r1, c0, c1 in _tiles(rows, row, _STATS_SLAB):
                tile = x[r0:r1, c0:c1]
                cols = c1 - c0
                sums = np.add.reduce(tile, axis=1, dtype=np.float32)
                centre = sums / np.float32(cols)
                d = scratch[: (r1 - r0) * cols].reshape(r1 - r0, cols)
                np.subtract(tile, centre[:, None], out=d)
                squares = np.einsum("ij,ij->i", d, d).astype(np.float64)
                tiny = squares < _TINY_SQUARES
                if tiny.any():
                    # Squares of deviations below ~2**-63 underflow float32 (to 0 for
                    # a row of values around 1e-30): redo those rows in float64.
                    wide = d[tiny].astype(np.float64)
                    squares[tiny] = np.einsum("ij,ij->i", wide, wide)
                if cols == row:
                    self.means[r0:r1] = centre
                    self.squares[r0:r1] = squares
                    self.spread[r0:r1] = np.sqrt(squares.astype(np.float64))
                    continue
                seg_sums.append(float(sums[0]))
                seg_counts.append(cols)
                seg_squares.append(float(squares[0]))
                seg_centres.append(float(centre[0]))
                if c1 == row:
                    self._combine(r0, seg_sums, seg_counts, seg_squares, seg_centres, row)
                    seg_sums, seg_counts, seg_squares, seg_centres = [], [], [], []
        # A std below float32's smallest normal (values within ~1e-38 of their mean)
        # cannot be inverted: such rows count as constant.
        self.squares[self.squares < row * _SUBNORMAL_VARIANCE] = 0.0

    def _combine(
        self,
        r: int,
        sums: list[float],
        counts: list[int],
        squares: list[float],
        centres: list[float],
        row: int,
    ) -> None:
        s = np.array(sums)
        c = np.array(counts, np.float64)
        q = np.array(squares)
        mean = s.sum() / row
        with np.errstate(over="ignore", invalid="ignore"):
            self.means[r] = mean
            self.squares[r] = q.sum() + np.sum(c * (s / c - mean) ** 2)
            offsets = np.abs(np.array(centres) - float(self.means[r]))
            self.spread[r] = np.max(np.sqrt(q) + offsets)


def _fast_path_safe(stats: _RowStats, inverse: np.ndarray) -> bool:
    """Whether every row's ``|x - mean| * inverse`` stays below half of binary16's
    overflow threshold (a factor 2 of margin for float32 rounding in the statistics),
    and ``inverse * 2**-112`` is a normal float32.

    Always true for exact statistics of rows shorter than 2**28 elements (``|x - mean|
    <= sqrt(row) * std``); false for huge-spread rows (std > 2**14) and pathological
    inputs, which take the saturating path.
    """
    if inverse.size == 0:
        return True
    if inverse.min() < _MIN_FAST_INVERSE:
        return False
    with np.errstate(over="ignore", invalid="ignore"):
        bound = stats.spread * inverse.astype(np.float64)
    return bool((bound < _FAST_BOUND).all())


def _encode_scaled_fast(x: np.ndarray, means: np.ndarray, k: np.ndarray, words: np.ndarray) -> None:
    """binary16 words of ``(x - mean) * inverse`` per row, rounded to nearest even.

    ``k = inverse * 2**-112`` (exact: a power-of-two scale of a normal float) makes the
    product's float32 bits hold binary16's exponent and mantissa in bits 13..27 (a
    binary16 subnormal becomes the float32 subnormal with the same bits), so rounding is
    an integer add of 0xFFF plus the lowest kept bit. The caller guarantees that no
    product reaches binary16's overflow threshold (``_fast_path_safe``).
    """
    rows, row = x.shape
    if native is not None and takes(x, means, k, words):
        native.scaled16(x, means, k, row, words)  # the same bits in one pass
        return
    m = min(x.size, _STATS_SLAB)
    y = np.empty(m, np.float32)
    sign = np.empty(m, np.uint16)
    bits = y.view(np.uint32)
    for r0, r1, c0, c1 in _tiles(rows, row, _STATS_SLAB):
        size = (r1 - r0) * (c1 - c0)
        yt = y[:size].reshape(r1 - r0, c1 - c0)
        np.subtract(x[r0:r1, c0:c1], means[r0:r1, None], out=yt)
        np.multiply(yt, k[r0:r1, None], out=yt)
        u, s = bits[:size], sign[:size]
        start = r0 * row + c0
        out = words[start : start + size]
        # The output slice doubles as scratch for the lowest kept bit (bit 13 of u).
        np.right_shift(u, 13, out=out, casting="unsafe")
        np.bitwise_and(out, np.uint16(1), out=out)
        np.add(u, out, out=u)
        np.add(u, np.uint32(0xFFF), out=u)  # magnitude < 2**28: no carry into the sign
        np.right_shift(u, 16, out=s, casting="unsafe")
        np.bitwise_and(s, np.uint16(0x8000), out=s)
        np.right_shift(u, 13, out=out, casting="unsafe")  # drops the sign (now bit 18)
        np.bitwise_or(out, s, out=out)


def _encode_scaled_checked(
    x: np.ndarray, means: np.ndarray, inverse: np.ndarray, words: np.ndarray
) -> None:
    """The general path: saturates at +/-65504 (rows of billions of elements, or
    statistics too inaccurate for the fast path's bound) and handles huge spreads."""
    rows, row = x.shape
    scratch = np.empty(min(x.size, halfconv.HALF_SLAB), np.float32)
    half = halfconv.HalfScratch(x.size)
    for r0, r1, c0, c1 in _tiles(rows, row, halfconv.HALF_SLAB):
        d = scratch[: (r1 - r0) * (c1 - c0)].reshape(r1 - r0, c1 - c0)
        np.subtract(x[r0:r1, c0:c1], means[r0:r1, None], out=d)
        np.multiply(d, inverse[r0:r1, None], out=d)
        start = r0 * row + c0
        halfconv.encode_half_slab(d.reshape(-1), words[start : start + d.size], half)


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
        stats = _RowStats(x)
        means = stats.means
        if not np.isfinite(means).all():
            raise CodecError("input contains NaN or Inf (or values beyond float32 range)")
        stds = np.sqrt(stats.squares / row).astype(np.float32)
        if not np.isfinite(stds).all():
            raise CodecError("input values are too large for float32 statistics")
        # A constant row has std 0: keep the scale at 1 so that z is exactly 0. So does
        # a row whose std is subnormal (1/std would overflow): every |x - mean| there
        # is below sqrt(row) * 2**-126, which z = x - mean then rounds away.
        scales = np.where(stds >= _F32_TINY, stds, np.float32(1)).astype(np.float32)
        inverse = (np.float32(1) / scales).astype(np.float32)
        payload = np.empty(2 * n + 8 * rows, np.uint8)
        words = payload[: 2 * n].view("<u2")
        if _fast_path_safe(stats, inverse):
            _encode_scaled_fast(x, means, inverse * _TWO_M112, words)
        else:
            _encode_scaled_checked(x, means, inverse, words)
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
