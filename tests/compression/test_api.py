"""The public API others import: names, registry errors, CodecInfo coercion."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from swarmavg.compression import CodecError, CodecInfo, Role, decode_chunk, get_codec
from swarmavg.compression.dtypes import (
    FLOATING,
    SUPPORTED,
    dtype_from_proto,
    dtype_to_proto,
    is_bfloat16,
    normalize_dtype,
)
from swarmavg.proto import tensor_pb2


def test_unknown_codec_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown codec 'bogus'; known: .*float16"):
        get_codec("bogus")


def test_codec_info_accepts_role_strings() -> None:
    assert CodecInfo(key="w", role="gradient").role is Role.GRADIENT  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown role"):
        CodecInfo(role="weights")  # type: ignore[arg-type]


def test_codec_error_is_value_error() -> None:
    assert issubclass(CodecError, ValueError)


def test_decode_chunk_rejects_unknown_codec() -> None:
    msg = get_codec("none").encode(np.ones(3, np.float32))
    msg.codec = "gzip-9000"
    with pytest.raises(CodecError, match="unknown codec 'gzip-9000'"):
        decode_chunk(msg)


def test_dtype_mapping_round_trips() -> None:
    for value in (
        tensor_pb2.FLOAT32,
        tensor_pb2.FLOAT16,
        tensor_pb2.BFLOAT16,
        tensor_pb2.FLOAT64,
        tensor_pb2.INT8,
        tensor_pb2.UINT8,
        tensor_pb2.INT32,
        tensor_pb2.INT64,
    ):
        assert dtype_to_proto(dtype_from_proto(value)) == value
    assert dtype_to_proto(np.dtype(">f4")) == tensor_pb2.FLOAT32
    with pytest.raises(CodecError, match="unsupported dtype complex64"):
        dtype_to_proto(np.complex64)
    with pytest.raises(CodecError, match="unspecified"):
        dtype_from_proto(tensor_pb2.DTYPE_UNSPECIFIED)


def test_dtype_sets_behave_as_sets_of_dtypes() -> None:
    bf16 = np.dtype(ml_dtypes.bfloat16)
    plain = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)}
    assert set(FLOATING) == {*plain, bf16}
    assert len(FLOATING) == 4
    assert FLOATING.names == ("bfloat16", "float16", "float32", "float64")
    assert bf16 in FLOATING
    assert bf16 in SUPPORTED
    assert np.dtype(np.int8) in SUPPORTED
    assert np.dtype(np.int8) not in FLOATING
    # as in a frozenset of dtypes: only dtypes match, in native byte order
    for other in ("float32", np.float32, ml_dtypes.bfloat16, "bfloat16", None, np.dtype(">f4")):
        assert other not in FLOATING
    assert FLOATING - {bf16} == frozenset(plain)
    assert is_bfloat16(bf16)
    assert not is_bfloat16(np.dtype(np.float16))
    assert not is_bfloat16(ml_dtypes.bfloat16)


def test_bfloat16_can_be_named() -> None:
    assert normalize_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert dtype_to_proto("bfloat16") == tensor_pb2.BFLOAT16
    with pytest.raises(CodecError, match="not a dtype: 'bfloat15'"):
        normalize_dtype("bfloat15")
