"""Hypothesis: round trips within bounds for arbitrary arrays; corrupted messages never
crash a decoder with anything but CodecError, and never yield non-finite values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmavg.compression import CodecError, CodecInfo, decode_chunk, get_codec
from swarmavg.compression.blockwise import dynamic8_levels, nf4_levels
from swarmavg.proto import tensor_pb2
from tests.compression.helpers import ALL_CODECS

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite32 = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)
arrays32 = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40),
    elements=finite32,
)

# Per-element bound |y - x| <= a * |x| + b * scale + c, where scale is the tensor's
# largest magnitude (which bounds each block's): loose enough for every input, tight
# enough to catch a wrong code or a misplaced block.
BOUNDS = {
    "none": (0.0, 0.0),
    "float16": (2.0**-11, 0.0),
    "bfloat16": (2.0**-8, 0.0),
    "scaled-float16": (2.0**-10, 2.0**-9),
    "uint8-blockwise": (2.0**-10, float(np.diff(dynamic8_levels()).max()) / 2),
    "uint4-blockwise": (2.0**-10, float(np.diff(nf4_levels()).max()) / 2),
}


@pytest.mark.parametrize("name", sorted(BOUNDS))
@SETTINGS
@given(x=arrays32)
def test_round_trip_error_is_bounded(name: str, x: np.ndarray) -> None:
    y = decode_chunk(get_codec(name).encode(x))
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    a, b = BOUNDS[name]
    scale = float(np.abs(x).max()) if x.size else 0.0
    if name == "scaled-float16" and x.size:
        scale = 2 * scale  # |x - mean| <= 2 max|x|
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    c = 2.0**-25 if name == "float16" else 1e-30  # half the smallest binary16 subnormal
    assert np.all(err <= a * np.abs(x.astype(np.float64)) + b * scale + c)


@pytest.mark.parametrize("name", ["uint8-uniform", "uint8-quantile", "topk:fraction=0.5"])
@SETTINGS
@given(x=arrays32)
@example(x=np.array([0.0, 1.1754944e-38], np.float32))  # a spread whose 1/width overflowed
def test_codebook_and_sparse_codecs_stay_in_range(name: str, x: np.ndarray) -> None:
    y = decode_chunk(get_codec(name).encode(x))
    assert y.shape == x.shape
    assert np.isfinite(y).all()
    if x.size:
        # Codebook values are means of input values, top-k values are fp16-rounded
        # inputs: never (beyond rounding) outside the input's range.
        lo, hi = float(x.min()), float(x.max())
        slack = 2.0**-10 * max(abs(lo), abs(hi)) + 1e-6
        assert float(y.min()) >= min(lo, 0.0) - slack
        assert float(y.max()) <= max(hi, 0.0) + slack


def _mutate(msg: tensor_pb2.TensorChunk, data: st.DataObject) -> tensor_pb2.TensorChunk:
    out = tensor_pb2.TensorChunk()
    out.CopyFrom(msg)
    kind = data.draw(st.sampled_from(["buffer", "meta", "shape", "codec", "dtype", "flip"]))
    if kind == "buffer":
        cut = data.draw(st.integers(0, len(out.buffer)))
        extra = data.draw(st.binary(max_size=8))
        out.buffer = out.buffer[:cut] + extra
        out.total_bytes = len(out.buffer)
    elif kind == "meta":
        out.meta = data.draw(st.binary(max_size=64))
    elif kind == "shape":
        del out.shape[:]
        out.shape.extend(data.draw(st.lists(st.integers(-3, 1 << 20), max_size=4)))
    elif kind == "codec":
        out.codec = data.draw(st.sampled_from([*ALL_CODECS, "zstd+none", "x", "topk+"]))
    elif kind == "dtype":
        out.dtype = data.draw(st.integers(0, 12))  # type: ignore[assignment]
    elif out.buffer:
        raw = bytearray(out.buffer)
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
        out.buffer = bytes(raw)
    return out


@pytest.mark.parametrize("name", [*ALL_CODECS, "zstd+uint8-quantile", "lz4+float16"])
@SETTINGS
@given(data=st.data())
def test_corrupted_messages_fail_cleanly(name: str, data: st.DataObject) -> None:
    x = np.random.default_rng(0).standard_normal(300).astype(np.float32)
    msg = _mutate(get_codec(name).encode(x, CodecInfo(key="k")), data)
    try:
        y = decode_chunk(msg, max_elements=1 << 22)
    except CodecError:
        return
    assert y.shape == tuple(msg.shape)
    if y.dtype.kind == "f":
        assert np.isfinite(y.astype(np.float64)).all()
