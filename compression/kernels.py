"""Vectorised building blocks shared by the quantising codecs.

Speed comes from two habits: work on slabs of :data:`SLAB` elements so that the
temporaries of a multi-step pipeline stay in the CPU cache (one pass over memory
instead of one per step), and replace comparisons against many thresholds by table
lookups.

Everything here is deterministic: elementwise IEEE arithmetic, integer operations and
table lookups give the same bits on every machine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np

from swarmavg.compression import native

__all__ = [
    "CHECK_FLUSH",
    "CHECK_LANES",
    "SLAB",
    "NearestLevel",
    "all_finite",
    "check_copy",
    "check_sums",
    "sample",
    "slabs",
]

SLAB = 1 << 16
"""Elements per slab: 256 KiB of float32, comfortably inside a core's L2 cache."""

_SAMPLE_SIZE = 1 << 18
"""Elements sampled for statistics (quantiles, codebooks): enough for <1% error per bin."""


def slabs(n: int, size: int = SLAB) -> Iterator[slice]:
    """Consecutive slices covering ``range(n)``."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def sample(x: np.ndarray, size: int = _SAMPLE_SIZE) -> np.ndarray:
    """A deterministic, evenly strided sample of about ``size`` elements (a view)."""
    step = max(1, x.size // size)
    return x[::step]


def all_finite(x: np.ndarray) -> bool:
    """Whether a float array holds no NaN/Inf, in one fast reduction when possible.

    Contiguous float32/float64 go through the compiled scan of the exponent bits where it
    is built (2.4x faster than the sum below on a cached 1 MiB chunk, the all-reduce's
    case; both run at memory speed on large arrays). Otherwise: a sum is NaN/Inf when any
    element is; finite elements can overflow the sum only when huge, so a non-finite sum
    is confirmed elementwise before answering False.
    """
    if x.size == 0:
        return True
    scan = getattr(native.kernels, "all_finite", None)  # absent from an older build
    if scan is not None and x.dtype in native.FLOATS and native.takes(x):
        return bool(scan(x, x.dtype.itemsize))
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.add.reduce(x, axis=None, dtype=np.float64 if x.dtype == np.float64 else np.float32)
    return bool(np.isfinite(s)) or bool(np.isfinite(x).all())


CHECK_LANES = 16
"""Lanes of the part check's sums: element ``i`` adds to lane ``i % CHECK_LANES``."""

CHECK_FLUSH = 16
"""Terms a lane sums in the values' dtype before adding that to its float64 total."""


def check_sums(result: np.ndarray, own: np.ndarray) -> np.ndarray:
    """The part check's sums comparing 1-D ``result`` with ``own`` (one float dtype, one
    length), as 5 float64: sum ``d**2``, sum ``own**2``, sum ``|d|``, sum ``|own|``, and
    the count of nonzero values of ``own``, with ``d = result - own`` rounded in their
    dtype.

    The order of the additions is fixed, so that the compiled kernel
    (:func:`~swarmavg.compression.native.check_copy`) gives the same bits: element ``i``
    adds to lane ``i % CHECK_LANES``; each lane sums its terms of each group of
    ``CHECK_LANES * CHECK_FLUSH`` elements in the dtype, in element order, and adds that to
    its float64 total; then the lanes are added in lane order. (``cumsum`` adds in order;
    a last partial group is padded with zeros, which add nothing.) A float32 square
    overflows to Inf beyond 1.8e19, as float32 dot products did.
    """
    n = own.size
    group = CHECK_LANES * CHECK_FLUSH
    groups = -(-n // group)
    sums = np.zeros(5, dtype=np.float64)
    if not groups:
        return sums
    d = np.zeros(groups * group, dtype=own.dtype)
    o = np.zeros(groups * group, dtype=own.dtype)
    np.subtract(result, own, out=d[:n])
    o[:n] = own
    with np.errstate(over="ignore"):
        terms = (d * d, o * o, np.abs(d), np.abs(o))
    shape = (groups, CHECK_FLUSH, CHECK_LANES)
    for i, term in enumerate(terms):
        partials = np.cumsum(term.reshape(shape), axis=1)[:, -1, :]
        lanes = np.cumsum(partials.astype(np.float64), axis=0)[-1]
        total = 0.0
        for lane in lanes.tolist():
            total += lane
        sums[i] = total
    sums[4] = float(np.count_nonzero(own))
    return sums


def check_copy(
    src: np.ndarray,
    own: np.ndarray,
    out: np.ndarray | None = None,
    backup: np.ndarray | None = None,
) -> tuple[bool, np.ndarray]:
    """Copy ``src`` into ``out`` and ``own`` into ``backup`` (either ``None``: not copied;
    ``own`` may be ``out`` itself) and compare ``src`` with ``own`` (:func:`check_sums`):
    one compiled pass where the kernel applies, else numpy, with the same bits.

    Returns:
        Whether ``src`` is all finite, and the sums (everything is written either way).
    """
    sums = np.empty(5, dtype=np.float64)
    finite = native.check_copy(src, own, out, backup, sums)
    if finite is not None:
        return finite, sums
    # own is read before out is written: in place they are one array
    sums = check_sums(src, own)
    if backup is not None:
        np.copyto(backup, own)
    if out is not None:
        np.copyto(out, src)
    return all_finite(src), sums


class NearestLevel:
    """Maps float32 values in [-1, 1] to the index of the nearest of a few sorted levels.

    The lookup table is indexed by the top 19 bits of the value's IEEE representation
    (sign, exponent, 10 mantissa bits), so one shift and one gather replace a binary
    search. Each table cell spans a relative width of 2**-10; its entry is the level
    nearest to the cell's centre, so a value within half a cell (0.05%) of the midpoint
    between two levels may round to the farther one. Values beyond +/-1 saturate.
    """

    SHIFT = 13

    def __init__(self, levels: np.ndarray) -> None:
        levels = np.asarray(levels, dtype=np.float64)
        if levels.ndim != 1 or levels.size < 2 or levels.size > 256:
            raise ValueError("need 2..256 levels")
        if np.any(np.diff(levels) <= 0) or levels[0] < -1 or levels[-1] > 1:
            raise ValueError("levels must be strictly increasing within [-1, 1]")
        self.levels = levels.astype(np.float32)
        self._lock = threading.Lock()
        self._lut: np.ndarray | None = None
        self._values_lut: np.ndarray | None = None

    @property
    def lut(self) -> np.ndarray:
        """The 2**19-entry uint8 table, built on first use (about 20 ms)."""
        lut = self._lut
        if lut is None:
            with self._lock:
                if self._lut is None:
                    self._lut = self._build()
                lut = self._lut
        return lut

    def _build(self) -> np.ndarray:
        n = 1 << (32 - self.SHIFT)
        bits = (np.arange(n, dtype=np.uint32) << self.SHIFT) | np.uint32(1 << (self.SHIFT - 1))
        with np.errstate(invalid="ignore"):
            centres = bits.view(np.float32).astype(np.float64)
        # NaN patterns never reach the table (inputs are checked); give them a valid code.
        centres = np.clip(np.nan_to_num(centres, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)
        levels = self.levels.astype(np.float64)
        midpoints = (levels[1:] + levels[:-1]) / 2
        return np.searchsorted(midpoints, centres, side="left").astype(np.uint8)

    @property
    def values_lut(self) -> np.ndarray:
        """``levels[lut]``: the float32 level each table cell maps to (2 MiB, built on
        first use), so that the round trip of a value is one lookup instead of two."""
        table = self._values_lut
        if table is None:
            codes = self.lut  # outside the lock: it takes the lock itself
            with self._lock:
                if self._values_lut is None:
                    values = np.take(self.levels, codes)
                    values.flags.writeable = False
                    self._values_lut = values
                table = self._values_lut
        return table

    def levels_into(self, v: np.ndarray, out: np.ndarray) -> None:
        """Write the level nearest to each element of float32 ``v`` into float32 ``out``
        (bit-identical to ``levels[codes]`` of :meth:`encode_into`'s codes).

        ``v`` is used as scratch space and is overwritten.
        """
        bits = v.view(np.uint32)
        np.right_shift(bits, self.SHIFT, out=bits)
        np.take(self.values_lut, bits, out=out, mode="clip")  # in range: see encode_into

    def encode_into(self, v: np.ndarray, out: np.ndarray) -> None:
        """Write the level index of each element of float32 ``v`` into uint8 ``out``.

        ``v`` is used as scratch space and is overwritten.
        """
        bits = v.view(np.uint32)
        np.right_shift(bits, self.SHIFT, out=bits)
        # Every index is below 2**19, the table's length: "clip" never clips, and it
        # skips the per-element bounds check of the default mode (much faster).
        np.take(self.lut, bits, out=out, mode="clip")
