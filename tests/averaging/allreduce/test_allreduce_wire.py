"""The hand-built Reduce wire bytes are ordinary protobuf; hostile replies never raise."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmavg.averaging.allreduce.wire import (
    deserialize_reply,
    deserialize_request,
    encode_request,
    encode_response,
    serialize_pieces,
)
from swarmavg.compression import CodecInfo, get_codec
from swarmavg.dht import Identity
from swarmavg.proto import averaging_pb2


@pytest.mark.parametrize("codec_name", ["none", "float16", "uint8-blockwise"])
@pytest.mark.parametrize("first", [True, False])
def test_request_bytes_parse_as_reduce_request(codec_name: str, first: bool) -> None:
    codec = get_codec(codec_name)
    values = np.random.default_rng(0).standard_normal(3000).astype(np.float32)
    encoded = codec.encode_payload(values, CodecInfo())
    naming = None
    if first:
        naming = averaging_pb2.ReduceRequest(
            header=Identity.generate().make_header("r", "h:1"),
            group_id=b"g" * 16,
            part_index=3,
            weight=2.5,
        )
    wire = serialize_pieces(encode_request(encoded, 7, naming))
    parsed = averaging_pb2.ReduceRequest.FromString(wire)
    assert parsed.chunk_index == 7
    assert parsed.chunk == codec.encode(values, CodecInfo())
    np.testing.assert_array_equal(codec.decode(parsed.chunk), codec.decode(codec.encode(values)))
    if naming is not None:
        assert parsed.group_id == naming.group_id
        assert parsed.part_index == 3
        assert parsed.weight == 2.5
        assert parsed.header == naming.header
    else:
        assert not parsed.HasField("header")


@pytest.mark.parametrize("codec_name", ["none", "float16", "uint8-blockwise"])
def test_reply_scan_matches_protobuf(codec_name: str) -> None:
    codec = get_codec(codec_name)
    values = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    response = averaging_pb2.ReduceResponse(
        chunk=codec.encode(values, CodecInfo()), chunk_index=12, num_senders=5
    )
    data = response.SerializeToString()
    reply = deserialize_reply(data)
    assert reply.error == ""
    assert reply.chunk_index == 12
    assert reply.num_senders == 5
    assert reply.nbytes == len(data)
    assert reply.header is not None
    assert reply.payload is not None
    np.testing.assert_array_equal(
        codec.decode_payload(reply.header, reply.payload), codec.decode(response.chunk)
    )


def test_reply_without_chunk() -> None:
    reply = deserialize_reply(averaging_pb2.ReduceResponse(chunk_index=4).SerializeToString())
    assert reply.error == ""
    assert reply.chunk_index == 4
    assert reply.header is None


def test_truncated_and_lying_replies_are_reported() -> None:
    codec = get_codec("none")
    good = averaging_pb2.ReduceResponse(
        chunk=codec.encode(np.ones(100, np.float32), CodecInfo()), chunk_index=1, num_senders=2
    ).SerializeToString()
    for cut in (1, 5, len(good) // 2, len(good) - 1):
        assert deserialize_reply(good[:cut]).error
    lying = averaging_pb2.ReduceResponse(
        chunk=codec.encode(np.ones(100, np.float32), CodecInfo()), chunk_index=1
    )
    lying.chunk.total_bytes = 9999
    assert "total_bytes" in deserialize_reply(lying.SerializeToString()).error
    split = averaging_pb2.ReduceResponse(chunk=codec.encode(np.ones(4, np.float32)))
    split.chunk.num_chunks = 3
    assert deserialize_reply(split.SerializeToString()).error


@pytest.mark.parametrize("codec_name", ["none", "float16", "uint8-blockwise"])
@pytest.mark.parametrize("first", [True, False])
def test_request_scan_matches_protobuf(codec_name: str, first: bool) -> None:
    codec = get_codec(codec_name)
    values = np.random.default_rng(2).standard_normal(4000).astype(np.float32)
    message = averaging_pb2.ReduceRequest(chunk=codec.encode(values, CodecInfo()), chunk_index=9)
    if first:
        message.header.CopyFrom(Identity.generate().make_header("r", "h:1"))
        message.group_id = b"g" * 16
        message.part_index = 5
        message.weight = -0.75  # the parser reports it; the reducer refuses it
    data = message.SerializeToString()
    request = deserialize_request(data)
    assert request.error == ""
    assert request.chunk_index == 9
    assert request.nbytes == len(data)
    assert request.chunk is not None
    assert request.payload is not None
    np.testing.assert_array_equal(
        codec.decode_payload(request.chunk, request.payload), codec.decode(message.chunk)
    )
    assert request.names_round is first
    if first:
        assert request.header == message.header
        assert (request.group_id, request.part_index, request.weight) == (b"g" * 16, 5, -0.75)
    else:
        assert request.header is None


def test_request_without_chunk_and_lying_requests() -> None:
    bare = deserialize_request(averaging_pb2.ReduceRequest(chunk_index=3).SerializeToString())
    assert (bare.error, bare.chunk, bare.chunk_index) == ("", None, 3)
    codec = get_codec("none")
    good = averaging_pb2.ReduceRequest(
        chunk=codec.encode(np.ones(100, np.float32), CodecInfo()), chunk_index=1
    ).SerializeToString()
    for cut in (1, 5, len(good) // 2, len(good) - 1):
        assert deserialize_request(good[:cut]).error
    lying = averaging_pb2.ReduceRequest(chunk=codec.encode(np.ones(100, np.float32)))
    lying.chunk.total_bytes = 9999
    assert "total_bytes" in deserialize_request(lying.SerializeToString()).error
    bad_header = (
        averaging_pb2.ReduceRequest(chunk_index=1).SerializeToString() + b"\x0a\x02\xff\xff"
    )
    assert deserialize_request(bad_header).error


@pytest.mark.parametrize("codec_name", ["none", "float16", "uint8-blockwise"])
def test_response_bytes_parse_as_reduce_response(codec_name: str) -> None:
    codec = get_codec(codec_name)
    values = np.random.default_rng(3).standard_normal(3000).astype(np.float32)
    reply = encode_response(codec.encode_payload(values, CodecInfo()), 11, 4)
    assert isinstance(reply.pieces[-1], memoryview)  # the payload, not a copy of it
    wire = serialize_pieces(reply)
    assert len(wire) == reply.nbytes
    parsed = averaging_pb2.ReduceResponse.FromString(wire)
    assert (parsed.chunk_index, parsed.num_senders) == (11, 4)
    assert parsed.chunk == codec.encode(values, CodecInfo())
    empty = averaging_pb2.ReduceResponse.FromString(serialize_pieces(encode_response(None, 2, 0)))
    assert (empty.chunk_index, empty.num_senders, empty.HasField("chunk")) == (2, 0, False)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    reply = deserialize_reply(data)
    assert reply.nbytes == len(data) or reply.error
    request = deserialize_request(data)
    assert request.nbytes == len(data) or request.error


def test_messages_with_too_many_fields_are_refused_quickly() -> None:
    # 4 MB of one-byte-payload fields: protobuf would skip them as unknown fields; the
    # scanner refuses after a few dozen instead of walking two million.
    flood = b"\x78\x00" * (2 << 20)  # field 15, varint 0
    assert "fields" in deserialize_request(flood).error
    assert "fields" in deserialize_reply(flood).error
    ok = averaging_pb2.ReduceRequest(chunk_index=1).SerializeToString() + b"\x78\x00" * 10
    assert deserialize_request(ok).error == ""  # a few unknown fields are fine
