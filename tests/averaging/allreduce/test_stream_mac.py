"""Keyed ``Reduce`` streams, without a network: the key agreement, the handshake's
signature, and the MAC framing of messages on the wire (bad tag, wrong sequence, wrong
direction, another stream's key, a missing or misplaced tag, the reducer's end marker)."""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.averaging.allreduce.keyed_stream import SenderHandshake, StreamSeal, answer
from swarmavg.averaging.allreduce.stream_keys import EphemeralKey, KeyAgreementError
from swarmavg.averaging.allreduce.stream_mac import (
    TRAILER_BYTES,
    Direction,
    IntegrityError,
    StreamMac,
)
from swarmavg.averaging.allreduce.wire import (
    OutgoingChunk,
    deserialize_reply,
    deserialize_request,
    encode_end,
    encode_request,
    encode_response,
    reduce_digest,
    sealed,
    serialize_pieces,
)
from swarmavg.compression import CodecInfo, get_codec
from swarmavg.dht import Authenticator, Identity, RequestSigner
from swarmavg.dht.identity import HeaderError

RUN = "mac-run"
GROUP = b"g" * 16


def _chunk(index: int, value: float) -> OutgoingChunk:
    codec = get_codec("none")
    encoded = codec.encode_payload(np.full(256, value, np.float32), CodecInfo())
    return encode_request(encoded, index)


def _reply(index: int, value: float) -> OutgoingChunk:
    codec = get_codec("none")
    encoded = codec.encode_payload(np.full(256, value, np.float32), CodecInfo())
    return encode_response(encoded, index, 3)


def _ends() -> tuple[Identity, Identity, StreamSeal, StreamSeal]:
    """A sender and a reducer that ran the handshake: their identities and MACs."""
    sender, reducer = Identity.generate(), Identity.generate()
    handshake = SenderHandshake(sender.peer_id, reducer.peer_id, GROUP, 1)
    opening = deserialize_request(
        serialize_pieces(handshake.opening(RequestSigner(sender, RUN, lambda: ""), 2.0))
    )
    assert opening.stream_key == handshake.public_key
    assert opening.chunk is None
    digest = reduce_digest(GROUP, 1, 2.0, 0, opening.stream_key)
    assert Authenticator(reducer, RUN).check(opening.header, opening.header.method, digest)
    reply, reducer_seal = answer(opening, sender.peer_id, RequestSigner(reducer, RUN, lambda: ""))
    sender_seal = handshake.accept(
        deserialize_reply(serialize_pieces(reply)), Authenticator(sender, RUN)
    )
    return sender, reducer, sender_seal, reducer_seal


def test_both_ends_agree_and_a_sealed_chunk_and_reply_verify() -> None:
    _, _, sender, reducer = _ends()
    for index in range(3):
        request = deserialize_request(
            serialize_pieces(sealed(_chunk(index, index), sender.outbound))
        )
        assert not request.error
        assert request.chunk_index == index
        assert len(request.mac) == 16
        reducer.inbound.check(request.covered, request.mac)
        assert np.frombuffer(request.payload, np.float32)[0] == index  # type: ignore[arg-type]
        reply = deserialize_reply(serialize_pieces(sealed(_reply(index, 0.5), reducer.outbound)))
        assert not reply.error
        assert reply.chunk_index == index
        sender.inbound.check(reply.covered, reply.mac)


def test_a_sealed_piecewise_tag_is_the_tag_of_the_joined_message() -> None:
    """A sender's message is tagged piece by piece (no join): the reducer checks the joined
    bytes it receives against the same tag."""
    key = bytes(range(32))
    pieces = (b"head" * 10, memoryview(np.arange(4096, dtype=np.float32)).cast("B"))
    trailer = StreamMac(key, Direction.TO_REDUCER).seal(pieces)
    assert trailer == StreamMac(key, Direction.TO_REDUCER).seal([b"".join(pieces)])
    StreamMac(key, Direction.TO_REDUCER).check(b"".join(pieces), trailer[2:])


def test_the_reducers_end_marker_verifies_and_a_forged_one_fails() -> None:
    """An end before the last average comes under the stream's tag: the sender reads it
    as the reducer's; one written on the path (no key) fails like any altered message."""
    _, _, sender, reducer = _ends()
    reply = deserialize_reply(serialize_pieces(sealed(_reply(0, 0.5), reducer.outbound)))
    sender.inbound.check(reply.covered, reply.mac)
    end = deserialize_reply(
        serialize_pieces(sealed(encode_end("FAILED_PRECONDITION: round is over"), reducer.outbound))
    )
    assert not end.error
    assert end.end == "FAILED_PRECONDITION: round is over"
    assert end.payload is None
    sender.inbound.check(end.covered, end.mac)

    _, _, sender, _ = _ends()
    forged = StreamMac(bytes(32), Direction.TO_SENDER)
    end = deserialize_reply(serialize_pieces(sealed(encode_end("forged"), forged)))
    with pytest.raises(IntegrityError):
        sender.inbound.check(end.covered, end.mac)


def test_an_altered_byte_fails() -> None:
    _, _, sender, reducer = _ends()
    wire = bytearray(serialize_pieces(sealed(_chunk(0, 1.0), sender.outbound)))
    wire[len(wire) // 2] ^= 0x01  # inside the payload
    request = deserialize_request(bytes(wire))
    assert not request.error  # still a well-formed message: only the tag tells
    with pytest.raises(IntegrityError):
        reducer.inbound.check(request.covered, request.mac)


def test_a_bad_tag_fails() -> None:
    _, _, sender, reducer = _ends()
    wire = bytearray(serialize_pieces(sealed(_chunk(0, 1.0), sender.outbound)))
    wire[-1] ^= 0x80
    request = deserialize_request(bytes(wire))
    with pytest.raises(IntegrityError):
        reducer.inbound.check(request.covered, request.mac)


def test_a_replayed_or_reordered_message_fails() -> None:
    _, _, sender, reducer = _ends()
    first = deserialize_request(serialize_pieces(sealed(_chunk(0, 1.0), sender.outbound)))
    second = deserialize_request(serialize_pieces(sealed(_chunk(1, 1.0), sender.outbound)))
    # Reordered: the second message where the first is due.
    with pytest.raises(IntegrityError, match="message 0"):
        reducer.inbound.check(second.covered, second.mac)
    _, _, sender, reducer = _ends()
    first = deserialize_request(serialize_pieces(sealed(_chunk(0, 1.0), sender.outbound)))
    reducer.inbound.check(first.covered, first.mac)
    # Replayed: the first message again, where the second is due.
    with pytest.raises(IntegrityError, match="message 1"):
        reducer.inbound.check(first.covered, first.mac)


def test_a_message_sent_back_the_other_way_fails() -> None:
    _, _, _sender, reducer = _ends()
    # A reply the reducer sealed, reflected to the reducer as if the sender wrote it.
    reply = serialize_pieces(sealed(_reply(0, 1.0), reducer.outbound))
    parsed = deserialize_reply(reply)
    with pytest.raises(IntegrityError):
        reducer.inbound.check(parsed.covered, parsed.mac)
    # The same key, the same sequence, the other direction: another tag.
    key = b"k" * 32
    to_reducer = StreamMac(key, Direction.TO_REDUCER).seal([b"message"])
    to_sender = StreamMac(key, Direction.TO_SENDER).seal([b"message"])
    assert to_reducer != to_sender
    with pytest.raises(IntegrityError):
        StreamMac(key, Direction.TO_SENDER).check(b"message", to_reducer[2:])


def test_another_streams_message_fails() -> None:
    _, _, sender, _ = _ends()
    _, _, _, other_reducer = _ends()
    request = deserialize_request(serialize_pieces(sealed(_chunk(0, 1.0), sender.outbound)))
    with pytest.raises(IntegrityError):
        other_reducer.inbound.check(request.covered, request.mac)


def test_a_message_without_a_tag_fails_and_a_misplaced_tag_is_malformed() -> None:
    _, _, sender, reducer = _ends()
    bare = deserialize_request(serialize_pieces(_chunk(0, 1.0)))
    assert bare.covered is None
    assert bare.mac == b""
    with pytest.raises(IntegrityError, match="carries no tag"):
        reducer.inbound.check(bare.covered, bare.mac)
    # The tag stripped by whoever is on the path: the message is short of its trailer.
    wire = serialize_pieces(sealed(_chunk(0, 1.0), sender.outbound))
    stripped = deserialize_request(wire[:-TRAILER_BYTES])
    with pytest.raises(IntegrityError):
        reducer.inbound.check(stripped.covered, stripped.mac)
    # A mac field anywhere but last, or of another length, is not a message at all.
    trailer = wire[-TRAILER_BYTES:]
    assert deserialize_request(trailer + wire[:-TRAILER_BYTES]).error
    assert deserialize_request(wire[:-TRAILER_BYTES] + b"\x42\x0f" + b"t" * 15).error
    assert deserialize_reply(trailer + serialize_pieces(_reply(0, 1.0))).error


def test_the_handshake_must_be_the_reducers_answer_to_this_stream() -> None:
    sender, reducer = Identity.generate(), Identity.generate()
    impostor = Identity.generate()

    def opened() -> tuple[SenderHandshake, object]:
        handshake = SenderHandshake(sender.peer_id, reducer.peer_id, GROUP, 0)
        wire = serialize_pieces(handshake.opening(RequestSigner(sender, RUN, lambda: ""), 1.0))
        return handshake, deserialize_request(wire)

    # Signed by someone else than the reducer dialled (a relay answering in its place).
    handshake, opening = opened()
    reply, _ = answer(opening, sender.peer_id, RequestSigner(impostor, RUN, lambda: ""))  # type: ignore[arg-type]
    with pytest.raises(HeaderError):
        handshake.accept(deserialize_reply(serialize_pieces(reply)), Authenticator(sender, RUN))
    # The reducer's answer to another stream's first message.
    handshake, _ = opened()
    _, other_opening = opened()
    reply, _ = answer(other_opening, sender.peer_id, RequestSigner(reducer, RUN, lambda: ""))  # type: ignore[arg-type]
    with pytest.raises(HeaderError):
        handshake.accept(deserialize_reply(serialize_pieces(reply)), Authenticator(sender, RUN))
    # A reply that is no handshake: an averaged chunk where the handshake is due.
    handshake, _ = opened()
    with pytest.raises(IntegrityError):
        handshake.accept(
            deserialize_reply(serialize_pieces(_reply(0, 1.0))), Authenticator(sender, RUN)
        )


def test_a_low_order_key_is_refused() -> None:
    with pytest.raises(KeyAgreementError):
        EphemeralKey().agree(bytes(32), b"transcript")  # the all-zero point
    with pytest.raises(KeyAgreementError):
        EphemeralKey().agree(b"short", b"transcript")


def test_the_signature_covers_the_stream_key() -> None:
    sender, reducer = Identity.generate(), Identity.generate()
    handshake = SenderHandshake(sender.peer_id, reducer.peer_id, GROUP, 0)
    opening = deserialize_request(
        serialize_pieces(handshake.opening(RequestSigner(sender, RUN, lambda: ""), 1.0))
    )
    checker = Authenticator(reducer, RUN)
    # Stripped or swapped on the way, the key no longer matches what was signed.
    for key in (b"", EphemeralKey().public):
        with pytest.raises(HeaderError):
            checker.check(
                opening.header, opening.header.method, reduce_digest(GROUP, 0, 1.0, 0, key)
            )
    assert (
        checker.check(
            opening.header,
            opening.header.method,
            reduce_digest(GROUP, 0, 1.0, 0, opening.stream_key),
        )
        == sender.peer_id
    )
