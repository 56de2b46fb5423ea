"""The handshake of a keyed ``Reduce`` stream and its MACs in flight, at both ends.

A sender opens a keyed stream with a signed first message that carries its ephemeral public
key and no chunk (:meth:`SenderHandshake.opening`). The reducer checks that message as every
first message (service.py), then answers it with a handshake reply, signed as the answer to
that message and carrying its own ephemeral public key (:func:`answer`); only then does the
sender send chunks. From there on every message either way ends with a MAC under the stream's key
(:mod:`stream_keys`, :mod:`stream_mac`): the reducer checks each chunk before the round sees
it (:func:`checked_requests`) and seals each averaged chunk it writes to this sender
(:class:`SealingContext`); the sender seals each chunk and checks each reply
(:class:`SenderHandshake`; outgoing.py builds the opening and seals the chunks, streams.py
takes the handshake reply and checks each reply's tag). The handshake costs the stream one
round trip before its first chunk; the signatures are one more per stream at each end. A
full handshake also leaves both ends a resumption secret: the sender's next stream to that
reducer names it in its signed first message and sends its chunks at once, no handshake
(:mod:`stream_resume`; :meth:`SenderHandshake.resumed_seal`, :func:`resume`).

A message that fails its check ends the stream and what came in it is not used: the
reducer drops the sender from the part (the round goes on without it), the sender distrusts
the reducer's part (it keeps its local values): what either does with a faulty peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from swarmavg.averaging.allreduce.round import ReduceContext
from swarmavg.averaging.allreduce.stream_keys import EphemeralKey, handshake_digest, transcript
from swarmavg.averaging.allreduce.stream_mac import Direction, IntegrityError, StreamMac
from swarmavg.averaging.allreduce.stream_resume import Resumption, resumed_key
from swarmavg.averaging.allreduce.wire import (
    OutgoingChunk,
    Reply,
    Request,
    encode_end,
    encode_handshake,
    encode_opening,
    reduce_digest,
    sealed,
    stripes_field,
)
from swarmavg.averaging.stalled import STATUS_WAIT
from swarmavg.averaging.stubs import REDUCE
from swarmavg.dht.auth import Authenticator, RequestSigner
from swarmavg.proto import averaging_pb2, common_pb2

__all__ = [
    "SealingContext",
    "SenderHandshake",
    "StreamSeal",
    "answer",
    "checked_requests",
    "resume",
]


@dataclasses.dataclass(frozen=True)
class StreamSeal:
    """One end's MACs of a keyed stream: what it sends, what it receives."""

    outbound: StreamMac
    inbound: StreamMac
    resumption: Resumption | None = None
    """What a full handshake leaves both ends for later streams (``None``: a resumed one)."""


def _seal_for(key: bytes, outbound: Direction, full_handshake: bool = True) -> StreamSeal:
    inbound = Direction.TO_SENDER if outbound is Direction.TO_REDUCER else Direction.TO_REDUCER
    resumption = Resumption.from_stream_key(key) if full_handshake else None
    return StreamSeal(StreamMac(key, outbound), StreamMac(key, inbound), resumption)


# ---- sender side ----


class SenderHandshake:
    """A sender's half of one keyed stream's handshake (one per stream, never reused)."""

    def __init__(
        self,
        sender_id: bytes,
        reducer_id: bytes,
        group_id: bytes,
        part: int,
        resumption: Resumption | None = None,
    ) -> None:
        self._ephemeral = EphemeralKey()
        self._sender_id = sender_id
        self._reducer_id = reducer_id
        self._group_id = group_id
        self._part = part
        self.resumption = resumption
        """The secret this stream resumes with (``None``: a full handshake)."""
        self.first_header: common_pb2.RequestHeader | None = None
        """The signed header of the first message, once :meth:`opening` built it."""

    @property
    def public_key(self) -> bytes:
        return self._ephemeral.public

    def opening(
        self, signer: RequestSigner, weight: float, stripe: int = 0, stripes: int = 1
    ) -> OutgoingChunk:
        """The stream's signed first message: the round, the weight, this end's key and,
        for one of several streams to the reducer, which one (``stripe`` of ``stripes``),
        signed for the reducer (the signature covers them: nobody on the path can strip or
        swap them). One stream (``stripes`` 1) sends no stripe fields, as before they
        existed."""
        if stripes <= 1:
            stripe = stripes = 0  # zeros are not serialised: the fields are absent
        first = averaging_pb2.ReduceRequest(
            group_id=self._group_id,
            part_index=self._part,
            weight=weight,
            stream_key=self._ephemeral.public,
            stripe=stripe,
            stripes=stripes,
        )
        ticket = self.resumption.ticket if self.resumption is not None else b""
        first.resume = ticket
        digest = reduce_digest(
            self._group_id, self._part, weight, 0, first.stream_key, ticket, stripe, stripes
        )
        first.header.CopyFrom(signer.sign(self._reducer_id, REDUCE, digest))
        self.first_header = first.header
        return encode_opening(first)

    def resumed_seal(self) -> StreamSeal:
        """A resumed stream's MACs, known before any reply (no handshake), once
        :meth:`opening` signed the first message.

        Raises:
            ValueError: this stream does not resume.
        """
        if self.resumption is None or self.first_header is None:
            raise ValueError("a stream without a resumption secret needs the handshake")
        key = resumed_key(
            self.resumption.secret,
            self._sender_id,
            self._reducer_id,
            self._group_id,
            self._part,
            # the signed header's nonce too: unique per accepted stream (the replay cache)
            self._ephemeral.public + bytes(self.first_header.nonce),
            self.resumption.ticket,
        )
        return _seal_for(key, Direction.TO_REDUCER, full_handshake=False)

    def accept(self, reply: Reply, authenticator: Authenticator) -> StreamSeal:
        """The stream's MACs, from the reducer's handshake reply.

        Raises:
            IntegrityError: the reply is not a handshake (it carries a chunk or a tag, no
                key, or the stream was not opened yet).
            HeaderError: its signature does not verify as the reducer's answer to our
                first message (``AuthenticationError`` included).
            KeyAgreementError: its key is unusable.
        """
        if reply.error:
            raise IntegrityError(reply.error)
        first = self.first_header
        if first is None or reply.handshake is None or not reply.stream_key:
            raise IntegrityError("the reducer's first reply is not a handshake")
        if reply.header is not None or reply.payload is not None or reply.covered is not None:
            raise IntegrityError("the reducer's handshake carries a chunk or a tag")
        digest = handshake_digest(bytes(first.nonce), reply.stream_key)
        authenticator.check_response(reply.handshake, REDUCE, digest, self._reducer_id)
        key = self._ephemeral.agree(
            reply.stream_key,
            transcript(
                self._sender_id,
                self._reducer_id,
                self._group_id,
                self._part,
                self._ephemeral.public,
                reply.stream_key,
            ),
        )
        return _seal_for(key, Direction.TO_REDUCER)


# ---- reducer side ----


def answer(
    first: Request, sender_id: bytes, signer: RequestSigner
) -> tuple[OutgoingChunk, StreamSeal]:
    """The handshake reply to a verified keyed first message from ``sender_id``, and the
    stream's MACs at the reducer.

    Raises:
        KeyAgreementError: the sender's key is unusable.
    """
    if first.header is None:
        raise ValueError("a keyed first message is answered after its header verified")
    ephemeral = EphemeralKey()
    key = ephemeral.agree(
        first.stream_key,
        transcript(
            sender_id,
            signer.peer_id,
            first.group_id,
            first.part_index,
            first.stream_key,
            ephemeral.public,
        ),
    )
    digest = handshake_digest(bytes(first.header.nonce), ephemeral.public)
    header = signer.sign_response(first.header, REDUCE, digest)
    return encode_handshake(header, ephemeral.public), _seal_for(key, Direction.TO_SENDER)


def resume(
    first: Request, sender_id: bytes, reducer_id: bytes, resumption: Resumption
) -> StreamSeal:
    """The MACs at the reducer of a resumed stream from ``sender_id`` whose verified first
    message names ``resumption``'s ticket: no handshake is written."""
    if first.header is None:
        raise ValueError("a resumed first message is answered after its header verified")
    key = resumed_key(
        resumption.secret,
        sender_id,
        reducer_id,
        first.group_id,
        first.part_index,
        first.stream_key + bytes(first.header.nonce),
        resumption.ticket,
    )
    return _seal_for(key, Direction.TO_SENDER, full_handshake=False)


async def checked_requests(
    requests: AsyncIterator[Request], mac: StreamMac
) -> AsyncIterator[Request]:
    """``requests`` with each one's tag checked: one that fails comes out with its
    ``error`` set (the round then drops its sender) and ends the stream."""
    async for request in requests:
        if not request.error:
            try:
                mac.check(request.covered, request.mac)
            except IntegrityError as e:
                request = dataclasses.replace(request, error=str(e))
        yield request
        if request.error:
            return


class SealingContext:
    """A reducer's stream context that appends this stream's tag to every reply, and
    marks an end before the stream's last average with a tagged ``end`` message.

    ``stripes`` > 0: every reply also says, under the tag, how many streams this reducer
    takes from one sender in a round (``ReduceResponse.stripes``; a sender that does not
    know the field skips it, and the tag covers it either way)."""

    def __init__(self, context: ReduceContext, mac: StreamMac, stripes: int = 0) -> None:
        self._context = context
        self._mac = mac
        self._stripes_field = stripes_field(stripes) if stripes > 0 else b""

    @property
    def writes_bounded(self) -> bool:
        """Whether the wrapped stream bounds each write itself (the data plane's does)."""
        return getattr(self._context, "writes_bounded", False) is True

    @property
    def replies(self) -> int:
        """Replies sealed so far (the ``end`` marker included, once written)."""
        return self._mac.sequence

    async def write(self, message: OutgoingChunk) -> None:
        if self._stripes_field:
            field = self._stripes_field
            message = OutgoingChunk((*message.pieces, field), message.nbytes + len(field))
        # Sealed at the moment of writing: tags follow the order replies take on the wire.
        await self._context.write(sealed(message, self._mac))

    async def end(self, reason: str) -> None:
        """Tell the sender, under the stream's tag, that this reducer ends the stream before
        its last average and why. Best effort, within :data:`STATUS_WAIT`: the status that
        follows is not authenticated, so without the marker the sender takes the end for one
        forged on the path or a cut connection (streams.py) and reports it as such."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(STATUS_WAIT):
                await self.write(encode_end(reason))

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        await self.end(f"{code.name}: {details}")
        await self._context.abort(code, details)
        raise RuntimeError("context.abort returned")
