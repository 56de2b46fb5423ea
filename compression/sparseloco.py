"""``sparseloco``: chunked top-k with 2-bit values and error feedback (SparseLoCo, 2025).

Meant for DiLoCo's pseudo-gradients (``DiLoCo(codec="sparseloco")``). SparseLoCo sends,
per chunk of 4096 elements, the top-k entries of an error-feedback accumulator quantised
to 2 bits, and replaces DiLoCo's outer Nesterov momentum by that accumulator: pair it
with a plain SGD outer step (:func:`swarmavg.averaging.training.diloco.sgd_outer_optimizer`,
lr 1, no momentum). With ``decay`` < 1 the accumulator is SparseLoCo's decayed one
(``e = decay * e + delta``); the default 1 is classic error feedback (every coordinate is
eventually sent in full).

A message is one of two kinds, named by ``meta["mode"]``:

``"topk2"``, what a member sends (its own tensor). The input plus ``decay`` times the
residual kept for ``(info.key, info.part_index)`` is cut into blocks of ``meta["block"]``
elements; each block keeps its ``k = ceil(fraction * len)`` largest magnitudes (at least
one). A kept value becomes its sign and one magnitude bit: above or below the block's
median kept magnitude, decoded as the mean magnitude of its half (two levels per block,
the least-squares choice for that split). What was not sent, quantisation error
included, is the new residual. Payload, little-endian: the blocks' levels as float32
pairs ``(low, high)``; the kept indices, block-local, as uint16 (uint8 for blocks of at
most 256); the 2-bit codes (bit 0: sign, bit 1: high), four per byte, in index order.
``meta["k"]`` is k for a whole block, ``meta["k_last"]`` for the shorter last one.

``"union"``, what a reducer returns (``info.reduced``). The weighted mean of G members'
sparse vectors is up to G times denser and its values are no longer 2-bit levels.
Re-sparsifying it would drop part of the agreed update (or need a residual on the
reducer, which depends on who reduces what in a given round); it is encoded instead
without dropping anything: every nonzero, as topk does it (gap-coded indices of 1, 2 or
4 bytes) with binary16 values scaled by the chunk's largest magnitude (``meta["scale"]``,
float32). The only loss is that half-precision rounding (relative 2**-11), the same on
every member because all of them, the reducer included, use the decoded values. So the
outer step is, to binary16 precision, the mean of what the members sent, as in
SparseLoCo's all-gather.
"""

from __future__ import annotations

import math

import numpy as np

from swarmavg.compression.base import (
    Buffer,
    Codec,
    CodecInfo,
    Encoded,
    Header,
    as_input,
    check_payload_size,
    meta_float,
    meta_int,
    restore,
)
from swarmavg.compression.errors import CodecError
from swarmavg.compression.feedback import ErrorFeedback
from swarmavg.compression.halfconv import as_float32, float_to_half_words, half_words_to
from swarmavg.compression.kernels import all_finite

__all__ = ["SparseLoCoCodec"]

_GAP_WIDTHS = {1: "<u1", 2: "<u2", 4: "<u4"}
_MAX_BLOCK = 1 << 16
"""Block-local indices are uint16."""


def _block_k(length: int, fraction: float) -> int:
    return min(length, max(1, math.ceil(fraction * length))) if length else 0


def _index_dtype(block: int) -> str:
    return "<u1" if block <= 256 else "<u2"


def _select_rows(acc: np.ndarray, k: int) -> np.ndarray:
    """Per row of ``acc`` (blocks x block), the sorted indices of its k largest magnitudes."""
    width = acc.shape[1]
    if k >= width:
        return np.broadcast_to(np.arange(width), acc.shape).copy()
    idx = np.argpartition(np.abs(acc), width - k, axis=1)[:, width - k :]
    idx.sort(axis=1)
    return idx


def _two_levels(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: (low, high) levels and each value's magnitude bit.

    A magnitude at or above the row's upper median is "high"; each level is the mean
    magnitude of its half (0 for an empty low half: one kept value).
    """
    magnitude = np.abs(values)
    k = values.shape[1]
    split = np.partition(magnitude, k // 2, axis=1)[:, k // 2 : k // 2 + 1]
    high = magnitude >= split
    n_high = high.sum(axis=1)
    n_low = k - n_high
    sum_high = np.where(high, magnitude, 0.0).sum(axis=1, dtype=np.float64)
    sum_low = magnitude.sum(axis=1, dtype=np.float64) - sum_high
    hi = (sum_high / np.maximum(n_high, 1)).astype(np.float32)
    lo = np.where(n_low > 0, sum_low / np.maximum(n_low, 1), 0.0).astype(np.float32)
    return lo, hi, high


class SparseLoCoCodec(Codec):
    """Chunked top-k, 2-bit values, error feedback on the sender; dense-free replies."""

    name = "sparseloco"
    decodes_finite = True

    def __init__(
        self,
        fraction: float = 1 / 64,
        block: int = 4096,
        decay: float = 1.0,
        feedback: ErrorFeedback | None = None,
        *,
        error_feedback: bool = True,
    ) -> None:
        """Args:
        fraction: share of each block sent, in (0, 1] (SparseLoCo: 1-3%; default 1/64,
            64 of 4096); at least one element per block.
        block: elements per block, 1 to 65536.
        decay: the residual's weight when it is added to the next input, in [0, 1].
        feedback: the residual store (shared, or restored from a checkpoint); a new one
            when None.
        error_feedback: False keeps no residual (plain top-k of the input).
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError("fraction must be in (0, 1]")
        if not isinstance(block, int) or not 1 <= block <= _MAX_BLOCK:
            raise ValueError(f"block must be an integer in [1, {_MAX_BLOCK}]")
        if not 0.0 <= decay <= 1.0:
            raise ValueError("decay must be in [0, 1]")
        self.fraction = float(fraction)
        self.block = block
        self.decay = float(decay)
        self.feedback: ErrorFeedback | None = (
            (feedback if feedback is not None else ErrorFeedback()) if error_feedback else None
        )

    # ---------------------------------------------------------------- encoding

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        x = as_float32(flat)
        if not (info.finite and flat.dtype == np.float32) and not all_finite(x):
            raise CodecError("input contains NaN or Inf (or values beyond float32 range)")
        shape = tuple(np.shape(array))
        if info.reduced:
            return self._encode_union(x, dtype, shape)
        return self._encode_topk2(x, dtype, shape, (info.key, info.part_index))

    def _encode_topk2(
        self, x: np.ndarray, dtype: np.dtype, shape: tuple[int, ...], key: tuple[str, int]
    ) -> Encoded:
        n, block = x.size, self.block
        residual = self.feedback.take(key, n) if self.feedback is not None else None
        if residual is None:
            acc = x.copy()
        else:
            acc = x + residual if self.decay == 1.0 else x + np.float32(self.decay) * residual
        full, tail = divmod(n, block)
        k, k_last = _block_k(block, self.fraction), _block_k(tail, self.fraction)
        levels, indices, codes = [], [], []
        sent = np.zeros(n, np.float32)
        for start, rows, width, kk in (
            (0, full, block, k),
            (full * block, 1 if tail else 0, tail, k_last),
        ):
            if rows == 0 or kk == 0:
                continue
            part = acc[start : start + rows * width].reshape(rows, width)
            idx = _select_rows(part, kk)
            kept = np.take_along_axis(part, idx, axis=1)
            lo, hi, high = _two_levels(kept)
            negative = kept < 0
            magnitude = np.where(high, hi[:, None], lo[:, None])
            decoded = np.where(negative, -magnitude, magnitude).astype(np.float32)
            flat_idx = idx + (start + width * np.arange(rows))[:, None]
            sent[flat_idx.reshape(-1)] = decoded.reshape(-1)
            levels.append(np.stack([lo, hi], axis=1).reshape(-1))
            indices.append(idx.reshape(-1))
            codes.append((negative.astype(np.uint8) | (high.astype(np.uint8) << 1)).reshape(-1))
        if self.feedback is not None:
            acc -= sent
            self.feedback.put(key, acc)
        all_codes = np.concatenate(codes) if codes else np.zeros(0, np.uint8)
        payload = b"".join(
            (
                (np.concatenate(levels) if levels else np.zeros(0)).astype("<f4").tobytes(),
                (np.concatenate(indices) if indices else np.zeros(0))
                .astype(_index_dtype(block))
                .tobytes(),
                _pack2(all_codes).tobytes(),
            )
        )
        meta = {"mode": "topk2", "block": block, "k": k, "k_last": k_last}
        return Encoded(Header(self.name, dtype, shape, meta), payload)

    def _encode_union(self, x: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> Encoded:
        idx = np.flatnonzero(x)
        values = x[idx]
        scale = float(np.abs(values).max()) if idx.size else 0.0
        words = (
            float_to_half_words(values / np.float32(scale)) if idx.size else np.zeros(0, np.uint16)
        )
        gaps = np.diff(idx, prepend=-1) - 1
        top = int(gaps.max()) if idx.size else 0
        width = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
        payload = gaps.astype(_GAP_WIDTHS[width]).tobytes() + words.astype("<u2").tobytes()
        meta = {"mode": "union", "count": int(idx.size), "width": width, "scale": scale}
        return Encoded(Header(self.name, dtype, shape, meta), payload)

    # ---------------------------------------------------------------- decoding

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        mode = header.meta.get("mode")
        if mode == "topk2":
            out = self._decode_topk2(header, payload)
        elif mode == "union":
            out = self._decode_union(header, payload)
        else:
            raise CodecError(f"{header.codec}: meta['mode'] must be 'topk2' or 'union'")
        return restore(out, header)

    def _decode_topk2(self, header: Header, payload: Buffer) -> np.ndarray:
        n = header.size
        block = meta_int(header, "block", 1, _MAX_BLOCK)
        full, tail = divmod(n, block)
        k = meta_int(header, "k", 0 if full == 0 else 1, block)
        k_last = meta_int(header, "k_last", 0 if tail == 0 else 1, tail)
        kept = full * k + k_last
        blocks = full + (1 if tail else 0)
        index_dtype = np.dtype(_index_dtype(block))
        levels_bytes = blocks * 2 * 4
        index_bytes = kept * index_dtype.itemsize
        check_payload_size(header, payload, levels_bytes + index_bytes + (kept + 3) // 4)
        levels = np.frombuffer(payload, "<f4", count=blocks * 2).astype(np.float32)
        if not all_finite(levels):
            raise CodecError(f"{header.codec}: levels contain NaN or Inf")
        local = np.frombuffer(payload, index_dtype, count=kept, offset=levels_bytes)
        packed = np.frombuffer(
            payload, np.uint8, count=(kept + 3) // 4, offset=levels_bytes + index_bytes
        )
        codes = _unpack2(packed, kept)
        widths = np.concatenate([np.full(full * k, block), np.full(k_last, tail)]).astype(np.int64)
        if kept and bool((local.astype(np.int64) >= widths).any()):
            raise CodecError(f"{header.codec}: a block-local index is out of range")
        row = np.concatenate([np.repeat(np.arange(full), k), np.full(k_last, full)]).astype(
            np.int64
        )
        level = levels.reshape(-1, 2)[row, codes >> 1]
        value = np.where(codes & 1, -level, level)
        out = np.zeros(n, np.float32)
        out[row * block + local] = value
        return out

    def _decode_union(self, header: Header, payload: Buffer) -> np.ndarray:
        n = header.size
        count = meta_int(header, "count", 0, n)
        width = meta_int(header, "width", 1, 4)
        if width not in _GAP_WIDTHS:
            raise CodecError(f"{header.codec}: index width must be 1, 2 or 4 bytes, got {width}")
        scale = meta_float(header, "scale")
        if not 0.0 <= scale <= float(np.finfo(np.float32).max):
            raise CodecError(f"{header.codec}: meta['scale'] must be a finite float32 >= 0")
        check_payload_size(header, payload, count * (width + 2))
        gaps = np.frombuffer(payload, _GAP_WIDTHS[width], count=count)
        words = np.frombuffer(payload, "<u2", count=count, offset=count * width)
        idx = np.cumsum(gaps, dtype=np.int64) + np.arange(count, dtype=np.int64)
        if count and idx[-1] >= n:
            raise CodecError(f"{header.codec}: index {int(idx[-1])} out of range for {n} elements")
        out = np.zeros(n, np.float32)
        out[idx] = half_words_to(words, np.dtype(np.float32)) * np.float32(scale)
        if not all_finite(out):
            raise CodecError(f"{header.codec}: values overflow float32")
        return out


def _pack2(codes: np.ndarray) -> np.ndarray:
    """Four 2-bit codes per byte, the first in the lowest bits."""
    padded = np.zeros((codes.size + 3) // 4 * 4, np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def _unpack2(packed: np.ndarray, count: int) -> np.ndarray:
    shifts = np.array([0, 2, 4, 6], np.uint8)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)[:count].astype(np.intp)
