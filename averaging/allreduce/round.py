"""One member's reducing side of one round: accumulate its part, return the average.

A :class:`ReducerRound` accumulates the senders' chunks of this member's part
(:class:`~swarmavg.averaging.allreduce.reducer.PartReducer`), and as soon as a chunk is final
it encodes the average once and streams the same bytes back to every sender (and decodes
them for itself), so all members end bit-identical. Senders reach it through
:class:`~swarmavg.averaging.allreduce.service.AllReduceService`, which checks who they are
first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
import numpy as np

from swarmavg.averaging.allreduce.buffers import BufferPool
from swarmavg.averaging.allreduce.chunking import chunk_seconds
from swarmavg.averaging.allreduce.config import MAX_STREAMS_PER_SENDER, AllReduceConfig
from swarmavg.averaging.allreduce.faults import FaultPlan, InjectedFault
from swarmavg.averaging.allreduce.partition import PartPlan
from swarmavg.averaging.allreduce.reducer import ContributionError, PartReducer
from swarmavg.averaging.allreduce.slow_senders import too_slow
from swarmavg.averaging.allreduce.wire import OutgoingChunk, Request, encode_response
from swarmavg.averaging.group import GroupInfo
from swarmavg.averaging.stalled import abort_stalled
from swarmavg.compression import Codec, CodecInfo
from swarmavg.dht.auth import RequestSigner
from swarmavg.dht.tasks import TaskSet

log = logging.getLogger(__name__)

_T = TypeVar("_T")

FIRST_CHUNK_CHUNKS = 4.0
"""The reducer waits this many chunk times (``chunking.chunk_seconds``) for a sender's first
chunk, and at least twice ``min_stall``."""
STALL_CHUNKS = 2.0
"""Between a sender's later chunks it waits at least this many chunk times."""
FIRST_REPLY_CHUNKS = 6.0
"""A sender waits this many chunk times for a reducer's first average (the chunk in from
every sender, then the average back), and at least three times ``min_stall``."""

ResultCallback = Callable[[int, np.ndarray, int], None]
"""Called with (chunk index, decoded averaged values, number of senders) on the loop."""


@dataclass
class Abort:
    """How the round ends a sender's stream when it cannot finish it (an error status)."""

    code: grpc.StatusCode
    details: str


def stream_chunks(num_chunks: int, stripe: int, stripes: int) -> int:
    """How many of a part's ``num_chunks`` chunks its sender's stream ``stripe`` of
    ``stripes`` carries (those whose index is ``stripe`` modulo ``stripes``)."""
    return len(range(stripe, num_chunks, max(stripes, 1)))


@dataclass
class _Stream:
    """One attached stream's outbound queue (replies as wire pieces, then ``None`` or an
    abort). A sender has one stream, or several (stripes) that each carry the chunks whose
    index is ``stripe`` modulo ``stripes`` and bring back their averages."""

    sender: int
    stripe: int = 0
    stripes: int = 1
    expected: int = 0
    """Chunks this stream carries."""
    delivered: int = 0
    """Of those, how many it delivered so far."""
    queue: asyncio.Queue[OutgoingChunk | Abort | None] = field(default_factory=asyncio.Queue)
    done: bool = False
    backlog: int = 0
    """Bytes of replies queued and not yet taken by the transport."""
    cut: bool = False
    """The sender fell :attr:`AllReduceConfig.max_reply_backlog` behind: nothing more is
    queued for it."""

    def carries(self, chunk: int) -> bool:
        """Whether ``chunk`` (its copy in, its average out) goes on this stream."""
        return chunk % self.stripes == self.stripe

    def put_reply(self, reply: OutgoingChunk, limit: int) -> bool:
        """Queue ``reply``, or cut the stream when that would exceed ``limit`` bytes
        (freeing what was queued); return whether it was queued."""
        if self.cut:
            return False
        if self.backlog + reply.nbytes > limit:
            self.cut = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.backlog = 0
            self.queue.put_nowait(
                Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "sender does not read its replies")
            )
            return False
        self.backlog += reply.nbytes
        self.queue.put_nowait(reply)
        return True


class ReduceContext(Protocol):
    """What a ``Reduce`` handler needs of its stream: gRPC's servicer context, or the
    data plane's stream (:mod:`~swarmavg.averaging.allreduce.data_server`)."""

    async def write(self, message: OutgoingChunk) -> None: ...

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn: ...


async def abort_stream(context: ReduceContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the stream with ``code``; ``context.abort`` raises, this says so to the checker."""
    await context.abort(code, details)
    raise RuntimeError("context.abort returned")


def decode_checked(codec: Codec, request: Request, size: int) -> tuple[np.ndarray, int, bool]:
    """Decode one inbound chunk that must hold ``size`` elements; return it, its bytes,
    and whether its values were checked for NaN/Inf (``none`` leaves that to the
    reducer's mean, which reads them anyway: ``PartReducer.add(defer_check=True)``).

    The declared codec and shape are checked before decoding, so a lying header costs
    nothing. The values may be a read-only view of the received bytes. Raises
    ``ContributionError`` for anything malformed.
    """
    header, payload = request.chunk, request.payload
    if header is None or payload is None:
        raise ContributionError("message carries no chunk")
    if not codec.accepts(header.codec):
        raise ContributionError(f"chunk uses codec {header.codec!r}, round uses {codec.name!r}")
    if header.shape != (size,):
        raise ContributionError(f"chunk declares shape {list(header.shape)}, expected [{size}]")
    try:
        values, checked = codec.decode_payload_unchecked(header, payload)
    except ValueError as e:  # CodecError derives from ValueError
        raise ContributionError(f"chunk does not decode: {e}") from e
    if values.shape != (size,):
        raise ContributionError(f"chunk decodes to shape {values.shape}, expected ({size},)")
    return values, request.nbytes, checked


def encode_result(
    codec: Codec,
    values: np.ndarray,
    info: CodecInfo,
    chunk: int,
    contributors: int,
    adjusted: int = 0,
    weights_clipped: int = 0,
) -> tuple[OutgoingChunk, np.ndarray]:
    """Encode an averaged chunk once; return the reply's wire pieces and its decoded values.

    The reducer keeps the values decoded from the very payload the senders receive, so
    every member ends bit-identical (decoding is deterministic).
    """
    # The codec gives the values that decoding its payload gives, without decoding it.
    encoded, decoded = codec.encode_payload_and_values(values, info)
    response = encode_response(encoded, chunk, contributors, adjusted, weights_clipped)
    return response, decoded


INLINE_ELEMENTS = 16384
"""Work on fewer elements than this (64 KiB of float32) runs on the loop even when there
is an executor: handing it to a thread costs more than the work (a futex wake, two context
switches and a wakeup of the loop, each way; a tiny round's daemon made ~200 futex calls
and ~270 context switches per round), and its kernels are over in microseconds."""


async def offload(
    executor: ThreadPoolExecutor | None,
    fn: Callable[..., _T],
    *args: Any,
    elements: int | None = None,
) -> _T:
    """Run CPU work (codecs, reduction) in ``executor``, or inline when it is ``None`` or
    the work covers fewer than :data:`INLINE_ELEMENTS` ``elements`` (None: unknown size)."""
    if executor is None or (elements is not None and elements < INLINE_ELEMENTS):
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


class ReducerRound:
    """This member's part of one round: accumulate, finalise, return (one per round).

    Owned by :func:`~swarmavg.averaging.allreduce.runner.run_allreduce`, which creates it,
    :meth:`start`\\ s it, waits for :attr:`finished` and always :meth:`close`\\ s it.
    """

    def __init__(
        self,
        group: GroupInfo,
        my_index: int,
        plan: PartPlan,
        dtype: np.dtype,
        codec: Codec,
        config: AllReduceConfig,
        executor: ThreadPoolExecutor | None,
        deadline: float,
        on_result: ResultCallback,
        fault_plan: FaultPlan | None = None,
        buffers: BufferPool | None = None,
        combiner: ThreadPoolExecutor | None = None,
        signer: RequestSigner | None = None,
    ) -> None:
        self.group = group
        self.signer = signer
        """Signs this reducer's handshakes of keyed streams (``None``: only unkeyed
        streams can be served)."""
        self.my_index = my_index
        self.plan = plan
        self.codec = codec
        self.config = config
        # One chunk's time at a stream's share of the slowest advertised link: a floor of
        # the stall detector's patience, so that a slow link is not taken for a dead sender.
        self._chunk_seconds = chunk_seconds(group.members, config.chunk_bytes)
        self.executor = executor
        # a robust rule's combination of a chunk: the service's combiner, else the executor
        self.combiner = combiner or executor
        self.deadline = deadline  # time.monotonic()
        self.on_result = on_result
        self.fault_plan = fault_plan
        self._buffers = buffers
        accumulator = None
        size = PartReducer.buffer_size(plan, my_index, len(set(group.senders)), group.rule)
        if buffers is not None and size:  # a robust rule's copies
            accumulator = buffers.take(size, dtype)
        self.reducer = PartReducer(
            plan, my_index, dtype, group.senders, group.rule, config.weight_bound, accumulator
        )
        self.start_time = time.monotonic()
        budget = max(deadline - self.start_time, 0.0)
        self.reduce_deadline = deadline - min(config.finalize_margin, budget / 10)
        self.streams: dict[tuple[int, int], _Stream] = {}
        """Attached streams by (sender, stripe)."""
        self._openings: dict[int, tuple[int, float]] = {}
        """Per attached sender: how many streams it opens and the weight they announce."""
        self.dropped: dict[int, str] = {}
        self.bytes_received = 0
        self.bytes_sent = 0
        self.returned = 0
        self.adjusted = 0
        """Inputs the robust rule clipped or trimmed, over the chunks returned so far."""
        self._final: asyncio.Queue[int] = asyncio.Queue()
        self._tasks = TaskSet()
        self._progress: dict[int, float] = dict.fromkeys(group.senders, self.start_time)
        # when each remote sender's first and last chunk arrived (slow_senders)
        self._first_chunk: dict[int, float] = {}
        self._last_chunk: dict[int, float] = {}
        self._remote_senders = len(set(group.senders) - {my_index})
        self._all_returned = asyncio.Event()
        self.finished = asyncio.Event()
        """Set when every chunk was returned and every attached stream got all of them, or
        when one of the round's tasks failed (see :attr:`errors`)."""
        self.closed = False
        self.errors: list[str] = []
        """Failures of this round's own tasks, with their cause (also logged)."""

    # ---- lifecycle (called by the runner) ----

    def start(self) -> None:
        """Start the emitter and the watchdog (owned by this round, stopped by close)."""
        self._tasks.spawn(self._guard(self._emit(), "returning averaged chunks"), name="emit")
        self._tasks.spawn(self._guard(self._watchdog(), "the stall watchdog"), name="watchdog")

    async def _guard(self, work: Coroutine[Any, Any, None], what: str) -> None:
        """Run one of the round's tasks; a failure is logged with its cause, recorded in
        :attr:`errors` (the runner puts it in the round's result) and ends every stream
        with ``INTERNAL``, so that the senders stop waiting and the part counts as not
        averaged, instead of the round stalling to its deadline with nothing said."""
        try:
            await work
        except Exception as e:
            reason = f"{what} failed: {e!r}"
            log.error("round %s: %s", self.group.group_id.hex(), reason, exc_info=e)
            self.errors.append(reason)
            for stream in self.streams.values():
                stream.queue.put_nowait(Abort(grpc.StatusCode.INTERNAL, reason))
            self.finished.set()

    async def close(self, abort: Abort | None = None) -> None:
        """Stop the round: end every stream (with ``abort``, or OK) and stop its tasks.

        Idempotent. Streams that already received every chunk end with OK whatever
        ``abort`` says.
        """
        if self.closed:
            return
        self.closed = True
        for stream in self.streams.values():
            stream.queue.put_nowait(abort)
        await self._tasks.close()
        # release() refuses any later add() and any later combination of a robust rule's
        # copies (and keeps the buffer from the pool while one runs), so the next round
        # may take it now.
        accumulator = self.reducer.release()
        if accumulator is not None and self._buffers is not None:
            self._buffers.give(accumulator)

    # ---- contributions ----

    def set_local_weight(self, weight: float) -> None:
        """Announce this member's own weight (before :meth:`add_local`)."""
        self._queue_final(self.reducer.set_weight(self.my_index, weight))

    def add_local(self, chunk: int, values: np.ndarray) -> None:
        """Accumulate this member's own (codec round-tripped) copy of ``chunk``."""
        finite = self.codec.decodes_finite
        self._queue_final(self.reducer.add(self.my_index, chunk, values, finite=finite))

    def drop(self, sender: int, reason: str) -> None:
        """Stop waiting for ``sender``; its weight renormalises away from chunks it owes."""
        if sender in self.reducer.live_senders and not self.closed:
            log.info("round %s: dropping member %d: %s", self.group.group_id.hex(), sender, reason)
            self.dropped.setdefault(sender, reason)
            self._queue_final(self.reducer.drop(sender))

    def _drop_rejected(self) -> None:
        """Drop the senders whose copies failed the check the mean made as it read them,
        as a chunk that fails on arrival drops its sender."""
        for sender, reason in self.reducer.rejected.items():
            if sender in self.dropped or self.closed:
                continue
            self.drop(sender, reason)
            for stream in self.streams.values():
                if stream.sender == sender:
                    stream.queue.put_nowait(Abort(grpc.StatusCode.INVALID_ARGUMENT, reason))

    def _queue_final(self, chunks: list[int]) -> None:
        for chunk in chunks:
            self._final.put_nowait(chunk)

    # ---- serving one sender ----

    async def serve(
        self,
        sender: int,
        first: Request,
        requests: AsyncIterator[Request],
        context: ReduceContext,
    ) -> None:
        """Run one of an attached sender's streams until the round returned every chunk it
        carries (every chunk, for a sender's only stream)."""
        if self.closed:
            await abort_stream(context, grpc.StatusCode.FAILED_PRECONDITION, "round is over")
        stripes = max(first.stripes, 1)
        stripe = first.stripe
        if (sender, stripe) in self.streams:
            await abort_stream(
                context, grpc.StatusCode.ALREADY_EXISTS, "sender is already attached"
            )
        if sender in self.dropped or sender not in self.reducer.live_senders:
            await abort_stream(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"sender was dropped from this part: {self.dropped.get(sender, 'not a sender')}",
            )
        most = min(MAX_STREAMS_PER_SENDER, max(self.reducer.num_chunks, 1))
        known = self._openings.get(sender)
        if not (stripe < stripes <= most):
            reason = f"stream {stripe} of {stripes}: a part of this round takes 1 to {most}"
        elif known is not None and known != (stripes, first.weight):
            reason = "its streams disagree on their number or on its weight"
        else:
            reason = ""
        if reason:
            self.drop(sender, reason)
            await abort_stream(context, grpc.StatusCode.INVALID_ARGUMENT, reason)
        if known is None:
            try:
                self._queue_final(self.reducer.set_weight(sender, first.weight))
            except ContributionError as e:
                self.drop(sender, str(e))
                await abort_stream(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self._openings[sender] = (stripes, first.weight)
        expected = stream_chunks(self.reducer.num_chunks, stripe, stripes)
        stream = _Stream(sender, stripe, stripes, expected)
        self.streams[(sender, stripe)] = stream
        # Chunks finalised without this sender (it was too late) cannot happen: a live
        # sender blocks finalisation. So the stream starts with nothing to catch up on.
        reader = asyncio.get_running_loop().create_task(self._read(stream, first, requests))
        # The data plane bounds each write by write_timeout itself, and only where it waits.
        bounded = getattr(context, "writes_bounded", False) is True
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    return
                if isinstance(item, Abort):
                    if stream.cut:
                        self.drop(sender, item.details)
                    await abort_stream(context, item.code, item.details)
                stream.backlog -= item.nbytes
                try:
                    # Neither gRPC's context.write nor a socket has a deadline of its own:
                    # a sender that stops reading would hold this stream, and the round's
                    # memory, for ever.
                    if bounded:
                        await context.write(item)
                    else:
                        async with asyncio.timeout(self.config.write_timeout):
                            await context.write(item)
                except TimeoutError:
                    reason = f"sender read no reply for {self.config.write_timeout:.1f}s"
                    self.drop(sender, reason)
                    await abort_stalled(context, grpc.StatusCode.DEADLINE_EXCEEDED, reason)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            if stream.delivered < stream.expected:
                self.drop(sender, "stream ended early")
            stream.done = True
            self._check_finished()

    async def _read(
        self,
        stream: _Stream,
        first: Request,
        requests: AsyncIterator[Request],
    ) -> None:
        sender = stream.sender
        try:
            if first.chunk is not None:
                await self._accept(stream, first)
            async for request in requests:
                if request.error:
                    raise ContributionError(request.error)
                if request.names_round:
                    raise ContributionError("only the first message may name the round")
                await self._accept(stream, request)
        except ContributionError as e:
            self.drop(sender, str(e))
            stream.queue.put_nowait(Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
            return
        except Exception as e:  # a broken stream or a stopped executor: lose this sender only
            self.drop(sender, f"stream failed: {e!r}")
            return
        if stream.delivered < stream.expected:
            self.drop(sender, "sender closed its stream before its last chunk")

    async def _accept(self, stream: _Stream, request: Request) -> None:
        sender = stream.sender
        chunk = request.chunk_index
        if chunk >= self.reducer.num_chunks:
            raise ContributionError(f"chunk index {chunk} out of range")
        if not stream.carries(chunk):
            raise ContributionError(
                f"chunk {chunk} on stream {stream.stripe} of {stream.stripes}, not its own"
            )
        start, end = self.plan.chunk_bounds(self.my_index, chunk)
        values, nbytes, checked = await offload(
            self.executor, decode_checked, self.codec, request, end - start, elements=end - start
        )
        self.bytes_received += nbytes
        if sender not in self.reducer.live_senders or self.closed:
            # Dropped while decoding (too slow), or the round closed and handed its
            # buffer on: late chunks are ignored.
            return
        added = self.reducer.add(sender, chunk, values, finite=checked, defer_check=True)
        stream.delivered += 1
        self._queue_final(added)
        now = time.monotonic()
        self._progress[sender] = now
        self._first_chunk.setdefault(sender, now)
        if self.reducer.delivered(sender) == self.reducer.num_chunks:
            self._last_chunk[sender] = now

    # ---- output ----

    def _encode_result(
        self, chunk: int, values: np.ndarray, contributors: int, adjusted: int, finite: bool
    ) -> tuple[OutgoingChunk, np.ndarray]:
        """Encode a combined chunk; ``finite``: the reducer checked it as it was written."""
        start, end = self.plan.bounds[self.my_index]
        chunk_start, chunk_end = self.plan.chunk_bounds(self.my_index, chunk)
        # One stable key per chunk of the tensors' flat layout: a stateful codec adds each
        # chunk's residual from the last round to the same chunk (two-way error feedback),
        # never to another chunk.
        schema = self.group.schema_hash.hex()[:16]
        info = CodecInfo(
            key=f"{schema}/average[{start + chunk_start}:{start + chunk_end}]",
            part_index=self.my_index,
            part_size=end - start,
            reduced=True,
            finite=finite,
        )
        return encode_result(
            self.codec,
            values,
            info,
            chunk,
            contributors,
            adjusted,
            self.reducer.weights_clipped,
        )

    def _combine_and_encode(
        self, chunk: int, contributors: int
    ) -> tuple[OutgoingChunk, np.ndarray | None, int]:
        """A robust rule's combination of a final chunk, then its encoding (one worker)."""
        values, adjusted = self.reducer.aggregate(chunk)
        if values is None:
            return encode_response(None, chunk, 0), None, 0
        response, decoded = self._encode_result(chunk, values, contributors, adjusted, False)
        return response, decoded, adjusted

    async def _reply_for(self, chunk: int) -> OutgoingChunk:
        """The reply to a final chunk; hands its decoded values to ``on_result``."""
        decoded: np.ndarray | None
        try:
            if self.reducer.aggregation.robust:  # heavier than a division: off the loop
                contributors = self.reducer.contributors(chunk)
                response, decoded, adjusted = await offload(
                    self.combiner, self._combine_and_encode, chunk, contributors
                )
            else:
                # the mean: one pass over the chunk's copies that also checks them (where
                # the kernels are built), on the loop
                values, finite = self.reducer.mean(chunk)
                self._drop_rejected()
                contributors = self.reducer.contributors(chunk)
                adjusted = 0
                if values is None:
                    return encode_response(None, chunk, 0)
                response, decoded = await offload(
                    self.executor,
                    self._encode_result,
                    chunk,
                    values,
                    contributors,
                    adjusted,
                    finite,
                    elements=values.size,
                )
        except ValueError as e:
            # Only copies at the edge of the dtype's range can overflow the combination
            # (weights are bounded): the senders keep their own values for this chunk
            # rather than the emitter dying and the part stalling to the deadline.
            log.warning(
                "round %s: chunk %d of part %d cannot be encoded, returned empty: %s",
                self.group.group_id.hex(),
                chunk,
                self.my_index,
                e,
            )
            return encode_response(None, chunk, 0)
        if decoded is None:
            return response
        self.adjusted += adjusted
        self.on_result(chunk, decoded, contributors)
        return response

    async def _emit(self) -> None:
        while self.returned < self.reducer.num_chunks:
            chunk = await self._final.get()
            if self.fault_plan is not None and self.fault_plan.reducer_raises(self.returned):
                raise InjectedFault(f"reducer fails at chunk {self.returned} (fault plan)")
            if self.fault_plan is not None and self.fault_plan.stops_reducing(self.returned):
                await asyncio.Event().wait()  # stalled reducer: hold every stream open
            response = await self._reply_for(chunk)
            limit = self.config.max_reply_backlog
            for stream in self.streams.values():
                # A chunk goes back on the stream that brought the sender's copy: that
                # stream is attached (a chunk is final only once every live sender
                # delivered it).
                if stream.carries(chunk) and stream.put_reply(response, limit):
                    self.bytes_sent += response.nbytes
            self.returned += 1
        self._all_returned.set()
        for stream in self.streams.values():
            if not stream.cut:
                stream.queue.put_nowait(None)
        self._check_finished()

    def _check_finished(self) -> None:
        if self._all_returned.is_set() and all(s.done for s in self.streams.values()):
            self.finished.set()

    async def _watchdog(self) -> None:
        """Drop senders that stall, and everyone still owing chunks at the deadline."""
        tick = max(0.01, min(self.config.min_stall / 4, 0.25))
        while not self.reducer.done:
            now = time.monotonic()
            if now >= self.reduce_deadline:
                for sender in sorted(self.reducer.live_senders):
                    self.drop(sender, "round deadline")
                return
            for sender in sorted(self.reducer.live_senders):
                if sender == self.my_index:
                    continue
                delivered = self.reducer.delivered(sender)
                if delivered == self.reducer.num_chunks:
                    continue
                last = self._progress[sender]
                if delivered:
                    mean_interval = (last - self.start_time) / delivered
                    patience = max(
                        self.config.min_stall,
                        self.config.stall_factor * mean_interval,
                        STALL_CHUNKS * self._chunk_seconds,
                    )
                else:
                    # The first chunk crosses the link while every other stream of the round
                    # starts too (1 MiB to each of 3 reducers is 2.5 s at 10 Mbit/s). Kept
                    # below the senders' patience for a first reply (3 x min_stall, or
                    # FIRST_REPLY_CHUNKS chunk times), so that they still get this part
                    # averaged without the silent one.
                    patience = max(
                        2 * self.config.min_stall, FIRST_CHUNK_CHUNKS * self._chunk_seconds
                    )
                if now - last > patience:
                    self.drop(sender, f"no chunk for {now - last:.1f}s")
            # The patience above follows each sender's own pace, which a sender that
            # trickles chooses: its progress is also bounded against the other senders'.
            slow = too_slow(
                now,
                self._first_chunk,
                self._last_chunk,
                self._remote_senders,
                self.config.slow_sender_factor,
                max(self.config.min_stall, STALL_CHUNKS * self._chunk_seconds),
            )
            for sender, reason in sorted(slow.items()):
                self.drop(sender, reason)
            await asyncio.sleep(min(tick, max(self.reduce_deadline - now, 0.0)))
