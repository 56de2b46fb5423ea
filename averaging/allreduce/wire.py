"""(De)serialisation of the ``Reduce`` stream without nested-message copies.

Building ``ReduceRequest(chunk=TensorChunk(buffer=payload))`` copies the payload three
times (into bytes, into the chunk, into the request) before gRPC serialises it a fourth
time; parsing one copies it twice more. Both ends of the stream therefore write the same
protobuf wire bytes directly (the small fields are serialised by protobuf, the payload
is appended once) and scan inbound messages in place: the payload reaches the codec as a
``memoryview`` of the received bytes. Outbound messages stay wire pieces (the small head,
the payload) that the data plane hands the socket as they are and gRPC joins: the reducer
encodes each averaged chunk once and writes the same pieces to every sender.

The bytes on the wire are ordinary ``ReduceRequest``/``ReduceResponse`` messages
(fields may appear in any order in protobuf), so any protobuf implementation talks to
these functions. Inbound messages come from a possibly hostile peer: the scanners bound
every length, never raise, and report malformed input in an ``error`` field.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from swarmavg.compression.base import Encoded, Header, parse_header
from swarmavg.compression.dtypes import dtype_to_proto
from swarmavg.proto import averaging_pb2, common_pb2, tensor_pb2

_LEN = 2
_VARINT = 0
_FIXED64 = 1
_REQUEST_HEADER_FIELD = 1  # ReduceRequest.header
_REQUEST_CHUNK_FIELD = 2  # ReduceRequest.chunk
_REQUEST_GROUP_FIELD = 3  # ReduceRequest.group_id
_REQUEST_PART_FIELD = 4  # ReduceRequest.part_index
_REQUEST_WEIGHT_FIELD = 5  # ReduceRequest.weight
_REQUEST_INDEX_FIELD = 6  # ReduceRequest.chunk_index
_RESPONSE_CHUNK_FIELD = 1  # ReduceResponse.chunk
_RESPONSE_INDEX_FIELD = 2  # ReduceResponse.chunk_index
_RESPONSE_SENDERS_FIELD = 3  # ReduceResponse.num_senders
_RESPONSE_ADJUSTED_FIELD = 4  # ReduceResponse.num_adjusted
_RESPONSE_WEIGHTS_CLIPPED_FIELD = 5  # ReduceResponse.weights_clipped
_CHUNK_BUFFER_FIELD = 4  # TensorChunk.buffer
_CHUNK_TOTAL_BYTES_FIELD = 9  # TensorChunk.total_bytes
_MAX_FIELDS = 64
"""Fields scanned per message level at most: ours carry fewer than 10, and a hostile peer
must not make the scanner walk millions of one-byte fields."""


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
    """One ``ReduceRequest`` or ``ReduceResponse`` as wire pieces (the payload is not
    copied); :func:`serialize_pieces` joins them, for gRPC."""

    pieces: tuple[bytes | memoryview, ...]
    nbytes: int


def _chunk_head(encoded: Encoded) -> tuple[bytes, memoryview]:
    """A ``TensorChunk``'s wire bytes up to its payload, and the payload as bytes."""
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
    return small + _tag(_CHUNK_BUFFER_FIELD, _LEN) + _varint(len(payload)), payload


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
    chunk_head, payload = _chunk_head(encoded)
    outer = averaging_pb2.ReduceRequest(chunk_index=chunk_index)
    if first is not None:
        outer.MergeFrom(first)
    head = (
        outer.SerializeToString()
        + _tag(_REQUEST_CHUNK_FIELD, _LEN)
        + _varint(len(chunk_head) + len(payload))
        + chunk_head
    )
    return OutgoingChunk((head, payload), len(head) + len(payload))


def encode_response(
    encoded: Encoded | None,
    chunk_index: int,
    num_senders: int,
    num_adjusted: int = 0,
    weights_clipped: int = 0,
) -> OutgoingChunk:
    """A ``ReduceResponse`` as wire pieces (no copy of the payload).

    ``encoded`` is ``None`` for a chunk that nobody delivered (``num_senders`` 0).
    ``num_adjusted``: inputs of this chunk the robust aggregation rejected, clipped or
    trimmed;
    ``weights_clipped``: senders of the part whose weight the reducer bounded.
    """
    head = averaging_pb2.ReduceResponse(
        chunk_index=chunk_index,
        num_senders=num_senders,
        num_adjusted=num_adjusted,
        weights_clipped=weights_clipped,
    ).SerializeToString()
    if encoded is None:
        return OutgoingChunk((head,), len(head))
    chunk_head, payload = _chunk_head(encoded)
    head = (
        head
        + _tag(_RESPONSE_CHUNK_FIELD, _LEN)
        + _varint(len(chunk_head) + len(payload))
        + chunk_head
    )
    return OutgoingChunk((head, payload), len(head) + len(payload))


def serialize_pieces(message: OutgoingChunk) -> bytes:
    """gRPC serializer for :class:`OutgoingChunk` (one copy of the payload)."""
    return b"".join(message.pieces)


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
    """``(field, wire_type, a, b)`` for each field in ``data[start:end]``.

    Varints give ``(value, end)``; length-delimited and fixed-width fields give the
    ``(start, end)`` of their bytes.
    """
    out: list[tuple[int, int, int, int]] = []
    pos = start
    while pos < end:
        if len(out) == _MAX_FIELDS:
            raise _Malformed(f"more than {_MAX_FIELDS} fields")
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
        elif wire_type in (_FIXED64, 5):  # fixed64 / fixed32
            width = 8 if wire_type == _FIXED64 else 4
            if pos + width > end:
                raise _Malformed("fixed-width field runs past the message")
            out.append((field, wire_type, pos, pos + width))
            pos += width
        else:
            raise _Malformed(f"unsupported wire type {wire_type}")
    return out


def _parse_chunk(view: memoryview, start: int, end: int) -> tuple[Header, memoryview]:
    """The header and the payload (a view of ``view``) of the TensorChunk at ``start:end``."""
    # Keep every chunk field except buffer and total_bytes for the header parser; the
    # payload stays a view of the received bytes.
    small = bytearray()
    payload: memoryview | None = None
    total_bytes: int | None = None
    for field, wire_type, a, b in _fields(view, start, end):
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
    return parse_header(tensor_pb2.TensorChunk.FromString(bytes(small))), payload


@dataclass(frozen=True)
class Reply:
    """One parsed ``ReduceResponse``; ``error`` is set when it is malformed."""

    chunk_index: int = 0
    num_senders: int = 0
    header: Header | None = None
    payload: memoryview | None = None
    nbytes: int = 0
    error: str = ""
    num_adjusted: int = 0
    weights_clipped: int = 0


def deserialize_reply(data: bytes) -> Reply:
    """gRPC response deserializer: scan a ``ReduceResponse`` in place. Never raises."""
    try:
        return _parse_reply(data)
    except Exception as e:  # malformed input from a peer must not escape into gRPC
        return Reply(nbytes=len(data), error=f"malformed reply: {e}")


def _parse_reply(data: bytes) -> Reply:
    view = memoryview(data)
    chunk_range: tuple[int, int] | None = None
    chunk_index = num_senders = adjusted = weights_clipped = 0
    for field, wire_type, a, b in _fields(view, 0, len(view)):
        if field == _RESPONSE_CHUNK_FIELD and wire_type == _LEN:
            chunk_range = (a, b)
        elif field == _RESPONSE_INDEX_FIELD and wire_type == _VARINT:
            chunk_index = a
        elif field == _RESPONSE_SENDERS_FIELD and wire_type == _VARINT:
            num_senders = a
        elif field == _RESPONSE_ADJUSTED_FIELD and wire_type == _VARINT:
            adjusted = a
        elif field == _RESPONSE_WEIGHTS_CLIPPED_FIELD and wire_type == _VARINT:
            weights_clipped = a
    if chunk_range is None:
        return Reply(
            chunk_index,
            num_senders,
            nbytes=len(data),
            num_adjusted=adjusted,
            weights_clipped=weights_clipped,
        )
    header, payload = _parse_chunk(view, *chunk_range)
    return Reply(
        chunk_index, num_senders, header, payload, len(data), "", adjusted, weights_clipped
    )


@dataclass(frozen=True)
class Request:
    """One parsed ``ReduceRequest``; ``error`` is set when it is malformed.

    Attributes:
        header: the sender's identity (first message only); ``None`` when absent.
        group_id / part_index / weight: the round it names (first message only).
        chunk_index: index of the chunk within the part.
        chunk: the chunk's codec header, ``None`` when the message carries no chunk.
        payload: the chunk's payload, a view of the received bytes.
        nbytes: size of the whole message.
    """

    header: common_pb2.RequestHeader | None = None
    group_id: bytes = b""
    part_index: int = 0
    weight: float = 0.0
    chunk_index: int = 0
    chunk: Header | None = None
    payload: memoryview | None = None
    nbytes: int = 0
    error: str = ""

    @property
    def names_round(self) -> bool:
        """Whether it carries fields only the first message of a stream may carry."""
        return self.header is not None or bool(self.group_id)


def deserialize_request(data: bytes) -> Request:
    """gRPC request deserializer: scan a ``ReduceRequest`` in place. Never raises."""
    try:
        return _parse_request(data)
    except Exception as e:  # malformed input from a peer must not escape into gRPC
        return Request(nbytes=len(data), error=f"malformed request: {e}")


def _parse_request(data: bytes) -> Request:
    view = memoryview(data)
    header: common_pb2.RequestHeader | None = None
    chunk: Header | None = None
    payload: memoryview | None = None
    group_id = b""
    part_index = chunk_index = 0
    weight = 0.0
    for field, wire_type, a, b in _fields(view, 0, len(view)):
        if field == _REQUEST_HEADER_FIELD and wire_type == _LEN:
            header = common_pb2.RequestHeader.FromString(bytes(view[a:b]))
        elif field == _REQUEST_CHUNK_FIELD and wire_type == _LEN:
            chunk, payload = _parse_chunk(view, a, b)
        elif field == _REQUEST_GROUP_FIELD and wire_type == _LEN:
            group_id = bytes(view[a:b])
        elif field == _REQUEST_PART_FIELD and wire_type == _VARINT:
            part_index = a
        elif field == _REQUEST_WEIGHT_FIELD and wire_type == _FIXED64:
            (weight,) = struct.unpack("<d", view[a:b])
        elif field == _REQUEST_INDEX_FIELD and wire_type == _VARINT:
            chunk_index = a
    return Request(header, group_id, part_index, weight, chunk_index, chunk, payload, len(data))


def reduce_digest(group_id: bytes, part_index: int, weight: float, chunk_index: int) -> bytes:
    """What a ``Reduce`` stream's first message is signed over (:mod:`swarmavg.dht.auth`).

    The first message without its header and its chunk: the group, the part (whose reducer
    is the receiver) and the weight. Chunks are not covered one by one: the stream is
    authenticated once, at its start, and its later messages ride on the same HTTP/2 stream
    or data-plane connection (docs/security.md). Both ends build the same small message, so
    the sender signs what the receiver scans without either copying the payload.
    """
    naming = averaging_pb2.ReduceRequest(
        group_id=group_id, part_index=part_index, weight=weight, chunk_index=chunk_index
    )
    return hashlib.sha256(naming.SerializeToString(deterministic=True)).digest()


def pass_bytes(message: bytes) -> bytes:
    """gRPC (de)serializer for messages that are already wire bytes."""
    return message
