"""The compiled kernels (compression/_native.c) give the same bits as the numpy kernels
they replace, on every input, and reject the same bad inputs.

Peers with and without the kernels average together, and every member must end
bit-identical, so "the same bits" is the whole contract. Each test runs a codec twice,
once as installed and once with the kernels switched off in the modules that use them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmavg.compression import Codec, CodecInfo, blockwise, floating, get_codec, halfconv, native
from swarmavg.compression.errors import CodecError
from swarmavg.compression.native import kernels

pytestmark = pytest.mark.skipif(kernels is None, reason="compiled kernels not built")

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
T = TypeVar("T")


def both(fn: Callable[[], T]) -> tuple[T, T]:
    """``fn()`` with the compiled kernels, then with the numpy kernels."""
    compiled = fn()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(halfconv, "native", None)
        m.setattr(blockwise, "native", None)
        m.setattr(floating, "native", None)
        reference = fn()
    return compiled, reference


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def assert_paths_match(codec: Codec, x: np.ndarray) -> None:
    """Every codec path gives the same bits with and without the compiled kernels, and
    the values paths agree with decoding the payload."""
    info = CodecInfo()
    enc = both(lambda: codec.encode_payload(x, info))
    assert bytes(enc[0].payload) == bytes(enc[1].payload)
    decoded = both(lambda: codec.decode_payload(enc[0].header, enc[0].payload))
    assert_same_bits(*decoded)
    assert_same_bits(*both(lambda: codec.round_trip(x, info)))
    ev = both(lambda: codec.encode_payload_and_values(x, info))
    assert bytes(ev[0][0].payload) == bytes(enc[1].payload)
    assert_same_bits(ev[0][1], ev[1][1])
    assert_same_bits(ev[0][1], decoded[1])


def test_ci_builds_the_kernels() -> None:
    # Guards against CI silently testing only the fallback (the build is optional).
    if os.environ.get("CI") == "true":
        assert kernels is not None


# --- float32 <-> binary16 ----------------------------------------------------------------


def _float32_sweep() -> np.ndarray:
    """Every 251st float32 bit pattern that is finite, plus the edges of binary16."""
    bits = np.arange(0, 1 << 32, 251, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    edges = np.array(
        [0.0, -0.0, 65504, 65519.996, 65520, -65520, 3.4e38, 2.0**-14, 2.0**-24, 2.0**-25,
         2.0**-25 * 1.0000001, 2.0**-26, 1e-45, -1e-45, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11],
        np.float32,
    )  # fmt: skip
    return np.concatenate([x[np.isfinite(x)], edges])


def test_half_encoders_match_numpy_on_a_sweep_of_float32() -> None:
    x = _float32_sweep()
    words = both(lambda: halfconv.float_to_half_words(x))
    assert_same_bits(*words)
    pairs = both(lambda: halfconv.float_to_half_words_and_values(x))
    assert_same_bits(pairs[0][0], pairs[1][0])
    assert_same_bits(pairs[0][1], pairs[1][1])
    assert_same_bits(pairs[0][0], words[0])
    assert_same_bits(*both(lambda: halfconv.round_to_half(x)))


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_kernels_take_buffers_at_any_offset(offset: int) -> None:
    # A payload's words start wherever its message header ends.
    assert kernels is not None
    raw = np.zeros(4 * 5000 + offset, np.uint8)
    words = raw[offset : offset + 2 * 5000].view(np.uint16)
    words[:] = np.arange(5000, dtype=np.uint16) % 0x7C00
    out = np.zeros(4 * 5000 + offset, np.uint8)[offset:].view(np.float32)
    if not kernels.any_alignment:
        with pytest.raises(ValueError, match="aligned"):
            kernels.f16_to_f32(words, out)
        return
    assert kernels.f16_to_f32(words, out)
    want = halfconv.half_words_to(words.copy(), np.dtype(np.float32))
    assert_same_bits(out.copy(), want)
    src = np.zeros(4 * 5000 + offset, np.uint8)[offset:].view(np.float32)
    src[:] = want * np.float32(3)
    into = np.zeros(2 * 5000 + offset, np.uint8)[offset:].view(np.uint16)
    assert kernels.f32_to_f16(src, into, None)
    assert_same_bits(into.copy(), halfconv.float_to_half_words(src.copy()))


def test_half_decoder_matches_numpy_on_every_finite_word() -> None:
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = words[(words & 0x7C00) != 0x7C00]
    assert_same_bits(*both(lambda: halfconv.half_words_to(finite, np.dtype(np.float32))))


@pytest.mark.parametrize("word", [0x7C00, 0xFC00, 0x7C01, 0xFFFF, 0x7E00])
def test_half_decoder_rejects_inf_and_nan_words(word: int) -> None:
    words = np.zeros(1000, np.uint16)
    words[777] = word
    with pytest.raises(CodecError, match="Inf or NaN"):
        halfconv.half_words_to(words, np.dtype(np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(
    "encode",
    [
        halfconv.float_to_half_words,
        halfconv.float_to_half_words_and_values,
        halfconv.round_to_half,
    ],
)
def test_half_encoders_reject_nan_and_inf(bad: float, encode: Callable[..., object]) -> None:
    x = np.ones(5000, np.float32)
    x[4321] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        encode(x)


finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@SETTINGS
@given(x=hnp.arrays(np.float32, st.integers(0, 3000), elements=finite32))
@example(x=np.array([], np.float32))
def test_float16_codec_matches_numpy(x: np.ndarray) -> None:
    assert_paths_match(get_codec("float16"), x)


# --- uint8-blockwise ---------------------------------------------------------------------


def _blocky(rng: np.random.Generator, n: int, block: int) -> np.ndarray:
    """Normal values whose blocks span 1e-40 (subnormal scales) to 1e30, with zero
    blocks, single outliers and both signs of largest element."""
    nblocks = -(-n // block)
    magnitude = rng.choice([0.0, 1e-40, 1e-20, 1e-3, 1.0, 1e3, 1e30], nblocks)
    x = (rng.standard_normal(n) * np.repeat(magnitude, block)[:n]).astype(np.float32)
    x[:: max(1, block // 3)] *= -7
    return x


SIZES_AND_BLOCKS = [(1, 1), (7, 3), (4096, 4096), (100_003, 4096), (65_537, 1), (10_000, 64),
                    (300_000, 1 << 17)]  # fmt: skip


@pytest.mark.parametrize(("n", "block"), SIZES_AND_BLOCKS)
def test_blockwise_codec_matches_numpy(n: int, block: int) -> None:
    x = _blocky(np.random.default_rng(n + block), n, block)
    assert_paths_match(blockwise.Blockwise8BitCodec(block), x)


@SETTINGS
@given(
    x=hnp.arrays(np.float32, st.integers(1, 2000), elements=finite32),
    block=st.sampled_from([1, 2, 5, 64, 4096]),
)
def test_blockwise_codec_matches_numpy_on_any_finite_input(x: np.ndarray, block: int) -> None:
    assert_paths_match(blockwise.Blockwise8BitCodec(block), x)


def test_blockwise_scale_of_a_block_of_zeros_is_positive_zero() -> None:
    x = np.concatenate([np.full(64, -0.0), np.zeros(64), np.array([0.0, -0.0] * 32)])
    x = x.astype(np.float32)
    enc = both(lambda: blockwise.Blockwise8BitCodec(64).encode_payload(x, CodecInfo()))
    for e in enc:
        scales = np.frombuffer(e.payload, "<f4", offset=x.size)
        np.testing.assert_array_equal(scales.view(np.uint32), 0)


def test_blockwise_scale_prefers_the_positive_element_on_a_tie() -> None:
    x = np.array([-3.0, 1.0, 3.0, -3.0, 2.0, -5.0], np.float32)
    enc = both(lambda: blockwise.Blockwise8BitCodec(3).encode_payload(x, CodecInfo()))
    for e in enc:
        np.testing.assert_array_equal(np.frombuffer(e.payload, "<f4", offset=6), [3.0, -5.0])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_blockwise_rejects_nan_and_inf(bad: float) -> None:
    x = np.ones(10_000, np.float32)
    x[9999] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        get_codec("uint8-blockwise").encode(x)


# --- the kernels' own argument checks -----------------------------------------------------


def test_kernels_reject_unfit_buffers() -> None:
    assert kernels is not None
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="length"):
        kernels.f32_to_f16(x, np.empty(9, np.uint16), None)
    with pytest.raises(ValueError, match="length"):
        kernels.f16_to_f32(np.zeros(10, np.uint16), np.empty(11, np.float32))
    with pytest.raises(ValueError, match="whole number"):
        kernels.f16_to_f32(np.zeros(3, np.uint8), np.empty(1, np.float32))
    lut, table = blockwise._DYNAMIC8.lut, blockwise._DYNAMIC8_TABLE
    one = np.ones(1, np.float32)
    with pytest.raises(ValueError, match="one item per block"):
        kernels.quantize8(x, 10, lut, table, None, None, np.ones(2, np.float32))
    with pytest.raises(ValueError, match="one item per block"):
        kernels.quantize8(x, 3, lut, table, None, None, np.empty(3, np.float32))
    with pytest.raises(ValueError, match="lut"):
        kernels.quantize8(x, 10, lut[:-1], table, None, None, one)
    with pytest.raises(ValueError, match="block"):
        kernels.quantize8(x, 0, lut, table, None, None, one)
    with pytest.raises(ValueError, match="length"):
        kernels.quantize8(x, 10, lut, table, np.empty(9, np.uint8), None, one)
    with pytest.raises(ValueError, match="out"):
        kernels.dequantize8(np.zeros(10, np.uint8), table, one, 10, np.empty(5, np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.f16_to_f32(np.zeros(10, np.uint16), np.empty(20, np.float32)[::2])
    read_only = np.frombuffer(bytes(40), np.float32)
    with pytest.raises(ValueError, match="read-only"):
        kernels.f16_to_f32(np.zeros(10, np.uint16), read_only)


# --- scaled-float16 --------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "shape", [(1 << 16,), (64, 1000), (3, 7, 129), (1, 1 << 18), (1 << 18, 1), (5, 0)]
)
def test_scaled_float16_same_bits(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape))
    n = int(np.prod(shape))
    x = (rng.standard_normal(n) * rng.choice([1e-30, 1e-3, 1.0, 1e4], n)).astype(np.float32)
    x[::97] = 0.0
    x[1::101] = -0.0
    assert_paths_match(get_codec("scaled-float16"), x.reshape(shape))


@SETTINGS
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 9), st.integers(1, 300)),
        elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True),
    )
)
def test_scaled_float16_same_bits_any_input(x: np.ndarray) -> None:
    assert_paths_match(get_codec("scaled-float16"), x)


# --- the finiteness scan and codec none's checked copy ----------------------------------


def _without_kernels(fn: Callable[[], T]) -> T:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "kernels", None)
        m.setattr(floating, "native", None)
        return fn()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, None])
@pytest.mark.parametrize("where", [0, 1, 4097, -1])
def test_the_finiteness_scan_matches_numpy(dtype: type, bad: float | None, where: int) -> None:
    from swarmavg.compression.kernels import all_finite

    x = np.random.default_rng(abs(where)).standard_normal(10_001).astype(dtype)
    x[7] = np.finfo(dtype).max  # huge but finite: the sum overflows, the scan must not care
    x[8] = np.finfo(dtype).max
    x[9] = -0.0
    x[10] = np.finfo(dtype).smallest_subnormal
    if bad is not None:
        x[where] = bad
    want = bad is None
    assert all_finite(x) is want
    assert _without_kernels(lambda: all_finite(x)) is want
    assert all_finite(x.reshape(73, 137)) is want  # any contiguous shape
    assert all_finite(x[1:]) is (want or where == 0)  # at an odd offset


def test_the_finiteness_scan_leaves_other_layouts_to_numpy() -> None:
    from swarmavg.compression.kernels import all_finite

    x = np.ones(1000, np.float32)
    x[3] = np.nan
    assert not all_finite(x[1::2])  # strided: numpy's path
    assert all_finite(x[::2][2:])
    assert not all_finite(x.astype(np.float16))
    assert all_finite(np.empty(0, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_codec_none_decodes_into_an_output_with_the_same_bits_on_both_paths(dtype: type) -> None:
    codec = get_codec("none")
    x = _float32_sweep().astype(dtype)[:50_000]
    x[:3] = [-0.0, np.finfo(dtype).smallest_subnormal, -np.finfo(dtype).max]
    encoded = codec.encode_payload(x, CodecInfo())
    payload = b"\x00" + bytes(memoryview(encoded.payload).cast("B"))  # at an odd offset
    view = memoryview(payload)[1:]
    outs = (np.full(x.size, 7, dtype), np.full(x.size, 7, dtype))
    codec.decode_payload_into(encoded.header, view, outs[0])
    _without_kernels(lambda: codec.decode_payload_into(encoded.header, view, outs[1]))
    assert_same_bits(outs[0], x)
    assert_same_bits(outs[1], x)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_codec_none_refuses_to_decode_nan_or_inf_into_an_output_on_both_paths(bad: float) -> None:
    codec = get_codec("none")
    x = np.ones(5000, np.float32)
    encoded = codec.encode_payload(x, CodecInfo())
    payload = bytearray(memoryview(encoded.payload).cast("B"))
    payload[4 * 4321 : 4 * 4322] = np.array([bad], "<f4").tobytes()
    out = np.empty(5000, np.float32)
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.decode_payload_into(encoded.header, bytes(payload), out)
    with pytest.raises(CodecError, match="NaN or Inf"):
        _without_kernels(lambda: codec.decode_payload_into(encoded.header, bytes(payload), out))


def test_the_checked_copy_applies_only_where_the_kernel_can_read_both_arrays() -> None:
    from swarmavg.compression.native import copy_finite

    x = np.arange(1000, dtype=np.float32)
    out = np.zeros_like(x)
    assert copy_finite(x, out) is True
    assert_same_bits(out, x)
    x[999] = np.inf
    assert copy_finite(x, out) is False
    assert out[999] == np.inf  # the whole copy, also when it reports a bad value
    untouched = np.full(1000, 7, np.float32)
    for src, dst in [
        (x.astype(np.float16), untouched.astype(np.float16)),  # no kernel for float16
        (np.arange(1000, dtype=np.int32), untouched.astype(np.int32)),
        (x, untouched.astype(np.float64)),  # dtypes differ
        (x.reshape(10, 100), untouched),  # shapes differ
        (x[::2], untouched[:500]),  # strided
        (x.astype(">f4"), untouched.astype(">f4")),  # not native
    ]:
        assert copy_finite(src, dst) is None
        assert (dst == 7).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_weighted_sum_matches_numpy_at_any_offset(dtype: type, offset: int) -> None:
    """The mean's pass over a chunk's copies (averaging/allreduce/reducer.py) rounds each
    product, each sum and the quotient as numpy does, in order, at any address, and
    reports NaN/Inf in what it wrote (a NaN or an Inf in any copy, an overflow)."""
    rng = np.random.default_rng(offset)
    n = 4099  # four blocks of the kernel and a tail
    t = np.dtype(dtype).type
    item = np.dtype(dtype).itemsize
    raw = np.zeros(n * item + offset, np.uint8)
    odd = raw[offset:].view(dtype)  # a payload at an odd offset of its message
    odd[:] = rng.standard_normal(n) * 1e3
    copies = [odd] + [rng.standard_normal(n).astype(dtype) * 10.0**i for i in range(5)]
    out = np.empty(n, dtype)
    for k in range(1, len(copies) + 1):
        for d in (0.0, 1.28, float(k)):
            weights = [float(t(w)) for w in rng.uniform(0.01, 1.0, k)]
            expected = copies[0] * t(weights[0])
            for x, w in zip(copies[1:k], weights[1:], strict=True):
                expected += x * t(w)
            if d:
                expected = expected / t(d)
            assert native.weighted_sum(copies[:k], weights, float(t(d)), out) is True
            assert_same_bits(out, expected)
    first = copies[1].copy()  # out may be one of the copies
    assert native.weighted_sum([first, copies[2]], [1.0, 0.25], 0.0, first) is True
    assert_same_bits(first, copies[1] + copies[2] * t(0.25))
    for bad in (np.nan, np.inf, -np.inf):
        for j in (0, 3):
            spoiled = [x.copy() for x in copies]
            spoiled[j][n // 2] = bad
            assert native.weighted_sum(spoiled, [1e-30] * len(spoiled), 1.0, out) is False
    huge = np.full(n, np.finfo(dtype).max, dtype)
    assert native.weighted_sum([huge, huge], [1.0, 1.0], 2.0, out) is False  # overflow
    with pytest.raises(ValueError, match="one length"):
        native.kernels.weighted_sum([odd, odd[:-1]], [1.0, 1.0], 0.0, item, out)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="one weight per copy"):
        native.kernels.weighted_sum([odd], [1.0, 1.0], 0.0, item, out)  # type: ignore[union-attr]
    if dtype == np.float64:  # float16 copies widen into float32 only
        assert native.weighted_sum([odd.astype(np.float16)], [1.0], 0.0, out) is None
    assert native.weighted_sum([odd.astype(np.int32)], [1.0], 0.0, out) is None
    assert native.weighted_sum([], [], 0.0, out) is None
    assert native.weighted_sum([odd, copies[1]], [1.0], 0.0, out) is None


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_weighted_sum_widens_float16_copies_as_decoding_them_first_would(offset: int) -> None:
    """float16 copies (codec float16's words as received) in the float32 mean: each word
    widened where it is added gives the bits of decoding every copy first, in any mix with
    float32 copies, at any address; an Inf/NaN word makes the result count as not finite
    (the kernel's exact widening is for finite words: it makes such a word a large finite
    value, so the word itself must be flagged)."""
    rng = np.random.default_rng(10 + offset)
    n = 4099
    raw = np.zeros(n * 2 + offset, np.uint8)
    odd = raw[offset:].view(np.float16)  # words at an odd offset of their message
    odd[:] = rng.standard_normal(n) * 100
    halves = [odd] + [(rng.standard_normal(n) * 10.0**i).astype(np.float16) for i in range(4)]
    floats = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    out = np.empty(n, np.float32)
    mixes = [halves[:1], halves, [floats[0], *halves[1:3]], [halves[0], floats[1], halves[2]]]
    mixes.append([floats[0], halves[1], floats[1], halves[3], floats[2]])
    for copies in mixes:
        weights = [float(np.float32(w)) for w in rng.uniform(0.01, 1.0, len(copies))]
        for d in (0.0, 1.28):
            decoded = [x.astype(np.float32) for x in copies]
            expected = decoded[0] * np.float32(weights[0])
            for x, w in zip(decoded[1:], weights[1:], strict=True):
                expected += x * np.float32(w)
            if d:
                expected = expected / np.float32(d)
            assert native.weighted_sum(copies, weights, d, out) is True
            assert_same_bits(out, expected)
    for word in (0x7C00, 0xFC00, 0x7E00, 0x7C01):  # +Inf, -Inf, NaNs
        for j in (0, 2):
            spoiled = [x.copy() for x in halves]
            spoiled[j].view(np.uint16)[n - 1] = word  # in the tail after the last block
            assert native.weighted_sum(spoiled, [1.0] * len(spoiled), 5.0, out) is False
    with pytest.raises(ValueError, match="halves"):
        native.kernels.weighted_sum([odd], [1.0], 0.0, 4, out, b"\x01\x01")  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="halves"):
        native.kernels.weighted_sum([odd], [1.0], 0.0, 8, out, b"\x01")  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("items_off", [0, 1, 3, 5])
@pytest.mark.parametrize("extra", [0, 1, 7])
def test_a_large_checked_copy_streams_the_same_bits_and_finds_every_bad_value(
    dtype: type, items_off: int, extra: int
) -> None:
    """Copies of 256 KiB and more stream their stores (_native.c, copy_streamed): the
    items before the destination's first 32-byte boundary and after its last go through
    the plain loop, the rest 32 bytes at a time. Every part of such a copy must move the
    bits unchanged and report NaN/Inf wherever it sits; the extreme finite values are not
    special. ``items_off`` shifts the destination off the boundary, ``extra`` gives a tail."""
    item = np.dtype(dtype).itemsize
    n = (256 << 10) // item + 40 + extra
    rng = np.random.default_rng(items_off * 10 + extra)
    src = rng.standard_normal(n).astype(dtype)
    info = np.finfo(dtype)
    src[:4] = [info.max, -info.max, info.tiny / 4, -0.0]
    raw = np.zeros(n * item + 64 + items_off * item, np.uint8)
    start = (-raw.ctypes.data) % 32 + items_off * item
    dst = raw[start : start + n * item].view(dtype)
    assert native.copy_finite(src, dst) is True
    assert_same_bits(dst, src)
    for where in (0, 1, 9, n // 2, n - 2, n - 1):  # the head, the streamed body, the tail
        for bad in (np.nan, np.inf, -np.inf):
            spoiled = src.copy()
            spoiled[where] = bad
            dst[...] = 0
            assert native.copy_finite(spoiled, dst) is False, (where, bad)
            assert_same_bits(dst, spoiled)


@pytest.mark.parametrize("special", [0x7C00, 0xFC00, 0x7E00])  # +Inf, -Inf, NaN
def test_half_words_checked_first_leave_out_untouched(special: int) -> None:
    """``check_first``: float16 replies are decoded over the caller's values in place, so a
    bad word must be found before anything is written (kernel and numpy path alike)."""
    words = halfconv.float_to_half_words(np.linspace(-3, 3, 70_000, dtype=np.float32)).copy()
    words[69_000] = special  # past the first slab (HALF_SLAB) of the numpy path

    def attempt() -> np.ndarray:
        out = np.full(words.size, 7.0, np.float32)
        with pytest.raises(CodecError, match="Inf or NaN"):
            halfconv.half_words_into(words, out, check_first=True)
        return out

    for out in both(attempt):
        assert (out == 7.0).all()
    words[69_000] = 0
    decoded = both(lambda: _decoded_into(words))
    assert_same_bits(*decoded)


def _decoded_into(words: np.ndarray) -> np.ndarray:
    out = np.empty(words.size, np.float32)
    halfconv.half_words_into(words, out, check_first=True)
    return out


def _at_offset(values: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``values`` ``offset`` bytes past an aligned address (a payload's floats)."""
    raw = np.zeros(values.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 32 + offset
    out = raw[start : start + values.nbytes].view(values.dtype)
    out[...] = values
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1003, 70_001])
@pytest.mark.parametrize("offset", [0, 1])
def test_the_part_checks_pass_gives_numpys_sums_and_copies(
    dtype: type, n: int, offset: int
) -> None:
    """The pass that copies an averaged chunk where it goes (_native.c, check_copy) gives
    the part check's sums with the same bits as kernels.check_sums, copies every value
    unchanged, keeps the old values in the backup when the destination is our own values
    (in place), and finds NaN/Inf wherever they sit."""
    from swarmavg.compression import kernels as numpy_kernels

    rng = np.random.default_rng(n + offset)
    own_values = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
    own_values[::5] = 0.0
    if n > 2:
        own_values[1] = -0.0
    result = _at_offset(own_values + rng.standard_normal(n).astype(dtype), offset)
    reference = numpy_kernels.check_sums(result, own_values)
    assert reference[4] == np.count_nonzero(own_values)

    sums = np.full(5, np.nan)
    out = np.zeros(n, dtype)
    assert native.check_copy(result, own_values, out, None, sums) is True
    assert_same_bits(sums, reference)
    assert_same_bits(out, result)

    in_place = _at_offset(own_values, offset)
    backup = np.zeros(n, dtype)
    assert native.check_copy(result, in_place, in_place, backup, sums) is True
    assert_same_bits(sums, reference)
    assert_same_bits(in_place, result)
    assert_same_bits(backup, own_values)

    assert native.check_copy(result, own_values, None, None, sums) is True  # sums alone
    assert_same_bits(sums, reference)
    for where in {0, n // 2, n - 1} if n else set():
        spoiled = result.copy()
        spoiled[where] = np.nan if where % 2 else np.inf
        assert native.check_copy(spoiled, own_values, out, None, sums) is False, where


def test_the_part_checks_pass_without_the_kernel_gives_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kernels.check_copy's numpy path: the kernel's sums, copies and backup, own values
    read before they are written over in place."""
    from swarmavg.compression import kernels as numpy_kernels

    rng = np.random.default_rng(5)
    own_values = rng.standard_normal(10_005).astype(np.float32)
    result = own_values * 1.5
    expected = np.empty(5)
    out = np.empty_like(result)
    assert native.check_copy(result, own_values, out, None, expected) is True
    monkeypatch.setattr(native, "kernels", None)
    in_place, backup = own_values.copy(), np.empty_like(own_values)
    finite, sums = numpy_kernels.check_copy(result, in_place, in_place, backup)
    assert finite
    assert_same_bits(sums, expected)
    assert_same_bits(in_place, result)
    assert_same_bits(backup, own_values)
    result[7] = np.inf
    assert numpy_kernels.check_copy(result, own_values)[0] is False


def test_the_part_checks_pass_applies_only_where_the_kernel_can_read_every_array() -> None:
    x = np.arange(100, dtype=np.float32)
    sums = np.zeros(5)
    for src, own, sums_ in [
        (x.astype(np.float16), x.astype(np.float16), sums),  # no kernel for float16
        (x, x.astype(np.float64), sums),  # dtypes differ
        (x[::2], x[:50], sums),  # strided
        (x, x, np.zeros(5, np.float32)),  # sums not float64
        (x, x, np.zeros(4)),  # not five sums
    ]:
        assert native.check_copy(src, own, None, None, sums_) is None
