"""Per-tensor 8-bit quantisation with a codebook: ``uint8-uniform`` and ``uint8-quantile``.

Both send one uint8 code per element and, in ``meta["codebook"]``, 256 float32 values:
the mean of the elements that fell in each bin (bins with no sampled element get their
centre). Decoding is a table lookup, so the decoded values are exactly the codebook's.

- ``uint8-uniform``: 256 equal bins over mean +/- 6 standard deviations; values outside
  fall in the outer bins. Cheap, but wastes most bins on heavy-tailed tensors.
- ``uint8-quantile``: bin borders at the 1/256 quantiles, so every bin holds about the
  same number of elements, except that the outermost 1/256 of each tail is split
  geometrically down to a 2**-18 tail (see ``_border_probabilities``); robust to heavy
  tails.

Statistics (mean, std, quantiles, bin means) come from a deterministic strided sample
of about 2**18 elements, so a 100M-element tensor costs the same to analyse as a 1M
one (hivemind computes quantiles over chunks for the same reason). With ~1000 samples
per bin the sampled bin means add well under 1% to the quantisation error.
"""

from __future__ import annotations

import numpy as np

from swarmavg.compression.base import (
    Buffer,
    Codec,
    CodecInfo,
    Encoded,
    Header,
    as_input,
    check_payload_size,
    meta_array,
    restore,
)
from swarmavg.compression.errors import CodecError
from swarmavg.compression.halfconv import as_float32
from swarmavg.compression.kernels import SLAB, all_finite, sample, slabs

__all__ = ["Quantile8BitCodec", "Uniform8BitCodec"]

N_BINS = 256
RANGE_IN_SIGMAS = 6.0
_MAX_CELL_BORDERS = 4  # above this many borders in one lookup cell, use a binary search
_TAIL_SPLITS = 10


def _border_probabilities() -> np.ndarray:
    """Cumulative probabilities of the 255 bin borders.

    The body gets equal-probability bins. Each outer 1/256 of the distribution is split
    geometrically (tail probabilities 2**-9 ... 2**-18) instead of being one bin: on a
    heavy-tailed tensor a per-tensor code's error is dominated by its most extreme
    values, and this cuts the error on a Student-t(3) tensor about 15-fold while also
    lowering it on a normal one (measured in benchmarks/compression.py).
    """
    tail = np.array([2.0 ** -(8 + m) for m in range(_TAIL_SPLITS, 0, -1)])
    body = np.linspace(1 / N_BINS, 1 - 1 / N_BINS, N_BINS - 1 - 2 * _TAIL_SPLITS)
    return np.concatenate([tail, body, 1 - tail[::-1]])


_BORDER_PROBS = _border_probabilities()


_MIN_BIN_WIDTH = 4.0 / float(np.finfo(np.float32).max)
"""Narrowest uniform bin whose inverse (the float32 scale) stays finite with margin."""


def _check_input(x: np.ndarray) -> None:
    if not all_finite(x):
        raise CodecError("input contains NaN or Inf (or values beyond float32 range)")


def _affine_cells(
    x: np.ndarray,
    scale: np.float32,
    shift: np.float32,
    top: int,
    out: np.ndarray,
    scratch: np.ndarray,
) -> None:
    """out = clip(x * scale + shift, 0, top) truncated to integers (monotone in x)."""
    np.multiply(x, scale, out=scratch)
    np.add(scratch, shift, out=scratch)
    np.clip(scratch, 0, top, out=scratch)
    out[...] = scratch


def _codebook(values: np.ndarray, codes: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Mean of ``values`` per code; ``fallback`` for codes that never occur.

    A fallback beyond float32's range (bin centres of a tensor that spans nearly all of
    it) is clipped to it: no element uses such a bin, and an infinite codebook entry
    would make every decoder reject the message.
    """
    counts = np.bincount(codes, minlength=N_BINS)
    sums = np.bincount(codes, weights=values, minlength=N_BINS)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / counts
    f32_max = float(np.finfo(np.float32).max)
    return np.clip(np.where(counts > 0, means, fallback), -f32_max, f32_max).astype("<f4")


def _exact_tail_means(
    x: np.ndarray, codes: np.ndarray, codebook: np.ndarray, below: int, above: int
) -> None:
    """Overwrite the codebook entries of codes < ``below`` and > ``above`` with the exact
    mean of their elements.

    The outer bins hold the most extreme values, where a sampled mean is least accurate
    and errors cost the most; they are rare, so gathering them costs one cheap pass.
    """
    picked = np.flatnonzero((codes < below) | (codes > above))
    _set_means(codebook, codes[picked], x[picked])


def _set_means(codebook: np.ndarray, codes: np.ndarray, values: np.ndarray) -> None:
    """Overwrite the codebook entry of each code present in ``codes`` with the mean of
    its ``values`` (float64 sums in element order)."""
    if codes.size == 0:
        return
    counts = np.bincount(codes, minlength=N_BINS)
    sums = np.bincount(codes, weights=values, minlength=N_BINS)
    seen = counts > 0
    codebook[seen] = sums[seen] / counts[seen]


def _decode_codebook(header: Header, payload: Buffer) -> np.ndarray:
    n = header.size
    check_payload_size(header, payload, n)
    codebook = meta_array(header, "codebook", np.float32, N_BINS)
    if not np.isfinite(codebook).all():
        raise CodecError(f"{header.codec}: codebook contains NaN or Inf")
    codes = np.frombuffer(payload, dtype=np.uint8, count=n)
    out = np.empty(n, np.float32)
    for s in slabs(n, SLAB * 4):
        np.take(codebook, codes[s], out=out[s])
    return restore(out, header)


class Uniform8BitCodec(Codec):
    """256 equal bins over mean +/- 6 sigma, per-bin mean codebook; 1 byte per value."""

    name = "uint8-uniform"

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        x = as_float32(flat)
        if not (info.finite and flat.dtype == np.float32):  # float64 may overflow float32
            _check_input(x)
        smp = sample(x).astype(np.float64)
        mean = float(smp.mean()) if smp.size else 0.0
        std = float(smp.std()) if smp.size else 0.0
        width = 2 * RANGE_IN_SIGMAS * std / N_BINS
        if not width > 0 or not np.isfinite(width):
            width = 1.0  # constant tensor: every value lands in one bin whose mean is exact
        # Spreads of subnormal size would make 1/width overflow float32; bins this narrow
        # lose nothing (the codebook stores each bin's exact mean anyway).
        width = max(width, _MIN_BIN_WIDTH)
        lo = mean - RANGE_IN_SIGMAS * std
        scale = np.float32(1.0 / width)
        shift = np.float32(-lo / width)
        n = x.size
        codes = np.empty(n, np.uint8)
        scratch = np.empty(min(n, SLAB), np.float32)
        for s in slabs(n):
            _affine_cells(x[s], scale, shift, N_BINS - 1, codes[s], scratch[: s.stop - s.start])
        smp32 = sample(x)
        smp_codes = np.empty(smp32.size, np.uint8)
        _affine_cells(smp32, scale, shift, N_BINS - 1, smp_codes, np.empty(smp32.size, np.float32))
        centres = lo + (np.arange(N_BINS) + 0.5) * width
        codebook = _codebook(smp32, smp_codes, centres)
        _exact_tail_means(x, codes, codebook, 1, N_BINS - 2)
        header = Header(self.name, dtype, tuple(np.shape(array)), {"codebook": codebook.tobytes()})
        return Encoded(header, codes.data)

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        return _decode_codebook(header, payload)


class _QuantileTable:
    """Exact ``code(x) = #{borders <= x}`` through a lookup table on a uniform grid.

    A monotone map ``cell(x)`` (float32 multiply-add, clip, truncate) sends x to one of
    ``cells`` cells. Borders whose own cell is below x's cell are certainly <= x, those
    above certainly > x, and the few in the same cell are compared directly. Because
    the borders are binned with the very same float32 arithmetic, rounding cannot make
    this disagree with a binary search.
    """

    def __init__(self, borders: np.ndarray, cells: int) -> None:
        self.borders = borders
        self.top = cells - 1
        lo, hi = float(borders[0]), float(borders[-1])
        scale = self.top / (hi - lo) if hi > lo else 0.0
        # Borders a few subnormals apart would need a scale beyond float32: no table.
        self.usable = abs(scale) < 1e30 and abs(lo * scale) < 1e30
        if not self.usable:
            scale = 0.0
        self.scale = np.float32(scale)
        self.shift = np.float32(-lo * scale)
        border_cells = np.empty(borders.size, np.int32)
        _affine_cells(
            borders,
            self.scale,
            self.shift,
            self.top,
            border_cells,
            np.empty(borders.size, np.float32),
        )
        self.lut = np.searchsorted(border_cells, np.arange(cells), side="left").astype(np.uint8)
        per_cell = np.bincount(border_cells, minlength=cells)
        self.depth = int(per_cell.max())
        self.usable = self.usable and self.depth <= _MAX_CELL_BORDERS
        self.thresholds: list[np.ndarray] = []
        for k in range(self.depth):
            i = self.lut.astype(np.int64) + k
            has = per_cell > k
            thr = np.full(cells, np.inf, np.float32)
            thr[has] = borders[i[has]]
            self.thresholds.append(thr)

    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        m = min(x.size, SLAB)
        scratch = np.empty(m, np.float32)
        cells = np.empty(m, np.intp)  # np.take is about twice as fast with native indices
        thr = np.empty(m, np.float32)
        above = np.empty(m, np.bool_)
        for s in slabs(x.size):
            k = s.stop - s.start
            xs, c, o = x[s], cells[:k], out[s]
            _affine_cells(xs, self.scale, self.shift, self.top, c, scratch[:k])
            np.take(self.lut, c, out=o)
            for table in self.thresholds:
                np.take(table, c, out=thr[:k])
                np.greater_equal(xs, thr[:k], out=above[:k])
                o += above[:k]


class _SnappedTable:
    """``code(x) = lut[cell(x)]``: each quantile border moved down to the lower edge of
    its cell on a uniform grid, so that coding needs no per-element correction.

    ``cell(x) = clip((x - origin) * scale, 0, top)`` truncated, in float32: monotone
    in x, and subtracting first keeps the cells exact for tensors far from zero (a
    narrow range around 1000, say). The outermost borders are one cell inside the grid
    so that both extreme bins survive. Exactly as with the exact borders, every
    ``x >= border`` is coded above it (the border's own cell is computed with the same
    arithmetic): in sparse tails, where each border is one extreme sample value, that
    element keeps its own bin. Only values below a border within its cell (one of up
    to 65,536 cells spanning the borders' range) move up one code, which changes the
    error by less than the run-to-run noise (docs/benchmarks.md).

    The tail codes (below ``below`` or above ``above``) are gathered anyway for their
    exact means. When tail borders share cells (bounded distributions: the geometric
    tail splits are narrower than a cell), those elements are recoded exactly by a
    binary search, so the tail bins stay distinct. The table is usable only when the
    body borders ``below - 2 .. above`` each have a cell of their own (otherwise body
    bins would merge); then a value is never coded more than one code too high.
    """

    def __init__(self, borders: np.ndarray, cells: int, below: int, above: int) -> None:
        self.borders = borders
        self.below, self.above = below, above
        self.top = cells - 1
        lo, hi = float(borders[0]), float(borders[-1])
        scale = (self.top - 2) / (hi - lo) if hi > lo else 0.0
        self.usable = (
            0.0 < scale < 1e30
            and borders.size + 2 <= cells <= 1 << 16
            and 2 <= below <= above < borders.size
        )
        if not self.usable:
            scale = 1.0
        self.scale = np.float32(scale)
        self.origin = np.float32(lo - 1.5 / scale)  # lo, hi: centres of cells 1, top - 1
        edges = np.empty(borders.size, np.int32)
        self.cells_of(borders, edges, np.empty(borders.size, np.float32))
        distinct = np.diff(edges) > 0
        self.usable = (
            self.usable
            and bool(distinct[below - 2 : above].all())
            and int(edges[0]) >= 1
            and int(edges[-1]) < self.top
        )
        self.exact_tails = not bool(distinct.all())
        # Cell c lies at or above border j's cell exactly when edges[j] <= c.
        self.lut = np.searchsorted(edges, np.arange(cells), side="right").astype(np.uint8)

    def cells_of(self, x: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
        with np.errstate(over="ignore"):  # beyond float32: Inf, clipped to the top cell
            np.subtract(x, self.origin, out=scratch)
            np.multiply(scratch, self.scale, out=scratch)
        np.clip(scratch, 0, self.top, out=scratch)
        out[...] = scratch

    def _fix_tails(self, x: np.ndarray, codes: np.ndarray, picked: np.ndarray) -> np.ndarray:
        """Recode the picked tail elements exactly (when tail borders share cells);
        returns the picked elements whose code is still a tail code."""
        if not self.exact_tails or picked.size == 0:
            return picked
        exact = np.searchsorted(self.borders, x[picked], side="right").astype(np.uint8)
        codes[picked] = exact
        still: np.ndarray = picked[(exact < self.below) | (exact > self.above)]
        return still

    def codes_of(self, x: np.ndarray) -> np.ndarray:
        cells = np.empty(x.size, np.uint16)
        self.cells_of(x, cells, np.empty(x.size, np.float32))
        codes = self.lut[cells]
        self._fix_tails(x, codes, np.flatnonzero((codes < self.below) | (codes > self.above)))
        return codes

    def encode(self, x: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Codes of ``x`` into ``out``; returns the tail codes and their values, in
        element order, gathered slab by slab while the slab is in cache."""
        m = min(x.size, SLAB)
        scratch = np.empty(m, np.float32)
        # uint16 cells (cells <= 2**16): cheap to convert to, and a fast np.take index.
        cells = np.empty(m, np.uint16)
        shifted = np.empty(m, np.uint8)
        outer = np.empty(m, np.bool_)
        width = np.uint8(self.above - self.below)
        tail_codes: list[np.ndarray] = []
        tail_values: list[np.ndarray] = []
        for s in slabs(x.size):
            k = s.stop - s.start
            xs, c, o = x[s], cells[:k], out[s]
            self.cells_of(xs, c, scratch[:k])
            np.take(self.lut, c, out=o)
            # One unsigned comparison: codes below ``below`` wrap around to large values.
            np.subtract(o, np.uint8(self.below), out=shifted[:k])
            np.greater(shifted[:k], width, out=outer[:k])
            picked = self._fix_tails(xs, o, np.flatnonzero(outer[:k]))
            if picked.size:
                tail_codes.append(o[picked])
                tail_values.append(xs[picked])
        if not tail_codes:
            return np.empty(0, np.uint8), np.empty(0, np.float32)
        return np.concatenate(tail_codes), np.concatenate(tail_values)


class Quantile8BitCodec(Codec):
    """Bins at approximate 1/256 quantiles, per-bin mean codebook; 1 byte per value."""

    name = "uint8-quantile"

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        x = as_float32(flat)
        if not (info.finite and flat.dtype == np.float32):  # float64 may overflow float32
            _check_input(x)
        n = x.size
        codes = np.empty(n, np.uint8)
        codebook = np.zeros(N_BINS, "<f4")
        if n:
            smp = np.sort(sample(x))
            picks = np.minimum((_BORDER_PROBS * smp.size).astype(np.int64), smp.size - 1)
            borders = np.unique(smp[picks])  # sorted, <= 255 distinct values
            cells = int(min(1 << 16, max(256, n // 4)))
            below = _TAIL_SPLITS + 1
            above = borders.size - _TAIL_SPLITS - 1
            snapped = _SnappedTable(borders, cells, below, above)
            if snapped.usable:
                tail_codes, tail_values = snapped.encode(x, codes)
                # Sorted sample: each code's sampled elements are one contiguous run.
                per_code = np.bincount(snapped.codes_of(smp), minlength=borders.size + 1)
                bounds = np.concatenate([[0], np.cumsum(per_code)])
            else:
                table = _QuantileTable(borders, cells)
                if table.usable:
                    table.encode(x, codes)
                else:  # extremely concentrated borders: an exact binary search
                    for s in slabs(n):
                        codes[s] = np.searchsorted(borders, x[s], side="right")
                picked = np.flatnonzero((codes < below) | (codes > above))
                tail_codes, tail_values = codes[picked], x[picked]
                starts = np.searchsorted(smp, borders, side="left")
                bounds = np.concatenate([[0], starts, [smp.size]])
            csum = np.concatenate([[0.0], np.cumsum(smp, dtype=np.float64)])
            counts = np.diff(bounds)
            sums = csum[bounds[1:]] - csum[bounds[:-1]]
            edges = np.concatenate([borders[:1], borders, borders[-1:]]).astype(np.float64)
            fallback = (edges[:-1] + edges[1:]) / 2
            with np.errstate(invalid="ignore", divide="ignore"):
                means = np.where(counts > 0, sums / np.maximum(counts, 1), fallback)
            codebook[: means.size] = means
            _set_means(codebook, tail_codes, tail_values)
        header = Header(self.name, dtype, tuple(np.shape(array)), {"codebook": codebook.tobytes()})
        return Encoded(header, codes.data)

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        return _decode_codebook(header, payload)
