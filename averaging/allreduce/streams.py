"""One ``Reduce`` stream per remote part: this member's chunks out, the averages back.

For every other member's part, :meth:`PartStreams.exchange_part` opens a stream to its
reducer (over the reducer's data plane when it serves one and we can reach it, else over
gRPC) and keys it (keyed_stream.py: a signed opening, the reducer's signed handshake
reply, then a tag on every message either way). It writes our chunks from one task while
it reads the averaged chunks as they come, checks each one's tag, and hands it on
(:class:`~swarmavg.averaging.allreduce.replies.ResultAssembly` checks and stores them), and
ends by the round's deadline or when the reducer stalls: every read waits at most a
patience derived from the progress observed so far. A failure leaves the missing chunks
with this member's local values; nothing here raises but ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from typing import Protocol

import grpc

from swarmavg.averaging.allreduce.chunking import chunk_seconds
from swarmavg.averaging.allreduce.data_connector import DataCall, DataStreamError
from swarmavg.averaging.allreduce.faults import FaultPlan
from swarmavg.averaging.allreduce.keyed_stream import SenderHandshake, StreamSeal
from swarmavg.averaging.allreduce.outgoing import Contribution
from swarmavg.averaging.allreduce.replies import ResultAssembly
from swarmavg.averaging.allreduce.round import FIRST_REPLY_CHUNKS
from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.allreduce.stream_keys import KeyAgreementError
from swarmavg.averaging.allreduce.stream_mac import IntegrityError
from swarmavg.averaging.allreduce.wire import OutgoingChunk, serialize_pieces
from swarmavg.averaging.stubs import reduce_method
from swarmavg.dht.identity import HeaderError
from swarmavg.dht.ranges import split_host

log = logging.getLogger(__name__)

__all__ = ["ChannelSource", "PartStreams"]


class ChannelSource(Protocol):
    """Where the runner gets channels (``swarmavg.dht.ChannelPool`` fits)."""

    def channel(self, address: str, peer_id: bytes | None = None) -> grpc.aio.Channel: ...


class _Outcome(enum.Enum):
    """How one ``Reduce`` stream to a reducer ended."""

    DONE = "done"
    """Finished, failed or gave up: whatever came back is kept, the rest stays local."""
    REFUSED = "refused"
    """``RESOURCE_EXHAUSTED`` before any reply: the reducer's data plane is full."""
    NOT_STARTED = "not started"
    """``NOT_FOUND`` before any reply: the reducer has no round of this group (yet)."""
    RESUME_REFUSED = "resumption refused"
    """``UNAUTHENTICATED`` before any reply to a resumed stream: the reducer holds no such
    secret (restarted, evicted, expired); nothing was processed."""


def _not_started_pause(attempt: int, registration_wait: float) -> float:
    """Seconds before asking again a reducer that has not started the round.

    Its service already held each stream up to ``registration_wait`` before refusing it,
    so the pause only spreads the group's senders: short, jittered, growing a little.
    """
    base = min(0.05 * 2.0 ** min(attempt, 6), max(registration_wait, 0.05))
    return base * random.uniform(0.5, 1.5)


class PartStreams:
    """This member's streams to the reducers of the other parts in one round.

    Args:
        contribution: codes our chunks.
        assembly: checks and stores the averages that come back.
        deadline: ``time.monotonic()`` instant by which every stream ends.
        service: this daemon's all-reduce service (settings, data-plane connector).
        channels: gRPC channels to the reducers.
        fault_plan: test seam; ``None`` in production.
    """

    def __init__(
        self,
        contribution: Contribution,
        assembly: ResultAssembly,
        deadline: float,
        service: AllReduceService,
        channels: ChannelSource,
        fault_plan: FaultPlan | None,
    ) -> None:
        self.contribution = contribution
        self.assembly = assembly
        self.group = contribution.side.group
        self.my_index = contribution.side.my_index
        self.plan = contribution.side.plan
        self.deadline = deadline
        self.service = service
        self.config = service.config
        self.channels = channels
        self.fault_plan = fault_plan
        self.crashed = asyncio.Event()  # the fault plan crashed this member
        # per part, which of its chunks were given to their stream
        self.handed = {j: [False] * self.plan.num_chunks(j) for j in range(self.group.size)}
        self.chunk_seconds = chunk_seconds(self.group.members, self.config.chunk_bytes)
        """One chunk's time at a stream's share of the slowest advertised link."""
        self.bytes_sent = 0

    def stripes_for(self, part: int) -> int:
        """How many streams to open to the reducer of ``part``: ``streams_per_reducer``
        where the reducer said, on a stream keyed with the secret ours will resume, that it
        takes that many, its data plane is ours to use and the part has that many chunks;
        else one."""
        member = self.group.members[part]
        resumption = self.service.resumptions.for_reducer(member.peer_id)
        connector = self.service.data_connector
        if resumption is None or not member.data_port or connector is None:
            return 1
        if not connector.reachable(split_host(member.address or ""), member.data_port):
            return 1
        wanted = min(self.config.streams_per_reducer, resumption.stripes)
        return max(1, min(wanted, self.plan.num_chunks(part)))

    async def exchange_part(self, part: int) -> None:
        """Stream our chunks of ``part`` to its reducer, over one stream or several
        (:meth:`stripes_for`); store what comes back.

        Never raises (except CancelledError): a failure leaves the missing chunks local.
        """
        address = self.group.members[part].address
        if address is None:  # GroupInfo guarantees reducers have one; keep mypy honest
            return
        if self.fault_plan is not None and self.fault_plan.crashes(0):
            self.crashed.set()  # before connecting: a crash at the start sends nothing
            return
        stripes = self.stripes_for(part)
        if stripes == 1:
            await self._exchange_stripe(part, address, 0, 1)
            return
        async with asyncio.TaskGroup() as streams:  # none raises: a failure stays local
            for stripe in range(stripes):
                streams.create_task(self._exchange_stripe(part, address, stripe, stripes))

    async def _exchange_stripe(self, part: int, address: str, stripe: int, stripes: int) -> None:
        """One stream of our chunks of ``part`` (those whose index is ``stripe`` modulo
        ``stripes``) to its reducer, asked again while the reducer has not started the
        round. Never raises (except CancelledError)."""
        # Members learn that their group formed at different times (a follower checks the
        # leader's member list against the declarations it reads from a busy DHT first),
        # and a reducer's service waits only `registration_wait` for its round to start.
        # A reducer that has not started yet is asked again, within the patience we give
        # any reducer: at 256 peers, a group's senders gave up on the 3 members that came
        # 3-8 s late, and all 16 ended with partial results (seen in benchmarks/scale.py
        # runs). Nothing was processed by a reducer that had no round: not a duplicate.
        asked = time.monotonic()
        give_up = asked + self._reply_patience(asked, 0)
        attempt = 0
        stream = (stripe, stripes)
        while True:
            call = await self._open_call(part, address)
            outcome = await self._exchange(part, address, call, stream)
            if outcome is _Outcome.RESUME_REFUSED:
                # Its secret is forgotten here too: the same stream with a full handshake.
                call = await self._open_call(part, address)
                outcome = await self._exchange(part, address, call, stream)
            if outcome is _Outcome.REFUSED and isinstance(call, DataCall):
                # Refused before the stream started (the reducer's data plane is full, or
                # holds as many of our streams waiting for the round as it lets one peer):
                # nothing we sent was processed, so the same stream over gRPC is not a
                # duplicate.
                log.info("part %d: %s refused a data-plane stream; using gRPC", part, address)
                connector = self.service.data_connector
                if connector is not None and stripe == 0:  # the others: our own streams' count
                    connector.refused(split_host(address), self.group.members[part].data_port)
                grpc_call = self._grpc_call(part, address)
                outcome = await self._exchange(part, address, grpc_call, stream)
            if outcome is not _Outcome.NOT_STARTED:
                return
            attempt += 1
            pause = _not_started_pause(attempt, self.config.registration_wait)
            if time.monotonic() + pause >= min(give_up, self.deadline):
                log.info(
                    "part %d: %s never started this round in %.1fs, keeping local values",
                    part,
                    address,
                    time.monotonic() - asked,
                )
                return
            log.info("part %d: %s has not started this round yet; asking again", part, address)
            await asyncio.sleep(pause)

    async def _open_call(self, part: int, address: str) -> grpc.aio.StreamStreamCall | DataCall:
        """A ``Reduce`` stream to the reducer of ``part``: over its data plane when it
        serves one and we can reach it, else over gRPC."""
        member = self.group.members[part]
        connector = self.service.data_connector
        if member.data_port and connector is not None:
            remaining = self.deadline - time.monotonic()
            call = await connector.open(
                split_host(address), member.data_port, remaining, address, member.peer_id
            )
            if call is not None:
                return call
        return self._grpc_call(part, address)

    def _grpc_call(self, part: int, address: str) -> grpc.aio.StreamStreamCall:
        # The reducer's own credential, in a private run: not any member on its address.
        method = reduce_method(self.channels.channel(address, self.group.members[part].peer_id))
        return method(timeout=max(self.deadline - time.monotonic(), 0.001))

    def _reply_patience(self, started: float, replies: int) -> float:
        mean = (time.monotonic() - started) / replies if replies else 0.0
        floor = max(
            3 * self.config.min_stall,
            self.config.registration_wait,
            FIRST_REPLY_CHUNKS * self.chunk_seconds,
        )
        return max(floor, self.config.stall_factor * mean)

    async def _send_part(
        self,
        part: int,
        call: grpc.aio.StreamStreamCall | DataCall,
        handshake: SenderHandshake,
        seal: asyncio.Future[StreamSeal],
        stream: tuple[int, int],
    ) -> None:
        stripe, stripes = stream
        opening = self.contribution.opening(handshake, stripe, stripes)
        if handshake.resumption is not None and not seal.done():
            seal.set_result(handshake.resumed_seal())  # resumed: no handshake to wait for
        await self._write(call, opening)
        # No chunk goes before the stream's key is known (the reducer's handshake, or the
        # resumed secret): every chunk carries a tag under it.
        mac = (await seal).outbound
        for chunk in range(stripe, self.plan.num_chunks(part), stripes):
            if self.fault_plan is not None:
                if self.fault_plan.crashes(chunk):
                    self.crashed.set()
                    await asyncio.Event().wait()
                if self.fault_plan.stops_sending(chunk):
                    await asyncio.Event().wait()  # a stalled sender: the stream stays open
            request = await self.contribution.request(part, chunk, mac)
            if request is None:
                return  # our values refused coding: the round ends and cancels this stream
            # Counted before the write: a reply may come back before the write returns.
            self.handed[part][chunk] = True
            await self._write(call, request)
        await call.done_writing()

    async def _write(
        self, call: grpc.aio.StreamStreamCall | DataCall, request: OutgoingChunk
    ) -> None:
        if isinstance(call, DataCall):
            await call.write_pieces(request.pieces)  # no join: the socket takes pieces
        else:
            await call.write(serialize_pieces(request))
        self.bytes_sent += request.nbytes

    def _ended_early(
        self, part: int, address: str, seal: asyncio.Future[StreamSeal], answered: bool, how: str
    ) -> None:
        """The stream to the reducer of ``part`` ended before its last average, with no
        ``end`` marker under its tag: the missing chunks stay local. Before a full
        handshake nothing is tagged yet (a refusal, a reducer not started, a failed
        connection): logged. Once the stream's key is known (the handshake, or at once for a
        resumed stream), an end the reducer chooses comes tagged, so this one was forged on
        the path, the connection was cut, or the reducer refused a resumed stream before
        taking it (its refusals are not tagged): the result says so."""
        if not seal.done() or seal.cancelled() or seal.exception() is not None:
            log.info("part %d: stream to %s ended before its handshake: %s", part, address, how)
            return
        why = "forged on the path, or the connection was cut"
        if not answered:  # a resumed stream the reducer may have refused before taking it
            why += ", or the reducer refused the stream"
        self.assembly.end_unconfirmed(
            part,
            f"the stream ended before its last average with no end under its tag ({how}): {why}",
        )

    async def _exchange(
        self,
        part: int,
        address: str,
        call: grpc.aio.StreamStreamCall | DataCall,
        stream: tuple[int, int] = (0, 1),
    ) -> _Outcome:
        """Run one ``Reduce`` stream for ``part`` (``stream``: which of how many to its
        reducer, by chunk index modulo their number); say whether the reducer refused it
        before starting it. Never raises (except CancelledError)."""
        loop = asyncio.get_running_loop()
        stripe, stripes = stream
        num_chunks = len(range(stripe, self.plan.num_chunks(part), stripes))
        reducer_id = self.group.members[part].peer_id
        resumptions = self.service.resumptions
        handshake = self.contribution.handshake(part, resumptions.for_reducer(reducer_id))
        resumed = handshake.resumption is not None
        ticket = handshake.resumption.ticket if handshake.resumption is not None else b""
        seal: asyncio.Future[StreamSeal] = loop.create_future()
        sender = loop.create_task(self._send_part(part, call, handshake, seal, stream))
        started = time.monotonic()
        replies = 0
        answered = False  # the reducer's handshake, or a resumed stream's first tagged reply
        try:
            while replies < num_chunks:
                patience = self._reply_patience(started, replies)
                wait = min(patience, self.deadline - time.monotonic())
                try:
                    if isinstance(call, DataCall) and call.reply_ready and wait > 0:
                        response = await call.read()  # queued: no wait to bound
                    else:
                        async with asyncio.timeout(max(wait, 0.0)):
                            response = await call.read()
                except TimeoutError:
                    log.info(
                        "part %d: no reply from %s in %.1fs, keeping local values",
                        part,
                        address,
                        wait,
                    )
                    return _Outcome.DONE
                if response is grpc.aio.EOF:
                    self._ended_early(part, address, seal, answered, "it ended with OK")
                    if isinstance(call, DataCall):
                        call.discard()  # the reducer's replies may still be on their way
                    return _Outcome.DONE
                if not resumed and not answered:
                    try:
                        keys = handshake.accept(response, self.service.authenticator)
                    except (HeaderError, IntegrityError, KeyAgreementError) as e:
                        self.assembly.distrust(part, f"its handshake failed: {e}")
                        return _Outcome.DONE
                    if keys.resumption is not None:
                        resumptions.remember_reducer(reducer_id, keys.resumption)
                        ticket = keys.resumption.ticket
                    seal.set_result(keys)
                    answered = True
                    continue
                try:
                    seal.result().inbound.check(response.covered, response.mac)
                except IntegrityError as e:
                    # Altered on the way or by the reducer: either way, not used.
                    self.assembly.distrust(part, str(e))
                    return _Outcome.DONE
                if ticket and not replies:
                    # Its word under the stream's tag, kept with the secret our next
                    # stream to it resumes with (an older reducer says nothing: one).
                    resumptions.note_stripes(reducer_id, ticket, max(response.stripes, 1))
                answered = True
                if response.end:
                    log.info(
                        "part %d: reducer %s ended the stream: %s", part, address, response.end
                    )
                    return _Outcome.DONE
                if response.chunk_index % stripes != stripe:
                    self.assembly.distrust(
                        part, f"chunk {response.chunk_index} came back on another stream"
                    )
                    return _Outcome.DONE
                replies += 1
                handed = self.handed[part]
                sent = response.chunk_index < len(handed) and handed[response.chunk_index]
                if not await self.assembly.accept_reply(part, response, sent):
                    return _Outcome.DONE
            if isinstance(call, DataCall):  # read its OK, so the connection can be reused
                await call.finish(min(1.0, max(self.deadline - time.monotonic(), 0.0)))
        except grpc.RpcError as e:
            known = isinstance(e, grpc.aio.AioRpcError | DataStreamError)
            code = e.code() if known else None
            # Only before the reducer answered (its handshake, or a resumed stream's first
            # tagged reply): after that, it has taken the stream, and a status that says
            # otherwise is not its word (nothing is believed untagged).
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED and not answered:
                return _Outcome.REFUSED
            if code is grpc.StatusCode.NOT_FOUND and not answered:
                return _Outcome.NOT_STARTED
            # A resumed gRPC stream writes its chunks without waiting for an answer; when
            # the reducer refuses it meanwhile, grpc.aio may report the write that failed
            # after the reducer's status as INTERNAL ("Internal error from Core") instead
            # of that status (grpc/grpc#36066): under load, 7 of 60 runs of a round after
            # a reducer's restart kept a part local. Whatever the status was, the reducer
            # answered nothing; the stream again with a full handshake gets a status it can
            # trust (its sender writes nothing more before the reducer answers), and chunks
            # the reducer did take meanwhile are refused there as duplicates.
            aio_masked = code is grpc.StatusCode.INTERNAL and not isinstance(call, DataCall)
            if (code is grpc.StatusCode.UNAUTHENTICATED or aio_masked) and resumed and not answered:
                if handshake.resumption is not None:  # always, when resumed (for mypy)
                    resumptions.forget_reducer(reducer_id, handshake.resumption.ticket)
                return _Outcome.RESUME_REFUSED
            details = e.details() if known else str(e)
            self._ended_early(part, address, seal, answered, f"it failed: {code} {details}")
        finally:
            sender.cancel()
            try:
                await sender
            # InvalidStateError: grpc.aio's answer to a write cancelled after the reducer
            # had already ended the call (the round is over for this stream either way).
            except (asyncio.CancelledError, asyncio.InvalidStateError, grpc.RpcError):
                pass
            except Exception:  # the stream is gone either way; keep the round alive
                log.exception("part %d: sending to %s failed", part, address)
            call.cancel()
        return _Outcome.DONE
