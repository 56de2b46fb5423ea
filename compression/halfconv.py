"""Conversions between float32/float64 and 16-bit float words, saturating and checked.

Encoders saturate finite values beyond the 16-bit range at the largest finite value
(instead of producing Inf) and reject NaN/Inf inputs. Decoders reject words whose
exponent is all ones (Inf/NaN), so a decoded tensor is always finite.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from swarmavg.compression.dtypes import BFLOAT16
from swarmavg.compression.errors import CodecError

__all__ = [
    "as_float32",
    "bf16_words_to",
    "float_to_bf16_words",
    "float_to_half_words",
    "half_words_to",
]

F16_MAX = 65504.0
BF16_MAX = (2.0 - 2.0**-7) * 2.0**127  # largest finite bfloat16
_F16_EXP = np.uint16(0x7C00)
_BF16_EXP = np.uint16(0x7F80)


def as_float32(flat: np.ndarray) -> np.ndarray:
    """View float32 input as is; convert other floating inputs (float64 may overflow to
    Inf, which the caller's statistics then catch)."""
    if flat.dtype == np.float32:
        return flat
    with np.errstate(over="ignore", invalid="ignore"):
        return flat.astype(np.float32)


def _has_special(words: np.ndarray, exp_mask: np.uint16) -> bool:
    """Whether any 16-bit float word is Inf or NaN (exponent bits all set)."""
    if words.size == 0:
        return False
    return bool(np.any((words & exp_mask) == exp_mask))


def _require_finite_source(flat: np.ndarray) -> None:
    if not np.isfinite(flat.astype(np.float32) if flat.dtype == BFLOAT16 else flat).all():
        raise CodecError("input contains NaN or Inf")


def float_to_half_words(flat: np.ndarray) -> np.ndarray:
    """Round a flat floating array to binary16 words, saturating at +/-65504.

    Raises:
        CodecError: the input contains NaN or Inf.
    """
    if flat.dtype == np.float16:
        words = flat.view(np.uint16)
        if _has_special(words, _F16_EXP):
            raise CodecError("input contains NaN or Inf")
        return words
    src = flat.astype(np.float32) if flat.dtype == BFLOAT16 else flat
    with np.errstate(over="ignore", invalid="ignore"):
        words = src.astype(np.float16).view(np.uint16)
    if _has_special(words, _F16_EXP):
        # Rare path: something overflowed or was never finite.
        _require_finite_source(src)
        with np.errstate(over="ignore", invalid="ignore"):
            words = np.clip(src, -F16_MAX, F16_MAX).astype(np.float16).view(np.uint16)
    return words


def half_words_to(words: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """Decode binary16 words into a new writable array of ``dtype``.

    Raises:
        CodecError: a word encodes Inf or NaN.
    """
    if _has_special(words, _F16_EXP):
        raise CodecError("float16 payload contains Inf or NaN")
    half = words.view(np.float16)
    if dtype == np.float16:
        return half.copy()
    if dtype == BFLOAT16:
        return half.astype(np.float32).astype(BFLOAT16)
    return half.astype(dtype)


def float_to_bf16_words(flat: np.ndarray) -> np.ndarray:
    """Round a flat floating array to bfloat16 words (nearest even), saturating.

    Raises:
        CodecError: the input contains NaN or Inf.
    """
    if flat.dtype == BFLOAT16:
        words = flat.view(np.uint16)
        if _has_special(words, _BF16_EXP):
            raise CodecError("input contains NaN or Inf")
        return words
    with np.errstate(over="ignore", invalid="ignore"):
        words = flat.astype(BFLOAT16).view(np.uint16)
    if _has_special(words, _BF16_EXP):
        _require_finite_source(flat)
        with np.errstate(over="ignore", invalid="ignore"):
            words = np.clip(flat, -BF16_MAX, BF16_MAX).astype(BFLOAT16).view(np.uint16)
    return words


def bf16_words_to(words: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """Decode bfloat16 words into a new writable array of ``dtype``.

    Raises:
        CodecError: a word encodes Inf or NaN.
    """
    if _has_special(words, _BF16_EXP):
        raise CodecError("bfloat16 payload contains Inf or NaN")
    if dtype == BFLOAT16:
        return words.copy().view(BFLOAT16)
    wide = np.left_shift(words.astype(np.uint32), 16).view(np.float32)
    if dtype == np.float32:
        return wide
    with np.errstate(over="ignore"):
        out = wide.astype(dtype)
    if dtype == np.float16 and _has_special(out.view(np.uint16), _F16_EXP):
        raise CodecError("bfloat16 payload holds values beyond the float16 range of the tensor")
    return out
