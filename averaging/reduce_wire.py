"""Client-side (de)serialisation of the ``Reduce`` stream without nested-message copies.

Building ``ReduceRequest(chunk=TensorChunk(buffer=payload))`` copies the payload three
times (into bytes, into the chunk, into the request) before gRPC serialises it a fourth
time; parsing a reply copies it twice more. On the sender side of the stream this
module writes the same protobuf wire bytes directly: the small fields are serialised by
protobuf, the payload is appended once (``b"".join``). Replies are scanned in place and
the payload is handed to the codec as a ``memoryview`` of the received bytes.

The bytes on the wire are ordinary ``ReduceRequest``/``ReduceResponse`` messages
(fields may appear in any order in protobuf), so the reducer side parses them with the
generated classes. Replies come from a possibly hostile peer: the scanner bounds every
length, never raises, and reports malformed input in :attr:`Reply.error`.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmavg.compression.base import Encoded, Header, parse_header
from swarmavg.compression.dtypes import dtype_to_proto
from swarmavg.proto import averaging_pb2, tensor_pb2

_LEN = 2
_VARINT = 0
_REQUEST_CHUNK_FIELD = 2  # ReduceRequest.chunk
_RESPONSE_CHUNK_FIELD = 1  # ReduceResponse.chunk
_RESPONSE_INDEX_FIELD = 2  # ReduceResponse.chunk_index
_RESPONSE_SENDERS_FIELD = 3  # ReduceResponse.num_senders
_CHUNK_BUFFER_FIELD = 4  # TensorChunk.buffer
_CHUNK_TOTAL_BYTES_FIELD = 9  # TensorChunk.total_bytes


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


@dataclass(frozen=True)
class OutgoingChunk:
    """One ``ReduceRequest`` as wire pieces; :func:`serialize_request` joins them."""

    pieces: tuple[bytes | memoryview, ...]
    nbytes: int


def encode_request(
    encoded: Encoded, chunk_index: int, first: averaging_pb2.ReduceRequest | None = None
) -> OutgoingChunk:
    """Wire pieces of a ``ReduceRequest`` carrying ``encoded`` as its chunk.

    Args:
        encoded: the codec's header and payload for this chunk.
        chunk_index: index of the chunk within its part.
        first: the naming fields (header, group id, part, weight) of the stream's first
            message, or ``None`` for the later ones.
    """
    header = encoded.header
    payload = memoryview(encoded.payload).cast("B")
    small = tensor_pb2.TensorChunk(
        codec=header.codec,
        dtype=dtype_to_proto(header.dtype),  # type: ignore[arg-type]
        shape=header.shape,
        meta=header.meta_bytes(),
        seq=0,
        num_chunks=1,
        offset=0,
        total_bytes=len(payload),
    ).SerializeToString()
    chunk_head = small + _tag(_CHUNK_BUFFER_FIELD, _LEN) + _varint(len(payload))
    chunk_len = len(chunk_head) + len(payload)
    outer = averaging_pb2.ReduceRequest(chunk_index=chunk_index)
    if first is not None:
        outer.MergeFrom(first)
    head = (
        outer.SerializeToString()
        + _tag(_REQUEST_CHUNK_FIELD, _LEN)
        + _varint(chunk_len)
        + chunk_head
    )
    return OutgoingChunk((head, payload), len(head) + len(payload))


def serialize_request(message: OutgoingChunk) -> bytes:
    """gRPC request serializer for :class:`OutgoingChunk` (one copy of the payload)."""
    return b"".join(message.pieces)


@dataclass(frozen=True)
class Reply:
    """One parsed ``ReduceResponse``; ``error`` is set when it is malformed."""

    chunk_index: int = 0
    num_senders: int = 0
    header: Header | None = None
    payload: memoryview | None = None
    nbytes: int = 0
    error: str = ""


class _Malformed(ValueError):
    pass


def _read_varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: memoryview, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """``(field, wire_type, value_or_start, end)`` for each field in ``data[start:end]``."""
    out = []
    pos = start
    while pos < end:
        key, pos = _read_varint(data, pos, end)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(data, pos, end)
            out.append((field, wire_type, value, pos))
        elif wire_type == _LEN:
            length, pos = _read_varint(data, pos, end)
            if length > end - pos:
                raise _Malformed("length-delimited field runs past the message")
            out.append((field, wire_type, pos, pos + length))
            pos += length
        elif wire_type in (1, 5):  # fixed64 / fixed32: skip
            pos += 8 if wire_type == 1 else 4
            if pos > end:
                raise _Malformed("fixed-width field runs past the message")
        else:
            raise _Malformed(f"unsupported wire type {wire_type}")
    return out


def deserialize_reply(data: bytes) -> Reply:
    """gRPC response deserializer: scan a ``ReduceResponse`` in place. Never raises."""
    try:
        return _parse_reply(data)
    except Exception as e:  # malformed input from a peer must not escape into gRPC
        return Reply(nbytes=len(data), error=f"malformed reply: {e}")


def _parse_reply(data: bytes) -> Reply:
    view = memoryview(data)
    chunk_range: tuple[int, int] | None = None
    chunk_index = num_senders = 0
    for field, wire_type, a, b in _fields(view, 0, len(view)):
        if field == _RESPONSE_CHUNK_FIELD and wire_type == _LEN:
            chunk_range = (a, b)
        elif field == _RESPONSE_INDEX_FIELD and wire_type == _VARINT:
            chunk_index = a
        elif field == _RESPONSE_SENDERS_FIELD and wire_type == _VARINT:
            num_senders = a
    if chunk_range is None:
        return Reply(chunk_index, num_senders, nbytes=len(data))
    # Keep every chunk field except buffer and total_bytes for the header parser; the
    # payload stays a view of `data`.
    small = bytearray()
    payload: memoryview | None = None
    total_bytes: int | None = None
    start = chunk_range[0]
    for field, wire_type, a, b in _fields(view, *chunk_range):
        if field == _CHUNK_BUFFER_FIELD and wire_type == _LEN:
            payload = view[a:b]
        elif field == _CHUNK_TOTAL_BYTES_FIELD and wire_type == _VARINT:
            total_bytes = a
        else:
            small += view[start:b]
        start = b
    if payload is None:
        payload = view[0:0]
    if total_bytes is not None and total_bytes not in (0, len(payload)):
        raise _Malformed(f"total_bytes={total_bytes} but the buffer holds {len(payload)}")
    header = parse_header(tensor_pb2.TensorChunk.FromString(bytes(small)))
    return Reply(chunk_index, num_senders, header, payload, len(data))
