"""``topk``: send the largest-magnitude fraction of a tensor, with error feedback.

Payload (little-endian), for the k kept elements in increasing index order:

1. the gaps between consecutive kept indices minus one (the first counts from -1), as
   unsigned integers of ``meta["width"]`` bytes (1, 2 or 4: the smallest that fits, so
   at 1% density a gap costs 2 bytes instead of an 8-byte index);
2. the kept values as binary16 (saturating at +/-65504; the rounding error and any
   saturation go into the residual, so nothing is lost).

``meta["k"]`` is the count. Decoding gives a dense array with zeros elsewhere.

With error feedback (the default), the encoder adds the residual kept for
``(info.key, info.part_index)`` before selecting, and stores what it did not send. Keep
one codec instance per averaged tensor stream: the state lives in ``codec.feedback``.
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
    meta_int,
    restore,
)
from swarmavg.compression.errors import CodecError
from swarmavg.compression.feedback import ErrorFeedback
from swarmavg.compression.halfconv import as_float32, float_to_half_words, half_words_to
from swarmavg.compression.kernels import all_finite, sample

__all__ = ["TopKCodec"]

_WIDTHS = {1: "<u1", 2: "<u2", 4: "<u4"}


def _top_indices(acc: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the ``k`` largest magnitudes (ties broken deterministically).

    A full ``argpartition`` over millions of elements is slow; a threshold from a
    deterministic sample first narrows the candidates to a few times k, and the exact
    selection runs on those. If the sample misjudges and too few elements pass, the
    full selection runs instead, so the result never depends on the shortcut.
    """
    n = acc.size
    if k >= n:
        return np.arange(n)
    magnitude = np.abs(acc)
    candidates: np.ndarray | None = None
    if n >= 1 << 16 and k <= n // 8:
        probe = np.sort(sample(magnitude, 1 << 16))
        # Aim for ~2k candidates: the sample's (1 - 2k/n) quantile.
        cut = probe[max(0, int(probe.size * (1 - 2 * k / n)) - 1)]
        picked = np.flatnonzero(magnitude >= cut)
        if picked.size >= k:
            candidates = picked
    if candidates is None:
        idx = np.argpartition(magnitude, n - k)[n - k :]
    else:
        top = np.argpartition(magnitude[candidates], candidates.size - k)[candidates.size - k :]
        idx = candidates[top]
    idx.sort()
    return idx


class TopKCodec(Codec):
    """Top-k sparsification with fp16 values, delta-coded indices and error feedback."""

    name = "topk"

    def __init__(
        self,
        fraction: float = 0.01,
        feedback: ErrorFeedback | None = None,
        *,
        error_feedback: bool = True,
    ) -> None:
        """Args:
        fraction: share of elements sent per encode, in (0, 1]; at least one is sent.
        feedback: the residual store to use (shared or restored from a checkpoint);
            a new one when None.
        error_feedback: False disables residuals altogether (plain top-k).
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError("fraction must be in (0, 1]")
        self.fraction = fraction
        self.feedback: ErrorFeedback | None = (
            (feedback if feedback is not None else ErrorFeedback()) if error_feedback else None
        )

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        flat, dtype = as_input(array, floating_only=True)
        x = as_float32(flat)
        # A checked float64 input may still overflow float32, so only float32 skips.
        if not (info.finite and flat.dtype == np.float32) and not all_finite(x):
            raise CodecError("input contains NaN or Inf (or values beyond float32 range)")
        n = x.size
        key = (info.key, info.part_index)
        residual = self.feedback.take(key, n) if self.feedback is not None else None
        acc = x + residual if residual is not None else x.copy()
        k = min(n, max(1, math.ceil(self.fraction * n))) if n else 0
        idx = _top_indices(acc, k)
        words = float_to_half_words(acc[idx])
        if self.feedback is not None:
            acc[idx] -= half_words_to(words, np.dtype(np.float32))
            self.feedback.put(key, acc)
        gaps = np.diff(idx, prepend=-1) - 1
        top = int(gaps.max()) if k else 0
        width = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
        payload = b"".join((gaps.astype(_WIDTHS[width]).tobytes(), words.astype("<u2").tobytes()))
        header = Header(self.name, dtype, tuple(np.shape(array)), {"k": k, "width": width})
        return Encoded(header, payload)

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        n = header.size
        k = meta_int(header, "k", 0, n)
        width = meta_int(header, "width", 1, 4)
        if width not in _WIDTHS:
            raise CodecError(f"{header.codec}: index width must be 1, 2 or 4 bytes, got {width}")
        check_payload_size(header, payload, k * (width + 2))
        gaps = np.frombuffer(payload, dtype=_WIDTHS[width], count=k)
        words = np.frombuffer(payload, dtype="<u2", count=k, offset=k * width)
        idx = np.cumsum(gaps, dtype=np.int64)
        idx += np.arange(k, dtype=np.int64)  # each gap is (distance - 1)
        if k and idx[-1] >= n:
            raise CodecError(f"{header.codec}: index {int(idx[-1])} out of range for {n} elements")
        out = np.zeros(n, np.float32)
        out[idx] = half_words_to(words, np.dtype(np.float32))
        return restore(out, header)
