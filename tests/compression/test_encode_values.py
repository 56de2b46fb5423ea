"""``encode_payload_and_values`` and ``round_trip`` agree bit for bit with encoding then
decoding, for every codec, every input dtype and every awkward value (zeros, subnormals,
values beyond the 16-bit ranges, huge and tiny magnitudes, empty and 1-element arrays),
and they update codec state (top-k error feedback) exactly as ``encode_payload`` does."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmavg.compression import Codec, CodecError, CodecInfo, get_codec
from swarmavg.compression.base import Encoded
from tests.compression.helpers import ALL_CODECS, FLOAT_DTYPES, dtype_id

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INFO = CodecInfo(key="w", part_index=1, part_size=100)
FAST = ["float16", "bfloat16", "uint8-blockwise", "uint8-blockwise:block=7"]
"""Codecs with their own overrides (plus a block that does not divide slabs)."""


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    """Same dtype, same shape, same bits."""
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert np.array_equal(_bits(a), _bits(b))


def assert_same_encoding(a: Encoded, b: Encoded) -> None:
    assert a.header == b.header
    assert bytes(memoryview(a.payload).cast("B")) == bytes(memoryview(b.payload).cast("B"))


def reference(codec: Codec, x: np.ndarray, info: CodecInfo = INFO) -> tuple[Encoded, np.ndarray]:
    encoded = codec.encode_payload(x, info)
    return encoded, codec.decode_payload(encoded.header, encoded.payload)


def check_all_paths(name: str, x: np.ndarray) -> None:
    """The three paths (each on a fresh codec) give the same encoding, values, error;
    decoding into a given array gives the same values."""
    try:
        want_enc, want = reference(get_codec(name), x)
    except CodecError:
        with pytest.raises(CodecError):
            get_codec(name).encode_payload_and_values(x, INFO)
        with pytest.raises(CodecError):
            get_codec(name).round_trip(x, INFO)
        return
    enc, values = get_codec(name).encode_payload_and_values(x, INFO)
    assert_same_encoding(enc, want_enc)
    assert_same(values, want)
    assert_same(get_codec(name).round_trip(x, INFO), want)
    into = np.full(want.size, 7, want.dtype)  # not zeros: every element must be written
    get_codec(name).decode_payload_into(want_enc.header, want_enc.payload, into)
    assert_same(into.reshape(want.shape), want)


def awkward(dtype: Any) -> np.ndarray:
    """Zeros of both signs, subnormals of every width, the 16-bit limits and beyond,
    rounding ties, huge and tiny magnitudes, representable in ``dtype``."""
    f16 = np.finfo(np.float16)
    values = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        float(f16.smallest_subnormal),
        float(f16.smallest_subnormal) / 2,  # a tie with 0
        float(f16.smallest_subnormal) * 1.5,  # a tie between subnormals
        float(f16.smallest_normal),
        float(f16.smallest_normal) * (1 - 2**-11),
        65504.0,
        -65504.0,
        65519.0,  # rounds down to 65504
        65520.0,  # would round to Inf: saturates
        -70000.0,
        1e6,
        -3e38,
        3.4e38,
        1e-38,
        1e-45,
        -1e-40,
        2049.0,  # tie in binary16: 2048 or 2050
        2051.0,
        1 + 2**-11,
        1 + 3 * 2**-11,
        np.pi,
        -np.e,
        1e-8,
    ]
    with np.errstate(over="ignore"):
        x = np.array(values, np.float64).astype(dtype)
    return x[np.isfinite(x.astype(np.float64))]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", ALL_CODECS)
def test_awkward_values_every_codec(name: str, dtype: Any) -> None:
    x = awkward(dtype)
    check_all_paths(name, x)
    check_all_paths(name, x[::-1].copy().reshape(1, -1))
    check_all_paths(name, np.tile(x, 300)[:7001])  # several blocks and a short one
    for v in x:
        check_all_paths(name, np.array([v], dtype))  # one element


@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (1,), (5, 1, 2)])
def test_shapes_every_codec(name: str, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    check_all_paths(name, np.asarray(x))


@pytest.mark.parametrize("name", ALL_CODECS)
def test_chunk_sized_normal_every_codec(name: str) -> None:
    # A chunk as the all-reduce makes them: 256 K float32 values, plus a ragged one.
    x = np.random.default_rng(2).standard_normal(1 << 18).astype(np.float32)
    x[::1000] *= 1e5
    check_all_paths(name, x)
    check_all_paths(name, x[: (1 << 18) - 12345])


@pytest.mark.parametrize("name", ALL_CODECS)
def test_non_contiguous_and_big_endian_input(name: str) -> None:
    x = np.random.default_rng(3).standard_normal((64, 40)).astype(np.float32)
    check_all_paths(name, x[:, ::3])
    check_all_paths(name, x.astype(">f4"))


@pytest.mark.parametrize("name", ["none", *FAST, "scaled-float16", "topk"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_raises_on_every_path(name: str, bad: float) -> None:
    x = np.ones(5000, np.float32)
    x[4321] = bad
    check_all_paths(name, x)  # the reference raises, so every path must


def test_integer_input_through_none_and_rejected_by_lossy() -> None:
    x = np.arange(-50, 50, dtype=np.int32).reshape(10, 10)
    check_all_paths("none", x)
    check_all_paths("float16", x)
    check_all_paths("uint8-blockwise", x)


def test_exact_codec_values_are_the_input() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    enc, values = get_codec("none").encode_payload_and_values(x, INFO)
    assert np.shares_memory(values, x)
    assert_same(values, x)
    assert enc.header.shape == (3, 4)


@pytest.mark.parametrize("name", ["topk:fraction=0.05", "lz4+topk:fraction=0.1"])
def test_topk_feedback_updated_exactly_as_by_encode(name: str) -> None:
    rng = np.random.default_rng(4)
    steps = [rng.standard_normal(3000).astype(np.float32) for _ in range(4)]
    old, new, trip = get_codec(name), get_codec(name), get_codec(name)
    for i, x in enumerate(steps):
        info = CodecInfo(key="g", part_index=i % 2)
        want_enc, want = reference(old, x, info)
        enc, values = new.encode_payload_and_values(x, info)
        assert_same_encoding(enc, want_enc)
        assert_same(values, want)
        assert_same(trip.round_trip(x, info), want)


# ---- hypothesis: random values of every magnitude, every input dtype ----------------

any_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
shapes = hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=70)
arrays32 = hnp.arrays(np.float32, shapes, elements=any_f32)
arrays64 = hnp.arrays(np.float64, shapes, elements=st.floats(allow_nan=False, allow_infinity=False))
words16 = hnp.arrays(np.uint16, shapes, elements=st.integers(0, 0xFFFF))


@pytest.mark.parametrize("name", FAST)
@SETTINGS
@given(x=arrays32)
@example(x=np.zeros(1, np.float32))
@example(x=np.array([65520.0, -65520.0, 1e-45, -0.0], np.float32))
@example(x=np.full(5, 3.0e38, np.float32))
@example(x=np.empty(0, np.float32))
def test_float32_inputs(name: str, x: np.ndarray) -> None:
    check_all_paths(name, x)


@pytest.mark.parametrize("name", FAST)
@SETTINGS
@given(x=arrays64)
@example(x=np.array([1e300, -1e300, 5e-324, 65519.99], np.float64))
def test_float64_inputs(name: str, x: np.ndarray) -> None:
    check_all_paths(name, x)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=dtype_id)
@SETTINGS
@given(w=words16)
def test_16_bit_inputs_any_word(name: str, dtype: Any, w: np.ndarray) -> None:
    # Every bit pattern, Inf and NaN included (those must raise on every path).
    check_all_paths(name, w.view(dtype))


@pytest.mark.parametrize("name", FAST)
@SETTINGS
@given(
    scale=st.sampled_from([1e-44, 1e-38, 1e-20, 2.0**-24, 1e-3, 1.0, 6e4, 1e6, 1e30, 3e38]),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 9000),
)
def test_random_magnitudes(name: str, scale: float, seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        x = (rng.standard_normal(n) * scale).astype(np.float32)
    x = np.nan_to_num(x, posinf=3e38, neginf=-3e38)
    check_all_paths(name, x)


@pytest.mark.parametrize("name", ["uint8-blockwise", "uint8-blockwise:block=7", "float16"])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_decode_from_unaligned_payload(name: str, offset: int) -> None:
    # Decoders read payloads at any offset of a reply (two codes per lookup included).
    x = np.random.default_rng(5).standard_normal(70001).astype(np.float32)
    codec = get_codec(name)
    enc, want = reference(codec, x)
    raw = bytes(memoryview(enc.payload).cast("B"))
    buffer = memoryview(bytes(offset) + raw)[offset:]
    assert_same(codec.decode_payload(enc.header, buffer), want)
    assert_same(codec.decode_payload(enc.header, bytearray(raw)), want)
    into = np.empty(want.size, want.dtype)
    codec.decode_payload_into(enc.header, buffer, into)
    assert_same(into, want)


def test_pair_table_matches_the_level_table() -> None:
    from swarmavg.compression import blockwise

    codes = np.arange(256, dtype=np.uint8)
    every_pair = np.stack(np.meshgrid(codes, codes), axis=-1).reshape(-1)
    out = np.empty(every_pair.size, np.float32)
    blockwise._lookup8(every_pair, out)
    assert_same(out, blockwise._DYNAMIC8_TABLE[every_pair])
    blockwise._lookup8(every_pair[:-1], out[:-1])  # odd count: the last code alone
    assert_same(out[:-1], blockwise._DYNAMIC8_TABLE[every_pair[:-1]])


def test_values_lut_is_levels_of_codes() -> None:
    from swarmavg.compression.blockwise import _DYNAMIC8

    assert_same(_DYNAMIC8.values_lut, _DYNAMIC8.levels[_DYNAMIC8.lut])


def _boundaries() -> np.ndarray:
    """Every finite binary16 value, every midpoint between neighbours (the ties) and
    the float32 values just either side of each midpoint, both signs."""
    words = np.arange(0x7C00, dtype=np.uint16)  # +0 .. 65504
    h = words.view(np.float16).astype(np.float32)
    mid = (h[:-1].astype(np.float64) + h[1:]) / 2
    mid32 = mid.astype(np.float32)  # exact: a binary16 midpoint has 12 significant bits
    below = np.nextafter(mid32, np.float32(0))
    above = np.nextafter(mid32, np.float32(np.inf))
    beyond = np.array([65519.996, 65520.0, 65536.0, 1e6, 3.4e38], np.float32)
    tiny = np.array([1e-45, 2.0**-25, 2.0**-26, 1e-30], np.float32)
    x = np.concatenate([h, mid32, below, above, beyond, tiny])
    return np.concatenate([x, -x])


def test_float16_kernels_match_numpy_on_every_boundary() -> None:
    from swarmavg.compression import halfconv

    x = _boundaries()
    want = np.clip(x, -65504, 65504).astype(np.float16)  # saturate, then numpy's rounding
    words = halfconv.float_to_half_words(x)
    assert np.array_equal(words, want.view(np.uint16))
    words2, values = halfconv.float_to_half_words_and_values(x)
    assert np.array_equal(words2, words)
    assert_same(values, want.astype(np.float32))
    assert_same(halfconv.round_to_half(x), want.astype(np.float32))


def test_float16_decoder_on_every_word() -> None:
    from swarmavg.compression import halfconv

    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    special = (words & 0x7C00) == 0x7C00
    finite = words[~special]
    assert_same(
        halfconv.half_words_to(finite, np.dtype(np.float32)),
        finite.view(np.float16).astype(np.float32),
    )
    little = finite.astype("<u2")[1:]  # a little-endian view at an odd element offset
    assert_same(
        halfconv.half_words_to(little, np.dtype(np.float32)),
        finite[1:].view(np.float16).astype(np.float32),
    )
    for w in words[special][::97]:
        with pytest.raises(CodecError):
            halfconv.half_words_to(np.array([0, w, 0], np.uint16), np.dtype(np.float32))


@pytest.mark.parametrize(
    "x",
    [
        np.array([0.0, 4.4525857e-30], np.float32),  # squares underflowed float32 to 0
        np.array([[1.1754944e-38] + [0.0] * 14], np.float32),  # std below float32's tiny
        np.array([1e-20, -3e-20, 2e-20, 0.0], np.float32),
        np.zeros((3, 100), np.float32),
    ],
)
def test_scaled_float16_rows_of_tiny_values(x: np.ndarray) -> None:
    codec = get_codec("scaled-float16")
    y = codec.decode(codec.encode(x))
    spread = float(np.abs(x - x.mean()).max())
    # binary16 keeps 11 bits of each deviation; subnormal stds count as constant rows.
    assert np.all(np.abs(y.astype(np.float64) - x) <= spread * 2.0**-10 + 1e-37)
    check_all_paths("scaled-float16", x)


@pytest.mark.parametrize("name", ["none", "float16", "uint8-blockwise", "bfloat16"])
def test_decode_into_rejects_an_unfit_output(name: str) -> None:
    encoded = get_codec(name).encode_payload(np.ones(100, np.float32), INFO)
    codec = get_codec(name)
    for out in (
        np.empty(99, np.float32),
        np.empty(100, np.float64),
        np.empty(200, np.float32)[::2],
        np.frombuffer(bytes(400), np.float32),
    ):
        with pytest.raises(ValueError, match="output must be"):
            codec.decode_payload_into(encoded.header, encoded.payload, out)


@pytest.mark.parametrize("name", ["float16", "uint8-blockwise"])
def test_decode_into_rejects_a_bad_payload(name: str) -> None:
    codec = get_codec(name)
    encoded = codec.encode_payload(np.ones(100, np.float32), INFO)
    payload = bytes(memoryview(encoded.payload).cast("B"))
    out = np.empty(100, np.float32)
    with pytest.raises(CodecError, match="payload is"):
        codec.decode_payload_into(encoded.header, payload[:-1], out)
    if name == "float16":
        nan = bytearray(payload)
        nan[2 * 57 : 2 * 58] = np.array([0x7E00], "<u2").tobytes()
        with pytest.raises(CodecError, match="Inf or NaN"):
            codec.decode_payload_into(encoded.header, bytes(nan), out)
    else:
        inf_scale = payload[:-4] + np.array([np.inf], "<f4").tobytes()
        with pytest.raises(CodecError, match="finite"):
            codec.decode_payload_into(encoded.header, inf_scale, out)


@pytest.mark.parametrize("name", ["uint8-uniform", "uint8-quantile", "uint8-blockwise"])
def test_a_tensor_spanning_the_float32_range_round_trips(name: str) -> None:
    # uint8-uniform's bin centres then lie beyond float32: its codebook is clipped.
    x = np.array([3e38, -3e38, 1.0, -2e38, 2.5e38, 0.0] * 50, np.float32)
    codec = get_codec(name)
    out = codec.decode(codec.encode(x))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, x, rtol=0.05, atol=3e38 * 0.05)
