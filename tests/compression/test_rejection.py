"""Malformed messages: every decoder names the problem instead of returning garbage."""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import numpy as np
import pytest

from swarmavg.compression import CodecError, decode_chunk, get_codec
from swarmavg.proto import tensor_pb2
from tests.compression.helpers import normal

Msg = tensor_pb2.TensorChunk


def _msg(name: str, n: int = 5000) -> Msg:
    return get_codec(name).encode(normal(n))


def _with(msg: Msg, **fields: object) -> Msg:
    out = Msg()
    out.CopyFrom(msg)
    for k, v in fields.items():
        if k == "shape":
            del out.shape[:]
            out.shape.extend(v)  # type: ignore[call-overload]
        elif k == "meta_map":
            out.meta = msgpack.packb(v)
        else:
            setattr(out, k, v)
    if "buffer" in fields and "total_bytes" not in fields:
        out.total_bytes = len(out.buffer)
    return out


def _meta(msg: Msg) -> dict[str, object]:
    return msgpack.unpackb(msg.meta)  # type: ignore[no-any-return]


def _words(values: list[int]) -> bytes:
    return np.array(values, "<u2").tobytes()


CASES: dict[str, tuple[Callable[[], Msg], str]] = {
    "unknown codec": (lambda: _with(_msg("float16"), codec="float17"), "unknown codec 'float17'"),
    "empty codec": (lambda: _with(_msg("float16"), codec=""), "names no codec"),
    "truncated none": (
        lambda: _with(_msg("none"), buffer=_msg("none").buffer[:-1], total_bytes=19999),
        "payload is 19999 bytes but shape",
    ),
    "truncated float16": (
        lambda: _with(_msg("float16"), buffer=_msg("float16").buffer[:-2], total_bytes=0),
        "payload is 9998 bytes but shape",
    ),
    "shape mismatch": (lambda: _with(_msg("uint8-blockwise"), shape=[4999]), "payload is"),
    "total_bytes mismatch": (
        lambda: _with(_msg("float16"), total_bytes=12),
        "declares total_bytes=12 but carries 10000",
    ),
    "piece of a stream": (
        lambda: _with(_msg("float16"), seq=1, num_chunks=3),
        "chunk 1 of 3 of a stream",
    ),
    "absurd ndim": (lambda: _with(_msg("none", 1), shape=[1] * 40), "40 dimensions"),
    "absurd size": (lambda: _with(_msg("topk"), shape=[1 << 30, 1 << 30]), "more than"),
    "negative dim": (lambda: _with(_msg("none"), shape=[-5000]), "negative dimension"),
    "bad dtype": (lambda: _with(_msg("float16"), dtype=42), "unknown or unspecified dtype"),
    "meta not msgpack": (lambda: _with(_msg("uint8-quantile"), meta=b"\xc1"), "not valid msgpack"),
    "meta not a map": (
        lambda: _with(_msg("uint8-quantile"), meta=b"\x93\x01\x02\x03"),
        "must be a map",
    ),
    "meta too big": (lambda: _with(_msg("float16"), meta=b"\x00" * 70000), "more than 65536"),
    "short codebook": (
        lambda: _with(
            _msg("uint8-uniform"),
            meta_map={"codebook": np.zeros(255, "<f4").tobytes()},
        ),
        r"meta\['codebook'\] must hold 256 float32 values",
    ),
    "missing codebook": (lambda: _with(_msg("uint8-quantile"), meta=b""), "codebook"),
    "nan codebook": (
        lambda: _with(
            _msg("uint8-quantile"),
            meta_map={"codebook": np.full(256, np.nan, "<f4").tobytes()},
        ),
        "codebook contains NaN or Inf",
    ),
    "inf float16 word": (
        lambda: _with(_msg("float16", 3), buffer=_words([0x3C00, 0x7C00, 0])),
        "float16 payload contains Inf or NaN",
    ),
    "nan bfloat16 word": (
        lambda: _with(_msg("bfloat16", 3), buffer=_words([0x3F80, 0x7FC1, 0])),
        "bfloat16 payload contains Inf or NaN",
    ),
    "nan none": (
        lambda: _with(_msg("none", 2), buffer=np.array([1, np.nan], "<f4").tobytes()),
        "decoded tensor contains NaN or Inf",
    ),
    "nan block scale": (
        lambda: _with(
            _msg("uint8-blockwise", 10),
            buffer=_msg("uint8-blockwise", 10).buffer[:10] + np.array([np.nan], "<f4").tobytes(),
        ),
        "block scales must be finite",
    ),
    "inf block scale": (
        lambda: _with(
            _msg("uint4-blockwise", 10),
            buffer=_msg("uint4-blockwise", 10).buffer[:5] + np.array([-np.inf], "<f4").tobytes(),
        ),
        "block scales must be finite",
    ),
    "unknown code map": (
        lambda: _with(_msg("uint8-blockwise"), meta_map={"block": 4096, "map": "dynamic9"}),
        "unknown code map 'dynamic9'",
    ),
    "bad block size": (
        lambda: _with(_msg("uint8-blockwise"), meta_map={"block": 0, "map": "dynamic8"}),
        r"meta\['block'\] must be an integer",
    ),
    "huge scaled-float16 stats": (
        lambda: _with(
            _msg("scaled-float16", 4),
            buffer=_words([0x3C00] * 4) + np.array([0.0, 3e38], "<f4").tobytes(),
        ),
        "row statistics are negative, NaN, Inf or too large",
    ),
    "scaled-float16 bad row": (
        lambda: _with(_msg("scaled-float16", 10), meta_map={"row": 3}),
        "row length 3 does not divide 10",
    ),
    "topk index out of range": (
        lambda: _with(
            _msg("topk", 100),
            meta_map={"k": 2, "width": 1},
            buffer=bytes([5, 200]) + _words([0x3C00, 0x3C00]),
        ),
        "index 206 out of range for 100 elements",
    ),
    "topk k too large": (
        lambda: _with(_msg("topk", 100), meta_map={"k": 101, "width": 1}),
        r"meta\['k'\] must be an integer in \[0, 100\]",
    ),
    "topk bad width": (
        lambda: _with(_msg("topk", 100), meta_map={"k": 1, "width": 3}),
        "index width must be 1, 2 or 4",
    ),
    "corrupt zstd": (
        lambda: _with(_msg("zstd+uint8-blockwise"), buffer=b"\x28\xb5\x2f\xfd garbage"),
        "zstd: corrupt compressed payload",
    ),
    "lz4 size lie": (
        lambda: _with(
            _msg("lz4+float16"),
            meta_map={"raw_bytes": 5000},
        ),
        "lz4: corrupt compressed payload|decompressed to",
    ),
    "zstd bomb": (
        lambda: _with(
            _msg("zstd+none", 10),
            meta_map={"raw_bytes": 1 << 40},
        ),
        r"meta\['raw_bytes'\] must be an integer",
    ),
    "nested wrappers": (
        lambda: _with(_msg("zstd+float16"), codec="zstd+lz4+float16"),
        "unknown codec|do not nest",
    ),
    "float16 values overflow a float16 tensor": (
        lambda: _with(
            get_codec("uint8-blockwise").encode(np.ones(4, np.float16)),
            buffer=bytes([254] * 4) + np.array([1e6], "<f4").tobytes(),
        ),
        "decoded values overflow float16",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_message_is_rejected_with_reason(case: str) -> None:
    build, reason = CASES[case]
    msg = build()
    with pytest.raises(CodecError, match=reason):
        decode_chunk(msg)


def test_codec_decode_applies_the_same_checks() -> None:
    msg = _with(_msg("float16"), shape=[3])
    with pytest.raises(CodecError, match="payload is 10000 bytes"):
        get_codec("float16").decode(msg)


def test_max_elements_guards_dense_expansion() -> None:
    msg = get_codec("topk").encode(normal(1000))
    big = _with(msg, shape=[1 << 29])
    with pytest.raises(CodecError, match="more than 268435456 elements"):
        decode_chunk(big)
    with pytest.raises(CodecError, match="more than 999 elements"):
        decode_chunk(msg, max_elements=999)
    assert decode_chunk(msg, max_elements=1000).shape == (1000,)
