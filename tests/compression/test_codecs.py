"""Codec round trips: error bounds per codec and dtype, shapes, determinism, threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from swarmavg.compression import CodecError, CodecInfo, decode_chunk, get_codec
from swarmavg.compression.blockwise import dynamic8_levels, nf4_levels
from tests.compression.helpers import ALL_CODECS, FLOAT_DTYPES, LOSSY, dtype_id, normal, rel_mse

BF16 = np.dtype(ml_dtypes.bfloat16)

# Relative MSE on N(0, 1) (float32 input); hivemind's tests accept 8e-4 for its 8-bit codecs.
REL_MSE_BOUND = {
    "none": 0.0,
    "float16": 1e-7,
    "bfloat16": 6e-6,
    "scaled-float16": 1e-7,
    "uint8-uniform": 3e-4,
    "uint8-quantile": 3e-4,
    "uint8-blockwise": 3e-4,
    "uint4-blockwise": 1.2e-2,
}
# Output rounding added by a narrow original dtype (relative).
DTYPE_EPS = {np.dtype(np.float32): 0.0, np.dtype(np.float64): 0.0}
DTYPE_EPS[np.dtype(np.float16)] = 2.0**-11
DTYPE_EPS[BF16] = 2.0**-8


def _roundtrip(name: str, x: np.ndarray) -> np.ndarray:
    codec = get_codec(name)
    y = decode_chunk(codec.encode(x, CodecInfo(key="t")))
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    assert y.flags.writeable
    return y


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", sorted(REL_MSE_BOUND))
def test_relative_mse_bound(name: str, dtype: type) -> None:
    x = normal(1 << 16, dtype)
    y = _roundtrip(name, x)
    # A narrow input dtype adds its own rounding on the way back.
    bound = REL_MSE_BOUND[name] + 2 * DTYPE_EPS[np.dtype(dtype)] ** 2
    assert rel_mse(x, y) <= bound


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_float16_elementwise_bound(dtype: type) -> None:
    scales = (10.0 ** np.arange(-6, 4)).repeat(1000)
    x = (normal(10000, np.float64) * scales).astype(dtype)
    y = _roundtrip("float16", x).astype(np.float64)
    x64 = x.astype(np.float64)
    # Half an ulp of binary16 relative, or half its smallest subnormal absolute.
    assert np.all(np.abs(y - x64) <= np.maximum(np.abs(x64) * 2.0**-11, 2.0**-25) * 1.0001)


def test_float16_saturates_instead_of_overflowing() -> None:
    x = np.array([1e6, -1e30, 65519.0, 3.0], np.float32)
    assert _roundtrip("float16", x).tolist() == [65504.0, -65504.0, 65504.0, 3.0]
    assert _roundtrip("float16", np.array([1e300])).tolist() == [65504.0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
def test_bfloat16_is_round_to_nearest_even(dtype: type) -> None:
    x = normal(5000, dtype) * 1e3
    y = _roundtrip("bfloat16", x)
    expected = x.astype(np.float32).astype(BF16).astype(dtype)  # ml_dtypes rounds RNE
    assert np.array_equal(y, expected)
    # Exactly half-way between two bf16 values: ties go to the even mantissa.
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    assert _roundtrip("bfloat16", ties).tolist() == [1.0, 1 + 2**-6]


def test_blockwise_elementwise_bounds() -> None:
    x = normal(3 * 4096 + 100) * np.repeat([1e-3, 1.0, 1e3, 7.0], 4096)[: 3 * 4096 + 100]
    for name, block, levels in [
        ("uint8-blockwise", 4096, dynamic8_levels()),
        ("uint4-blockwise", 64, nf4_levels()),
    ]:
        y = _roundtrip(name, x)
        half_gap = float(np.max(np.diff(levels))) / 2
        pad = (-x.size) % block
        absmax = np.abs(np.concatenate([x, np.zeros(pad, np.float32)])).reshape(-1, block)
        # Nearest level, except that the lookup table may pick the other neighbour for
        # values within 2**-11 (relative) of a midpoint.
        bound = np.repeat(absmax.max(axis=1), block)[: x.size] * half_gap + np.abs(x) * 2.0**-10
        assert np.all(np.abs(y - x) <= bound * 1.0001 + 1e-12), name
        # The largest magnitude of each block is reproduced exactly (level 1.0).
        i = np.abs(x[:4096]).argmax()
        assert y[i] == pytest.approx(x[i], rel=1e-6)


def test_quantile_and_blockwise_beat_uniform_on_heavy_tails() -> None:
    x = np.random.default_rng(1).standard_t(3, 1 << 18).astype(np.float32)
    uniform = rel_mse(x, _roundtrip("uint8-uniform", x))
    assert rel_mse(x, _roundtrip("uint8-quantile", x)) < uniform / 2
    assert rel_mse(x, _roundtrip("uint8-blockwise", x)) < uniform / 10


def test_topk_keeps_the_largest_values_in_fp16() -> None:
    x = normal(1000)
    codec = get_codec("topk:fraction=0.1")
    y = decode_chunk(codec.encode(x, CodecInfo(key="w")))
    kept = np.flatnonzero(y)
    assert kept.size == 100
    assert set(kept) == set(np.argsort(-np.abs(x))[:100])
    assert np.array_equal(y[kept], x[kept].astype(np.float16).astype(np.float32))
    full = decode_chunk(get_codec("topk:fraction=1.0").encode(x))
    assert np.array_equal(full, x.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "shape", [(), (0,), (1,), (3, 0), (1, 1, 1), (2, 3, 5), (70, 129)], ids=str
)
def test_shapes_and_dtypes_survive(name: str, dtype: type, shape: tuple[int, ...]) -> None:
    x = np.asarray(np.random.default_rng(2).standard_normal(shape)).astype(dtype)
    y = _roundtrip(name, x)
    if x.size and "topk" not in name:
        assert np.allclose(y.astype(np.float64), x.astype(np.float64), atol=0.5, rtol=0.2)


@pytest.mark.parametrize("name", ALL_CODECS)
def test_non_contiguous_input(name: str) -> None:
    base = normal(200 * 300).reshape(200, 300)
    for x in (base[::3, ::2], base.T, base[:, 7]):
        assert not x.flags.c_contiguous
        y = _roundtrip(name, x)
        expected = decode_chunk(get_codec(name).encode(np.ascontiguousarray(x)))
        assert np.array_equal(y, expected)


@pytest.mark.parametrize("name", ALL_CODECS)
def test_integers_pass_through_none_and_are_rejected_by_lossy_codecs(name: str) -> None:
    x = np.arange(-50, 50, dtype=np.int32)
    codec = get_codec(name)
    if name in ("none", "size-adaptive", "role-adaptive"):
        msg = codec.encode(x)
        assert msg.codec == "none"
        assert np.array_equal(decode_chunk(msg), x)
    else:
        with pytest.raises(CodecError, match="integers travel through codec 'none'"):
            codec.encode(x)


WIRE_DTYPES = [*FLOAT_DTYPES, np.int8, np.uint8, np.int32, np.int64]


def _full_range(dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(0)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (257, 3)], ids=str)
def test_none_round_trips_every_wire_dtype_exactly(dtype: type, shape: tuple[int, ...]) -> None:
    x = _full_range(dtype, shape)
    y = decode_chunk(get_codec("none").encode(x))
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    assert y.flags.writeable
    assert x.tobytes() == y.tobytes()


def test_none_takes_non_contiguous_and_big_endian_input() -> None:
    x = _full_range(np.float64, (40, 30))[::3, ::2]
    assert np.array_equal(decode_chunk(get_codec("none").encode(x)), x)
    be = np.arange(10, dtype=">i4")
    y = decode_chunk(get_codec("none").encode(be))
    assert y.dtype == np.int32  # decoded in native byte order
    assert np.array_equal(y, be)


@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_rejected(name: str, bad: float) -> None:
    x = normal(5000)
    x[1234] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", [*ALL_CODECS, "topk:fraction=0.3"])
def test_encoding_is_deterministic_and_thread_safe(name: str) -> None:
    xs = [normal(20000, seed=s) * (s + 1) for s in range(8)]

    def run(x: np.ndarray) -> tuple[bytes, bytes, bytes]:
        # A fresh codec per call: top-k's error feedback would otherwise (rightly)
        # change the second encoding of the same key.
        msg = get_codec(name).encode(x, CodecInfo(key="k"))
        return msg.buffer, msg.meta, decode_chunk(msg).tobytes()

    sequential = [run(x) for x in xs]
    assert sequential == [run(x) for x in xs]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, xs * 3)) == sequential * 3


def test_shared_codec_instance_is_thread_safe() -> None:
    codec = get_codec("uint8-blockwise")
    xs = [normal(50000, seed=s) for s in range(16)]
    expected = [codec.encode(x).buffer for x in xs]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda x: codec.encode(x).buffer, xs)) == expected


def test_wire_bytes_per_element() -> None:
    x = normal(1 << 16)
    size = {name: len(get_codec(name).encode(x).buffer) / x.size for name in LOSSY}
    assert size["float16"] == size["bfloat16"] == 2.0
    assert 2.0 < size["scaled-float16"] < 2.001
    assert size["uint8-uniform"] == size["uint8-quantile"] == 1.0
    assert 1.0 < size["uint8-blockwise"] < 1.002
    assert 0.5 < size["uint4-blockwise"] < 0.57
    assert size["topk"] <= 0.01 * 4 + 1e-3  # fp16 value + <= 2-byte gap per kept element


def test_lossless_wrappers_shrink_sparse_payloads() -> None:
    x = normal(1 << 16)
    x[np.random.default_rng(0).random(x.size) < 0.9] = 0.0
    plain = get_codec("uint8-blockwise").encode(x)
    for wrapped in ("zstd+uint8-blockwise", "lz4+uint8-blockwise"):
        msg = get_codec(wrapped).encode(x)
        assert msg.codec == wrapped
        assert len(msg.buffer) < len(plain.buffer) / 2
        assert np.array_equal(decode_chunk(msg), decode_chunk(plain))


def test_codec_parameters_travel_in_the_message() -> None:
    x = normal(10000)
    msg = get_codec("uint8-blockwise:block=256").encode(x)
    assert msg.codec == "uint8-blockwise"
    # Any decoder instance decodes it: the block size comes from the message.
    assert np.array_equal(get_codec("uint8-blockwise").decode(msg), decode_chunk(msg))
    assert rel_mse(x, decode_chunk(msg)) < rel_mse(x, _roundtrip("uint8-blockwise", x))
    with pytest.raises(ValueError, match="does not take parameters"):
        get_codec("float16:block=3")
    with pytest.raises(ValueError, match="bad codec parameter"):
        get_codec("topk:0.5")
    with pytest.raises(ValueError, match="fraction must be in"):
        get_codec("topk:fraction=2")


@pytest.mark.parametrize("block", [1, 3, 64, 100, 5000])
@pytest.mark.parametrize("n", [1, 7, 64, 129, 100_001])
def test_blockwise_odd_blocks_and_sizes(block: int, n: int) -> None:
    x = normal(n, seed=n)
    for name in ("uint8-blockwise", "uint4-blockwise"):
        y = decode_chunk(get_codec(f"{name}:block={block}").encode(x))
        # Per-block scaling: a wrong block boundary would blow the error up.
        tolerance = 0.01 if name == "uint8-blockwise" else 0.2
        assert np.all(np.abs(y - x) <= tolerance * np.abs(x).max() + 1e-7), (name, block, n)


def test_codec_refuses_another_codecs_message() -> None:
    msg = get_codec("float16").encode(normal(10))
    with pytest.raises(CodecError, match="codec 'bfloat16' cannot decode a 'float16' message"):
        get_codec("bfloat16").decode(msg)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hundred_million_elements() -> None:
    """A 100M-element tensor through the quantile codec (approximate statistics) and the
    blockwise codec, without protobuf copies (encode_payload/decode_payload)."""
    x = np.random.default_rng(5).standard_normal(100_000_000, dtype=np.float32)
    for name in ("uint8-quantile", "uint8-blockwise"):
        codec = get_codec(name)
        enc = codec.encode_payload(x, CodecInfo())
        y = codec.decode_payload(enc.header, enc.payload)
        assert y.shape == x.shape
        assert rel_mse(x[::97], y[::97]) < 3e-4, name
        del enc, y
