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

A keyed stream's messages end with a ``mac`` field (:mod:`stream_mac`): :func:`sealed` adds
it as one more piece, and the scanners hand back the bytes it covers (a view) and the tag,
for the stream's :class:`~swarmavg.averaging.allreduce.stream_mac.StreamMac` to check.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from swarmavg.averaging.allreduce.stream_mac import TRAILER_BYTES, TRAILER_HEAD, StreamMac
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
_STREAM_KEY_FIELD = 7  # ReduceRequest.stream_key and ReduceResponse.stream_key
_MAC_FIELD = 8  # ReduceRequest.mac and ReduceResponse.mac
_REQUEST_RESUME_FIELD = 9  # ReduceRequest.resume
_REQUEST_STRIPE_FIELD = 10  # ReduceRequest.stripe
_REQUEST_STRIPES_FIELD = 11  # ReduceRequest.stripes
_RESPONSE_CHUNK_FIELD = 1  # ReduceResponse.chunk
_RESPONSE_INDEX_FIELD = 2  # ReduceResponse.chunk_index
_RESPONSE_SENDERS_FIELD = 3  # ReduceResponse.num_senders
_RESPONSE_ADJUSTED_FIELD = 4  # ReduceResponse.num_adjusted
_RESPONSE_WEIGHTS_CLIPPED_FIELD = 5  # ReduceResponse.weights_clipped
_RESPONSE_HEADER_FIELD = 6  # ReduceResponse.header
_RESPONSE_END_FIELD = 9  # ReduceResponse.end
_RESPONSE_STRIPES_FIELD = 10  # ReduceResponse.stripes
_CHUNK_BUFFER_FIELD = 4  # TensorChunk.buffer
_CHUNK_TOTAL_BYTES_FIELD = 9  # TensorChunk.total_bytes
MAX_END_BYTES = 1024
"""Longest ``end`` reason kept (UTF-8 bytes): it is the reducer's word, for logs and results."""
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


def encode_opening(first: averaging_pb2.ReduceRequest) -> OutgoingChunk:
    """A keyed stream's first message: its naming fields and key, no chunk."""
    head = first.SerializeToString()
    return OutgoingChunk((head,), len(head))


def encode_handshake(header: common_pb2.RequestHeader, stream_key: bytes) -> OutgoingChunk:
    """The reducer's answer to a keyed first message: its signed header and key."""
    head = averaging_pb2.ReduceResponse(header=header, stream_key=stream_key).SerializeToString()
    return OutgoingChunk((head,), len(head))


def encode_end(reason: str) -> OutgoingChunk:
    """A keyed stream's end before its last average: why the reducer ends it (sealed like
    every message after the handshake, so that an end forged on the path is told apart)."""
    text = reason.encode("utf-8", "replace")[:MAX_END_BYTES].decode("utf-8", "ignore")
    head = averaging_pb2.ReduceResponse(end=text or "ended").SerializeToString()
    return OutgoingChunk((head,), len(head))


def stripes_field(stripes: int) -> bytes:
    """A ``ReduceResponse.stripes`` field, appended to a reply before its tag: a field of
    its own (fields may come in any order), so the pieces every sender gets stay shared."""
    return _tag(_RESPONSE_STRIPES_FIELD, _VARINT) + _varint(stripes)


def sealed(message: OutgoingChunk, mac: StreamMac) -> OutgoingChunk:
    """``message`` with its ``mac`` field appended (the next tag of ``mac``'s direction)."""
    trailer = mac.seal(message.pieces)
    return OutgoingChunk((*message.pieces, trailer), message.nbytes + len(trailer))


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


def _trailer(view: memoryview, field: tuple[int, int, int, int]) -> tuple[memoryview, bytes]:
    """The bytes a top-level ``mac`` field covers and its tag; it must be the message's
    last field, in the one encoding :func:`sealed` writes."""
    _, wire_type, a, b = field
    start = a - len(TRAILER_HEAD)
    if (
        wire_type != _LEN
        or b != len(view)
        or b - start != TRAILER_BYTES
        or bytes(view[start:a]) != TRAILER_HEAD
    ):
        raise _Malformed("the mac field is not the message's last 18 bytes")
    return view[:start], bytes(view[a:b])


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
    handshake: common_pb2.RequestHeader | None = None
    """The reducer's signed answer to a keyed first message (its handshake only)."""
    stream_key: bytes = b""
    mac: bytes = b""
    covered: memoryview | None = None
    """The bytes ``mac`` covers (``None``: the message carries no ``mac``)."""
    end: str = ""
    """The reducer ends a keyed stream before its last average, and why (its end marker)."""
    stripes: int = 0
    """The most streams the reducer takes from one sender in a round (0: it did not say)."""


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
    handshake: common_pb2.RequestHeader | None = None
    stream_key = mac = b""
    end = ""
    stripes = 0
    covered: memoryview | None = None
    for found in _fields(view, 0, len(view)):
        field, wire_type, a, b = found
        if field == _MAC_FIELD:
            covered, mac = _trailer(view, found)
        elif field == _RESPONSE_END_FIELD and wire_type == _LEN:
            if b - a > MAX_END_BYTES:
                raise _Malformed(f"an end reason of {b - a} bytes")
            end = bytes(view[a:b]).decode("utf-8", "replace") or "ended"
        elif field == _RESPONSE_HEADER_FIELD and wire_type == _LEN:
            handshake = common_pb2.RequestHeader.FromString(bytes(view[a:b]))
        elif field == _STREAM_KEY_FIELD and wire_type == _LEN:
            stream_key = bytes(view[a:b])
        elif field == _RESPONSE_CHUNK_FIELD and wire_type == _LEN:
            chunk_range = (a, b)
        elif field == _RESPONSE_INDEX_FIELD and wire_type == _VARINT:
            chunk_index = a
        elif field == _RESPONSE_SENDERS_FIELD and wire_type == _VARINT:
            num_senders = a
        elif field == _RESPONSE_ADJUSTED_FIELD and wire_type == _VARINT:
            adjusted = a
        elif field == _RESPONSE_WEIGHTS_CLIPPED_FIELD and wire_type == _VARINT:
            weights_clipped = a
        elif field == _RESPONSE_STRIPES_FIELD and wire_type == _VARINT:
            stripes = a
    header: Header | None = None
    payload: memoryview | None = None
    if chunk_range is not None:
        header, payload = _parse_chunk(view, *chunk_range)
    return Reply(
        chunk_index,
        num_senders,
        header,
        payload,
        nbytes=len(data),
        num_adjusted=adjusted,
        weights_clipped=weights_clipped,
        handshake=handshake,
        stream_key=stream_key,
        mac=mac,
        covered=covered,
        end=end,
        stripes=stripes,
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
        stream_key: the sender's ephemeral public key of a keyed stream (first message).
        resume: the ticket of a resumed keyed stream (first message; stream_resume.py).
        stripe / stripes: which of the sender's streams to this reducer this is, and how
            many it opens (first message; 0 stripes: one stream).
        mac / covered: the tag of a keyed stream's message and the bytes it covers
            (``None``: the message carries no tag).
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
    stream_key: bytes = b""
    mac: bytes = b""
    covered: memoryview | None = None
    resume: bytes = b""
    stripe: int = 0
    stripes: int = 0

    @property
    def names_round(self) -> bool:
        """Whether it carries fields only the first message of a stream may carry."""
        return (
            self.header is not None
            or bool(self.group_id)
            or bool(self.stream_key)
            or bool(self.resume)
            or bool(self.stripe)
            or bool(self.stripes)
        )


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
    group_id = stream_key = mac = resume = b""
    covered: memoryview | None = None
    part_index = chunk_index = stripe = stripes = 0
    weight = 0.0
    for found in _fields(view, 0, len(view)):
        field, wire_type, a, b = found
        if field == _MAC_FIELD:
            covered, mac = _trailer(view, found)
        elif field == _STREAM_KEY_FIELD and wire_type == _LEN:
            stream_key = bytes(view[a:b])
        elif field == _REQUEST_RESUME_FIELD and wire_type == _LEN:
            resume = bytes(view[a:b])
        elif field == _REQUEST_HEADER_FIELD and wire_type == _LEN:
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
        elif field == _REQUEST_STRIPE_FIELD and wire_type == _VARINT:
            stripe = a
        elif field == _REQUEST_STRIPES_FIELD and wire_type == _VARINT:
            stripes = a
    return Request(
        header,
        group_id,
        part_index,
        weight,
        chunk_index,
        chunk,
        payload,
        len(data),
        "",
        stream_key,
        mac,
        covered,
        resume,
        stripe,
        stripes,
    )


def reduce_digest(
    group_id: bytes,
    part_index: int,
    weight: float,
    chunk_index: int,
    stream_key: bytes = b"",
    resume: bytes = b"",
    stripe: int = 0,
    stripes: int = 0,
) -> bytes:
    """What a ``Reduce`` stream's first message is signed over (:mod:`swarmavg.dht.auth`).

    The first message without its header and its chunk: the group, the part (whose reducer
    is the receiver) and the weight. Chunks are not signed one by one: the stream is
    authenticated once, at its start, and a keyed stream's later messages carry MACs under
    the key its first message and the reducer's handshake agree (:mod:`stream_keys`,
    docs/security.md). Both ends build the same small message, so
    the sender signs what the receiver scans without either copying the payload.

    A keyed stream's ``stream_key``, a resumed one's ``resume`` ticket and a striped one's
    ``stripe`` and ``stripes`` are covered too (nobody on the path can strip or swap them);
    an unkeyed one's digest is the same as before keys existed (an empty field is not
    serialised), so older senders' first messages still verify.
    """
    naming = averaging_pb2.ReduceRequest(
        group_id=group_id,
        part_index=part_index,
        weight=weight,
        chunk_index=chunk_index,
        stream_key=stream_key,
        resume=resume,
        stripe=stripe,
        stripes=stripes,
    )
    return hashlib.sha256(naming.SerializeToString(deterministic=True)).digest()


def pass_bytes(message: bytes) -> bytes:
    """gRPC (de)serializer for messages that are already wire bytes."""
    return message
