"""Blockwise absmax quantisation: ``uint8-blockwise`` and ``uint4-blockwise``.

The flattened tensor is cut into blocks (4096 elements for 8-bit, 64 for 4-bit); each
block is divided by its scale, the element of largest magnitude *with its sign* (so that
this element lands exactly on level +1.0 whatever its sign: both codes have more
resolution on the positive side), and every value is replaced by the index of the
nearest level of a fixed non-linear code. An outlier therefore only costs precision
inside its own block, which is why blockwise codes beat per-tensor ones on heavy tails
(Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization").

Codes (named in ``meta["map"]``, so a decoder never guesses):

- ``dynamic8``: the dynamic tree code of Dettmers (2016) as bitsandbytes builds it
  (``create_dynamic_map``), re-derived: per decade ``10**(i-6) .. 10**(i-5)`` for
  i = 0..6, the centres of ``2**i`` equal sub-intervals, with both signs, plus 0 and
  1.0: 256 levels.
- ``nf4``: the 4-bit NormalFloat code of QLoRA (Dettmers et al. 2023): levels at
  quantiles of N(0, 1) so that each is equally likely for normal data, with an exact 0,
  normalised to [-1, 1]. Two codes per byte, first element in the high nibble.

Payload: the codes, then one float32 scale per block (little-endian).

The ``dynamic8`` code's per-element passes run in the compiled kernels where they are
built (:mod:`swarmavg.compression.native`): the same lookups and products in one pass,
bit-identical to the numpy slabs here.
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np

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
    restore,
)
from swarmavg.compression.errors import CodecError
from swarmavg.compression.halfconv import as_float32
from swarmavg.compression.kernels import NearestLevel
from swarmavg.compression.native import kernels as native
from swarmavg.compression.native import takes

__all__ = ["Blockwise4BitCodec", "Blockwise8BitCodec", "dynamic8_levels", "nf4_levels"]


def dynamic8_levels() -> np.ndarray:
    """The 256 sorted levels of the ``dynamic8`` code (float64, in [-1, 1])."""
    levels = [0.0, 1.0]
    for i in range(7):
        edges = np.linspace(0.1, 1.0, 2**i + 1)
        centres = 10.0 ** (i - 6) * (edges[:-1] + edges[1:]) / 2
        levels += [*centres, *(-centres)]
    return np.array(sorted(levels))


def nf4_levels() -> np.ndarray:
    """The 16 sorted levels of the ``nf4`` code (float64, in [-1, 1])."""
    # QLoRA appendix: 8 positive and 7 negative quantiles from an offset that makes the
    # extreme level the mean of the two outermost quantile bins of 16 and 15 bins.
    offset = 0.9677083
    ppf = NormalDist().inv_cdf
    pos = [ppf(float(p)) for p in np.linspace(offset, 0.5, 9)[:-1]]
    neg = [-ppf(float(p)) for p in np.linspace(offset, 0.5, 8)[:-1]]
    v = np.array(sorted([*pos, 0.0, *neg]))
    out: np.ndarray = v / np.abs(v).max()
    return out


_DYNAMIC8 = NearestLevel(dynamic8_levels())
_DYNAMIC8_TABLE = _DYNAMIC8.levels.astype(np.float32)
_NF4 = NearestLevel(nf4_levels())
_NF4_TABLE = _NF4.levels.astype(np.float32)
# Decoding table for packed bytes: byte -> (value of high nibble, value of low nibble).
_NF4_PAIRS = np.stack([np.repeat(_NF4_TABLE, 16), np.tile(_NF4_TABLE, 16)], axis=1).astype(
    np.float32
)

_F32_TINY = float(np.finfo(np.float32).tiny)
_NOT_FINITE = "input contains NaN or Inf (or values beyond float32 range)"

SLAB = 1 << 17
"""Elements per slab: whole blocks, scaled and looked up while in cache. Twice the
shared ``kernels.SLAB``: measured 5-10% faster here (fewer numpy calls per chunk)."""


def _row_scale(rows: np.ndarray) -> np.ndarray:
    """The signed element of largest magnitude of each row of a 2-D float32 array."""
    width = rows.shape[1]
    if width <= 256 and width & (width - 1) == 0:
        # Short rows: numpy's per-row reductions are slow (fixed cost per row), so fold
        # the rows in halves with elementwise max/min instead.
        hi, lo = rows, rows
        while width > 1:
            width //= 2
            hi = np.maximum(hi[:, :width], hi[:, width:])
            lo = np.minimum(lo[:, :width], lo[:, width:])
        hi, lo = hi[:, 0], lo[:, 0]
    else:
        hi, lo = rows.max(axis=1), rows.min(axis=1)
    scale: np.ndarray = np.where(hi >= -lo, hi, lo)
    # + 0.0 turns a block of zeros' -0.0 into +0.0 (and changes nothing else): the same
    # scale whatever the order of the zeros, as the compiled kernel gives.
    scale += np.float32(0)
    return scale


def _block_scales(x: np.ndarray, block: int) -> np.ndarray:
    """Signed largest-magnitude element of each block (the last block may be short)."""
    n = x.size
    full = n // block
    out = np.empty(-(-n // block), np.float32)
    rows_per_slab = max(1, SLAB // block)
    for first in range(0, full, rows_per_slab):
        last = min(first + rows_per_slab, full)
        out[first:last] = _row_scale(x[first * block : last * block].reshape(-1, block))
    if n % block:
        out[full] = _row_scale(x[full * block :].reshape(1, -1))[0]
    return out


def _pair_table(table: np.ndarray) -> np.ndarray:
    """For a 256-entry float32 table: the 65536 pairs ``(table[c0], table[c1])`` as one
    uint64 each, indexed by the uint16 that reads the bytes ``c0, c1`` in memory, so
    that one lookup decodes two codes (numpy's ``take`` costs per index, not per byte).
    """
    word = np.arange(1 << 16)
    first, second = (word & 255, word >> 8) if np.little_endian else (word >> 8, word & 255)
    pairs = np.stack([table[first], table[second]], axis=1).astype(np.float32)
    out: np.ndarray = pairs.view(np.uint64).reshape(-1)
    out.flags.writeable = False
    return out


_DYNAMIC8_PAIRS = _pair_table(_DYNAMIC8_TABLE)


def _lookup8(codes: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = _DYNAMIC8_TABLE[codes[i]]`` (float32), two codes per lookup."""
    even = codes.size & ~1
    if even:
        # uint16 indices into 2**16 entries: "clip" never clips; it skips the bounds check.
        pairs = codes[:even].view(np.uint16)
        np.take(_DYNAMIC8_PAIRS, pairs, out=out[:even].view(np.uint64), mode="clip")
    if even < codes.size:
        out[even] = _DYNAMIC8_TABLE[codes[even]]


def _scale_blocks(values: np.ndarray, scales: np.ndarray, first: int, block: int) -> None:
    """Multiply a slab of dequantized levels starting at block ``first`` by the block
    scales, in place: the float32 products every decoder computes."""
    m = values.size
    full = m // block
    if full:
        values[: full * block].reshape(full, block)[...] *= scales[first : first + full, None]
    if m % block:
        values[full * block :] *= scales[first + full]


def _quantize(
    x: np.ndarray,
    block: int,
    code: NearestLevel,
    codes: np.ndarray | None,
    values: np.ndarray | None = None,
) -> np.ndarray:
    """Quantize float32 ``x`` blockwise; return the per-block signed scales
    (little-endian float32).

    Args:
        x: the flat float32 input.
        block: elements per block.
        code: the levels.
        codes: if given, a uint8 array of ``x.size`` that receives the level indices.
        values: if given, a float32 array of ``x.size`` that receives the dequantized
            values the decoder computes: each level times its block's scale, the same
            float32 lookups and products as :func:`_decode_levels` (codes of at most
            8 bits, unpacked).

    Raises:
        CodecError: ``x`` holds NaN or Inf (or values beyond float32 range).
    """
    if code is _DYNAMIC8 and native is not None and takes(x):
        # Each block's scale, then its codes, in one pass (the same operations as below)
        scales = np.empty(-(-x.size // block), np.float32)
        if not native.quantize8(x, block, code.lut, _DYNAMIC8_TABLE, codes, values, scales):
            raise CodecError(_NOT_FINITE)
        return scales.astype("<f4")
    with np.errstate(invalid="ignore"):
        scales = _block_scales(x, block)
    if not np.isfinite(scales).all():
        raise CodecError(_NOT_FINITE)
    # Blocks of zeros, or so tiny that 1/scale overflows, encode as zeros.
    with np.errstate(divide="ignore", over="ignore"):
        inverse = np.where(np.abs(scales) >= _F32_TINY, np.float32(1) / scales, np.float32(0))
    inverse = inverse.astype(np.float32)
    n = x.size
    rows = max(1, SLAB // block)
    step = rows * block
    if step % 2 and step < n:
        step *= 2  # slabs start on even elements: two codes per lookup in _lookup8
    scratch = np.empty(min(step, n), np.float32)
    for start in range(0, n, step):
        stop = min(start + step, n)
        first = start // block
        m = stop - start
        v = scratch[:m]
        full = m // block
        if full:
            np.multiply(
                x[start : start + full * block].reshape(full, block),
                inverse[first : first + full, None],
                out=v[: full * block].reshape(full, block),
            )
        if m % block:
            tail = slice(start + full * block, stop)
            np.multiply(x[tail], inverse[first + full], out=v[full * block :])
        if codes is not None:
            code.encode_into(v, codes[start:stop])
            if values is not None:
                _lookup8(codes[start:stop], values[start:stop])
        elif values is not None:
            code.levels_into(v, values[start:stop])
        if values is not None:
            _scale_blocks(values[start:stop], scales, first, block)
    return scales.astype("<f4")


def _decode_levels(
    codes: np.ndarray,
    table: np.ndarray,
    scales: np.ndarray,
    block: int,
    n: int,
    into: np.ndarray | None = None,
) -> np.ndarray:
    """Look up level values and multiply each block by its scale, slab by slab.

    ``table`` maps a code (one row per byte value) to 1 value, or to 2 for packed 4-bit
    codes, so ``codes`` holds ``n`` or ``ceil(n/2)`` bytes. The dynamic 8-bit table is
    looked up two codes at a time (same values). ``into``, if given, is the contiguous
    float32 array of ``n`` elements that receives the values (8-bit codes only).
    """
    per_code = 1 if table.ndim == 1 else table.shape[1]
    if table is _DYNAMIC8_TABLE and native is not None and (into is None or takes(into)):
        out = into if into is not None else np.empty(n, np.float32)
        native.dequantize8(codes, table, scales, block, out)
        return out
    if into is not None and per_code == 1:
        out = into
    else:
        out = np.empty(codes.size * per_code, np.float32)
    step = max(1, SLAB // block) * block * per_code  # whole blocks and whole bytes per slab
    if step % 2 and step < n:
        step *= 2  # even slab starts for two codes per lookup
    pairs = table is _DYNAMIC8_TABLE
    for start in range(0, n, step):
        stop = min(start + step, n)
        values = out[start : start + -(-(stop - start) // per_code) * per_code]
        slab_codes = codes[start // per_code : -(-stop // per_code)]
        if pairs:
            _lookup8(slab_codes, values)
        else:
            np.take(
                table,
                slab_codes,
                axis=0,
                out=values.reshape(-1, per_code) if per_code > 1 else values,
                mode="clip",  # byte codes index 256 rows: never clips, no bounds check
            )
        _scale_blocks(values[: stop - start], scales, start // block, block)
    return out[:n]


def _read_scales(header: Header, payload: Buffer, offset: int, count: int) -> np.ndarray:
    scales = np.frombuffer(payload, dtype="<f4", count=count, offset=offset).astype(np.float32)
    if not np.isfinite(scales).all():
        raise CodecError(f"{header.codec}: block scales must be finite")
    return scales


class Blockwise8BitCodec(Codec):
    """Blockwise scaling with the dynamic 8-bit code; ~1.001 bytes per value."""

    name = "uint8-blockwise"
    decodes_finite = True  # levels in [-1, 1] times finite scales; restore() checks 16-bit
    decodes_into_cleanly = True  # _parse checks the size and the scales first

    def __init__(self, block: int = 4096) -> None:
        if not 1 <= block <= 1 << 24:
            raise ValueError("block must be in [1, 2**24]")
        self.block = block

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, header = self._input(array)
        x = as_float32(flat)
        codes = np.empty(x.size, np.uint8)
        scales = _quantize(x, self.block, _DYNAMIC8, codes)
        return Encoded(header, b"".join((codes.data, scales.data)))

    def encode_payload_and_values(
        self, array: np.ndarray, info: CodecInfo
    ) -> tuple[Encoded, np.ndarray]:
        """The codes and, slab by slab while they are in cache, their dequantized values
        (the same float32 lookups and products as the decoder; no payload parsing)."""
        flat, header = self._input(array)
        x = as_float32(flat)
        codes = np.empty(x.size, np.uint8)
        values = np.empty(x.size, np.float32)
        scales = _quantize(x, self.block, _DYNAMIC8, codes, values)
        return Encoded(header, b"".join((codes.data, scales.data))), restore(values, header)

    def round_trip(self, array: np.ndarray, info: CodecInfo) -> np.ndarray:
        """The dequantized values without the codes: one lookup from the scaled value's
        bits straight to its level (``levels[lut]``), then the block scale."""
        flat, header = self._input(array)
        x = as_float32(flat)
        values = np.empty(x.size, np.float32)
        _quantize(x, self.block, _DYNAMIC8, None, values)
        return restore(values, header)

    def _input(self, array: np.ndarray) -> tuple[np.ndarray, Header]:
        flat, dtype = as_input(array, floating_only=True)
        meta = {"block": self.block, "map": "dynamic8"}
        return flat, Header(self.name, dtype, tuple(np.shape(array)), meta)

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        codes, scales, block = self._parse(header, payload)
        return restore(_decode_levels(codes, _DYNAMIC8_TABLE, scales, block, codes.size), header)

    def decode_payload_into(self, header: Header, payload: Buffer, out: np.ndarray) -> None:
        if header.dtype != np.float32:
            super().decode_payload_into(header, payload, out)
            return
        check_output(header, out)
        codes, scales, block = self._parse(header, payload)
        _decode_levels(codes, _DYNAMIC8_TABLE, scales, block, codes.size, out.reshape(-1))

    def _parse(self, header: Header, payload: Buffer) -> tuple[np.ndarray, np.ndarray, int]:
        """The codes, the checked scales and the block size of a payload."""
        n = header.size
        block = meta_int(header, "block", 1, 1 << 24)
        if header.meta.get("map") != "dynamic8":
            raise CodecError(f"{header.codec}: unknown code map {header.meta.get('map')!r}")
        nblocks = -(-n // block)
        check_payload_size(header, payload, n + 4 * nblocks)
        codes = np.frombuffer(payload, dtype=np.uint8, count=n)
        return codes, _read_scales(header, payload, n, nblocks), block


class Blockwise4BitCodec(Codec):
    """Blockwise scaling with the 4-bit NormalFloat code, two codes per byte;
    ~0.56 bytes per value with the default block of 64."""

    name = "uint4-blockwise"
    decodes_finite = True  # levels in [-1, 1] times finite scales; restore() checks 16-bit

    def __init__(self, block: int = 64) -> None:
        if not 1 <= block <= 1 << 24:
            raise ValueError("block must be in [1, 2**24]")
        self.block = block

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        x = as_float32(flat)
        codes = np.empty(x.size, np.uint8)
        scales = _quantize(x, self.block, _NF4, codes)
        if codes.size % 2:
            codes = np.concatenate([codes, np.zeros(1, np.uint8)])
        pairs = codes.view("<u2")  # little-endian: element 2i in the low byte
        packed = ((pairs << 4) | (pairs >> 8)).astype(np.uint8)
        meta = {"block": self.block, "map": "nf4"}
        header = Header(self.name, dtype, tuple(np.shape(array)), meta)
        return Encoded(header, b"".join((packed.data, scales.data)))

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        n = header.size
        block = meta_int(header, "block", 1, 1 << 24)
        if header.meta.get("map") != "nf4":
            raise CodecError(f"{header.codec}: unknown code map {header.meta.get('map')!r}")
        nbytes = -(-n // 2)
        nblocks = -(-n // block)
        check_payload_size(header, payload, nbytes + 4 * nblocks)
        packed = np.frombuffer(payload, dtype=np.uint8, count=nbytes)
        scales = _read_scales(header, payload, nbytes, nblocks)
        return restore(_decode_levels(packed, _NF4_PAIRS, scales, block, n), header)
