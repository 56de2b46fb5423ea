"""Conversions between wide floats and 16-bit float words, saturating and checked.

numpy converts float32 <-> float16 one element at a time (no F16C on its cast path), at
a fraction of memory speed. The kernels here do the IEEE conversion with integer and
float32 operations on cache-sized slabs instead (F. Giesen, "Half to float done quic",
2012): bit-identical to numpy's round-to-nearest-even cast, several times faster.

Where the compiled kernels are built (:mod:`swarmavg.compression.native`), float32 and
binary16 arrays take them instead: the same operations in one pass, bit-identical.

Encoders saturate finite values beyond the 16-bit range at the largest finite value
(instead of producing Inf) and reject NaN/Inf inputs. Decoders reject words whose
exponent is all ones (Inf/NaN), so a decoded tensor is always finite.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from swarmavg.compression.dtypes import bfloat16, is_bfloat16
from swarmavg.compression.errors import CodecError
from swarmavg.compression.kernels import all_finite, slabs
from swarmavg.compression.native import kernels as native
from swarmavg.compression.native import takes

__all__ = [
    "HalfScratch",
    "as_float32",
    "bf16_words_to",
    "bf16_words_to_unchecked",
    "encode_half_slab",
    "float_to_bf16_words",
    "float_to_half_words",
    "float_to_half_words_and_values",
    "half_words_into",
    "half_words_to",
    "round_to_half",
]

F16_MAX = 65504.0
BF16_MAX = (2.0 - 2.0**-7) * 2.0**127  # largest finite bfloat16
_F16_EXP = np.uint16(0x7C00)
_BF16_EXP = np.uint16(0x7F80)
HALF_SLAB = 1 << 16
"""Elements per slab of the float16 kernels: uint32 temporaries of 256 KiB each. Each
numpy call costs about a microsecond, so slabs of 2**15 spent 10-15% more than these
on call overhead; 2**17 gained a few percent more, and at 2**18 (megabytes of scratch
per call) the value-producing paths turned 4x slower in one measurement."""
_BF16_SLAB = 1 << 17

_F32_EXP_MASK = np.uint32(0x7F800000)
_F32_SIGN = np.uint32(0x80000000)
_F16_MIN_NORMAL_AS_F32 = np.uint32(113 << 23)  # 2**-14
_THIRTEEN_BINADES = np.uint32(13 << 23)
_TWO_MINUS_112 = np.float32(2.0**-112)
_F16_OVERFLOW_AS_F32 = np.uint32(0x477FF000)  # 65520: rounds to Inf in binary16
_TWO_112 = np.float32(2.0**112)


def as_float32(flat: np.ndarray) -> np.ndarray:
    """View float32 input as is; convert other floating inputs (float64 may overflow to
    Inf, which the caller's statistics then catch)."""
    if flat.dtype == np.float32:
        return flat
    if flat.dtype == np.float16:
        return half_words_to(flat.view(np.uint16), np.dtype(np.float32))
    with np.errstate(over="ignore", invalid="ignore"):
        return flat.astype(np.float32)


_F16_FLOOR = np.full(HALF_SLAB, _F16_MIN_NORMAL_AS_F32, np.uint32)
_F16_FLOOR.flags.writeable = False
"""2**-14 (as bits) per element: numpy's ``maximum`` against an array measured about 3x
faster than against a scalar."""


def _round_magnitude(u: np.ndarray, a: np.ndarray, t: np.ndarray) -> bool:
    """Round the magnitudes of float32 bit patterns ``u`` to binary16 precision.

    Leaves in ``a`` (uint32, read as float32) ``|x|`` rounded to nearest even at
    binary16's precision, subnormals included; ``t`` is uint32 scratch of the same
    length. Returns False when a value overflows the binary16 range or is Inf/NaN
    (``a`` is then garbage). ``a`` may be the memory of ``u`` itself.

    Rounding is float32's own: adding ``M = 2**(max(e, -14) + 13)`` to ``|x|`` (exponent
    e) leaves exactly binary16's precision, so ``(|x| + M) - M`` is ``|x|`` rounded to
    nearest even.
    """
    np.bitwise_and(u, np.uint32(0x7FFFFFFF), out=a)
    if a.size and a.max() >= _F16_OVERFLOW_AS_F32:
        return False
    np.bitwise_and(a, _F32_EXP_MASK, out=t)
    np.maximum(t, _F16_FLOOR[: t.size], out=t)
    np.add(t, _THIRTEEN_BINADES, out=t)
    magnitude, magic = a.view(np.float32), t.view(np.float32)
    np.add(magnitude, magic, out=magnitude)
    np.subtract(magnitude, magic, out=magnitude)
    return True


def _magnitude_to_words(u: np.ndarray, a: np.ndarray, out: np.ndarray, t: np.ndarray) -> None:
    """Binary16 words from rounded magnitudes ``a`` (see :func:`_round_magnitude`) and
    the signs of the float32 bit patterns ``u``. ``a`` is overwritten; ``t`` is uint32
    scratch of the same length."""
    np.bitwise_and(u, _F32_SIGN, out=t)
    _signed_words(a, t, out)


def _signed_words(a: np.ndarray, sign: np.ndarray, out: np.ndarray) -> None:
    """Binary16 words from rounded magnitudes ``a`` and float32 sign bits ``sign``
    (``u & 0x80000000``); both are overwritten.

    Scaling the rounded magnitude by 2**-112 (exact) puts binary16's exponent and
    mantissa in float32 bits 13..27 (a binary16 subnormal becomes the float32 subnormal
    with the same bits).
    """
    np.multiply(a.view(np.float32), _TWO_MINUS_112, out=a.view(np.float32))
    np.right_shift(a, 13, out=a)
    np.right_shift(sign, 16, out=sign)
    np.bitwise_or(a, sign, out=out, casting="unsafe")


def _with_sign(u: np.ndarray, a: np.ndarray, out: np.ndarray, t: np.ndarray) -> None:
    """Float32 bits ``out`` = magnitude bits ``a`` with the sign bits of ``u`` (``-0.0``
    and values rounded to zero keep their sign, as their binary16 words do); leaves the
    sign bits in ``t``. Two integer passes: numpy's ``copysign`` measured about twice as
    slow. ``out`` may be ``a``."""
    np.bitwise_and(u, _F32_SIGN, out=t)
    np.bitwise_or(a, t, out=out)


def _f32_bits_to_half(u: np.ndarray, out: np.ndarray, a: np.ndarray, t: np.ndarray) -> bool:
    """Convert float32 bit patterns ``u`` to binary16 words in ``out``.

    ``a`` and ``t`` are uint32 scratch of the same length. Returns False when a value
    overflows the binary16 range or is Inf/NaN (``out`` is then garbage).
    """
    if not _round_magnitude(u, a, t):
        return False
    _magnitude_to_words(u, a, out, t)
    return True


class HalfScratch:
    """Scratch buffers for converting slabs of up to ``HALF_SLAB`` float32 values."""

    def __init__(self, size: int = HALF_SLAB) -> None:
        size = max(1, min(size, HALF_SLAB))
        self.a = np.empty(size, np.uint32)
        self.t = np.empty(size, np.uint32)
        self.wide = np.empty(size, np.float32)
        self.narrow = np.empty(size, np.float32)


_local = threading.local()


def _thread_scratch() -> HalfScratch:
    """This thread's full-size scratch, reused across calls (never shared between
    threads, so the kernels stay thread-safe).

    Fresh megabyte-sized temporaries on every call cost page faults whenever the
    allocator has handed the memory back to the OS in between, which glibc does for
    memory at the top of the heap: measured, that made a chunk's encode 2-3x slower.
    """
    scratch: HalfScratch | None = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = HalfScratch(HALF_SLAB)
        _local.scratch = scratch
    return scratch


def _round_slab(src: np.ndarray, a: np.ndarray, scratch: HalfScratch) -> np.ndarray:
    """Round up to ``HALF_SLAB`` float32 values to binary16 precision, saturating at
    +/-65504: leaves the rounded magnitudes in ``a`` (uint32 bits, which may be the
    memory of ``src``) and returns the float32 values whose bits and signs decide the
    words (``src``, or a clipped copy of it).

    Raises:
        CodecError: ``src`` contains NaN or Inf.
    """
    k = src.size
    t = scratch.t[:k]
    if _round_magnitude(src.view(np.uint32), a, t):
        return src
    if not np.isfinite(src).all():
        raise CodecError("input contains NaN or Inf")
    clipped = scratch.wide[:k]
    np.clip(src, -F16_MAX, F16_MAX, out=clipped)
    _round_magnitude(clipped.view(np.uint32), a, t)
    return clipped


def encode_half_slab(src: np.ndarray, out: np.ndarray, scratch: HalfScratch) -> None:
    """Round up to ``HALF_SLAB`` contiguous float32 values to binary16 words in ``out``,
    saturating at +/-65504. ``src`` is left unchanged.

    Raises:
        CodecError: ``src`` contains NaN or Inf.
    """
    k = src.size
    a = scratch.a[:k]
    signed = _round_slab(src, a, scratch)
    _magnitude_to_words(signed.view(np.uint32), a, out, scratch.t[:k])


def _narrow_slabs(flat: np.ndarray) -> Iterator[tuple[slice, np.ndarray]]:
    """``(slice, float32 values)`` per slab of a float32/float64/bfloat16 array; float64
    is clipped to +/-65504 first (a huge float64 is finite but overflows float32).

    Raises:
        CodecError: a float64 slab contains NaN or Inf.
    """
    n = flat.size
    narrow = _thread_scratch().narrow if flat.dtype != np.float32 else None
    for s in slabs(n, HALF_SLAB):
        src = flat[s]
        if narrow is not None:
            k = s.stop - s.start
            if src.dtype == np.float64:
                if not all_finite(src):
                    raise CodecError("input contains NaN or Inf")
                np.clip(src, -F16_MAX, F16_MAX, out=narrow[:k], casting="unsafe")
            else:
                narrow[:k] = src  # bfloat16 widens exactly
            src = narrow[:k]
        yield s, src


def _native_ok(*arrays: np.ndarray) -> bool:
    """The compiled kernels are in use here (``native``: tests switch them off) and take
    these arrays."""
    return native is not None and takes(*arrays)


def _native_encode(flat: np.ndarray, words: np.ndarray | None, values: np.ndarray | None) -> None:
    """The compiled :func:`float_to_half_words` / values of float32 ``flat``.

    Raises:
        CodecError: the input contains NaN or Inf.
    """
    assert native is not None
    if not native.f32_to_f16(flat, words, values):
        raise CodecError("input contains NaN or Inf")


def float_to_half_words(flat: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round a flat floating array to binary16 words, saturating at +/-65504.

    Args:
        flat: float32, float64, bfloat16 or float16 values.
        out: optional uint16 array of the same size to write into.

    Raises:
        CodecError: the input contains NaN or Inf.
    """
    n = flat.size
    if flat.dtype == np.float16:
        words = flat.view(np.uint16)
        if _has_special(words, _F16_EXP):
            raise CodecError("input contains NaN or Inf")
        if out is None:
            return words
        out[...] = words
        return out
    if out is None:
        out = np.empty(n, np.uint16)
    if flat.dtype == np.float32 and _native_ok(flat, out):
        _native_encode(flat, out, None)
        return out
    scratch = _thread_scratch()
    for s, src in _narrow_slabs(flat):
        encode_half_slab(src, out[s], scratch)
    return out


def float_to_half_words_and_values(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`float_to_half_words` and, in the same pass, the float32 values of those
    words (bit-identical to ``half_words_to(words, float32)``).

    Args:
        flat: float32, float64 or bfloat16 values.

    Raises:
        CodecError: the input contains NaN or Inf.
    """
    n = flat.size
    words = np.empty(n, np.uint16)
    values = np.empty(n, np.float32)
    if flat.dtype == np.float32 and _native_ok(flat):
        _native_encode(flat, words, values)
        return words, values
    scratch = _thread_scratch()
    for s, src in _narrow_slabs(flat):
        k = s.stop - s.start
        a = scratch.a[:k]
        u = _round_slab(src, a, scratch).view(np.uint32)
        t = scratch.t[:k]
        _with_sign(u, a, values[s].view(np.uint32), t)
        _signed_words(a, t, words[s])
    return words, values


def round_to_half(flat: np.ndarray) -> np.ndarray:
    """The float32 values of ``float_to_half_words(flat)``, without making the words
    (bit-identical to ``half_words_to(float_to_half_words(flat), float32)``).

    Args:
        flat: float32, float64 or bfloat16 values.

    Raises:
        CodecError: the input contains NaN or Inf.
    """
    n = flat.size
    values = np.empty(n, np.float32)
    if flat.dtype == np.float32 and _native_ok(flat):
        _native_encode(flat, None, values)
        return values
    bits = values.view(np.uint32)
    scratch = _thread_scratch()
    for s, src in _narrow_slabs(flat):
        a = bits[s]
        u = _round_slab(src, a, scratch).view(np.uint32)
        _with_sign(u, a, a, scratch.t[: a.size])
    return values


_F32_CLEAR_SIGN_EXTENSION = np.int32(-0x70000001)  # 0x8FFFFFFF: keeps bit 31 and 0..27


def _half_to_f32(h: np.ndarray, out: np.ndarray, b: np.ndarray) -> None:
    """Convert binary16 words ``h`` to float32 values in ``out``; ``b`` is uint32
    scratch of at least ``h.size`` elements.

    The word, sign-extended to 32 bits and shifted left by 13, holds the sign in bits
    28..31 and the magnitude in bits 13..27; clearing bits 28..30 leaves a float32 that
    is exactly 2**-112 times the value (subnormals included), so one multiply by 2**112
    rebiases the exponent and normalises subnormals at once. Four passes, two of them
    on 16-bit words.

    Raises:
        CodecError: a word encodes Inf or NaN.
    """
    signed = out.view(np.int32)
    np.left_shift(h.view(h.dtype.str.replace("u", "i")), 13, out=signed, dtype=np.int32)
    exponent = b.view(np.uint16)[: h.size]
    np.bitwise_and(h, _F16_EXP, out=exponent)
    if exponent.size and exponent.max() == _F16_EXP:
        raise CodecError("float16 payload contains Inf or NaN")
    np.bitwise_and(signed, _F32_CLEAR_SIGN_EXTENSION, out=signed)
    np.multiply(out, _TWO_112, out=out)


def half_words_to(words: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """Decode binary16 words into a new writable array of ``dtype``.

    Raises:
        CodecError: a word encodes Inf or NaN.
    """
    if dtype == np.float16:
        if _has_special(words, _F16_EXP):
            raise CodecError("float16 payload contains Inf or NaN")
        return words.view(np.float16).copy()
    n = words.size
    out = np.empty(n, dtype)
    if dtype == np.float32:
        half_words_into(words, out)
        return out
    scratch = _thread_scratch()
    wide = scratch.wide
    for s in slabs(n, HALF_SLAB):
        k = s.stop - s.start
        _half_to_f32(words[s], wide[:k], scratch.t[:k])
        out[s] = wide[:k]
    return out


def half_words_into(words: np.ndarray, out: np.ndarray, *, check_first: bool = False) -> None:
    """Decode binary16 words into the contiguous float32 array ``out`` of their length.

    ``check_first``: check every word before writing anything (a second read of the
    words, from the cache), so that ``out`` is untouched when this raises.

    Raises:
        CodecError: a word encodes Inf or NaN (``out`` then holds garbage, unless
            ``check_first``).
    """
    if native is not None and _native_ok(words, out):
        if not native.f16_to_f32(words, out, check_first):
            raise CodecError("float16 payload contains Inf or NaN")
        return
    if check_first and _has_special(words, _F16_EXP):
        raise CodecError("float16 payload contains Inf or NaN")
    b = _thread_scratch().t
    for s in slabs(words.size, HALF_SLAB):
        _half_to_f32(words[s], out[s], b[: s.stop - s.start])


def _has_special(words: np.ndarray, exp_mask: np.uint16) -> bool:
    """Whether any 16-bit float word is Inf or NaN (exponent bits all set)."""
    if words.size == 0:
        return False
    return bool(np.any((words & exp_mask) == exp_mask))


def float_to_bf16_words(flat: np.ndarray) -> np.ndarray:
    """Round a flat floating array to bfloat16 words (nearest even), saturating.

    Raises:
        CodecError: the input contains NaN or Inf.
    """
    if is_bfloat16(flat.dtype):
        words = flat.view(np.uint16)
        if _has_special(words, _BF16_EXP):
            raise CodecError("input contains NaN or Inf")
        return words
    n = flat.size
    out = np.empty(n, np.uint16)
    bf = out.view(bfloat16())
    for s in slabs(n, _BF16_SLAB):
        src = flat[s]
        with np.errstate(over="ignore", invalid="ignore"):
            bf[s] = src
        if _has_special(out[s], _BF16_EXP):
            if not np.isfinite(src).all():
                raise CodecError("input contains NaN or Inf")
            with np.errstate(over="ignore", invalid="ignore"):
                bf[s] = np.clip(src, -BF16_MAX, BF16_MAX)
    return out


def bf16_words_to(words: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """Decode bfloat16 words into a new writable array of ``dtype``.

    Raises:
        CodecError: a word encodes Inf or NaN.
    """
    if _has_special(words, _BF16_EXP):
        raise CodecError("bfloat16 payload contains Inf or NaN")
    return bf16_words_to_unchecked(words, dtype)


def bf16_words_to_unchecked(words: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """:func:`bf16_words_to` for words known to be finite (an encoder's own output):
    the same values, without the check for Inf/NaN words."""
    if is_bfloat16(dtype):
        return words.copy().view(dtype)
    n = words.size
    if dtype == np.float32:
        out = np.empty(n, np.float32)
        bits = out.view(np.uint32)
        for s in slabs(n, _BF16_SLAB):
            bits[s] = words[s]
            bits[s] <<= 16
        return out
    wide = bf16_words_to_unchecked(words, np.dtype(np.float32))
    if dtype == np.float16:
        # bfloat16 rounding can lift 65504 to 65536: saturate, as the encoder would.
        return float_to_half_words(wide).view(np.float16)
    return wide.astype(dtype)
