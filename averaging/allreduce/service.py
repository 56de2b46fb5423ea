"""The daemon-wide reducer service: routes inbound ``Reduce`` streams to local rounds.

One :class:`AllReduceService` per daemon receives every inbound ``Reduce`` stream, over gRPC
or the data plane, and hands it to the :class:`~swarmavg.averaging.allreduce.round.ReducerRound`
of its group, which the local runner registered when its round started.

Hostile input never reaches the accumulator: the header, the group id, the sender's
membership, the part index, the weight, the codec, each chunk's index and size, its
dtype and its values (NaN/Inf) are checked first, and a sender that breaks a rule is cut
off with an error status. Only that sender's stream ends; the round goes on without it.

Before a stream serves a round it costs this peer a handler and, while it waits for its
group to start here, a waiting slot; neither is free for the sender to hold:

* its first message must come within ``first_message_timeout`` (a silent stream is cut);
* the streams of one address range (its connection's, :mod:`swarmavg.dht.ranges`) not yet
  serving a round are at most ``max_pending_per_range``; more are refused at once, before
  anything is read, so one network holds few handlers of the server's pool;
* a stream for a group not started here waits at most ``registration_wait``, in a slot
  counted against ``max_waiting_streams`` in all, ``max_waiting_per_range`` per address
  range and ``max_waiting_per_peer`` per verified sender: identities are free, networks
  are not, so one network at its limit leaves the other slots to honest members.

A keyed stream (its signed first message carries the sender's stream key) is answered with
the reducer's signed handshake once the sender is known to be a member, and from there every
chunk must carry a valid MAC and every reply carries one (keyed_stream.py): nothing on the
path can alter, replay, reorder or drop a message unnoticed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from swarmavg.averaging.allreduce.admission import ByteBudget
from swarmavg.averaging.allreduce.buffers import BufferPool
from swarmavg.averaging.allreduce.config import MAX_STREAMS_PER_SENDER, AllReduceConfig
from swarmavg.averaging.allreduce.congestion import check_congestion_control
from swarmavg.averaging.allreduce.data_connector import DataConnector
from swarmavg.averaging.allreduce.data_server import DataPlaneServer
from swarmavg.averaging.allreduce.keyed_stream import (
    SealingContext,
    StreamSeal,
    answer,
    checked_requests,
    resume,
)
from swarmavg.averaging.allreduce.round import (
    Abort,
    ReduceContext,
    ReducerRound,
    abort_stream,
    stream_chunks,
)
from swarmavg.averaging.allreduce.stream_keys import KeyAgreementError
from swarmavg.averaging.allreduce.stream_resume import ResumptionCache
from swarmavg.averaging.allreduce.wire import Request, reduce_digest
from swarmavg.averaging.errors import DataPlaneBindError
from swarmavg.averaging.gauge import Gauge
from swarmavg.averaging.stalled import abort_stalled
from swarmavg.averaging.stubs import REDUCE
from swarmavg.compression import Codec, canonical_name, get_codec
from swarmavg.dht.auth import Authenticator
from swarmavg.dht.identity import HeaderError
from swarmavg.dht.ranges import grpc_peer_host, limited_range, split_host
from swarmavg.dht.tls import PeerTLS
from swarmavg.proto import common_pb2

log = logging.getLogger(__name__)

_RECENT_ROUNDS = 256
_MEMBER_HOSTS = 1024
"""Hosts of the members of recent rounds kept for :meth:`AllReduceService.is_member_host`."""


def stream_host(context: object) -> str:
    """The host a ``Reduce`` stream's connection comes from ("" when unknown).

    A gRPC context says it in ``peer()``; a data-plane stream in ``peer_host()``.
    """
    peer_host = getattr(context, "peer_host", None)
    if callable(peer_host):
        return str(peer_host())
    peer = getattr(context, "peer", None)
    if callable(peer):
        try:
            return grpc_peer_host(str(peer()))
        except Exception:  # a test double's peer() that does not answer
            return ""
    return ""


class _Counted:
    """One stream's place in a per-key count, given back once (idempotent)."""

    __slots__ = ("_counter", "_key")

    def __init__(self, counter: collections.Counter[str], key: str | None) -> None:
        self._counter = counter
        self._key = key
        if key is not None:
            counter[key] += 1

    def release(self) -> None:
        key, self._key = self._key, None
        if key is not None:
            self._counter[key] -= 1
            if self._counter[key] <= 0:
                del self._counter[key]


class AllReduceService:
    """Routes inbound ``Reduce`` streams to the local rounds (one service per daemon).

    Create it inside the running loop; :meth:`close` when the daemon stops.
    """

    def __init__(
        self,
        authenticator: Authenticator,
        config: AllReduceConfig | None = None,
        tls: PeerTLS | None = None,
    ) -> None:
        """Args:
        authenticator: the daemon's check of inbound messages (its run, its peer id as
            the receiver, its replay cache); every stream's first message passes it.
        tls: the peer's TLS setup in a private run: the data plane's server and connections
            are then mutual TLS (None: plain TCP, a public run).
        config: timings and sizes of every round.

        Raises:
            CongestionControlError: ``config.congestion_control`` names an algorithm this
                kernel or process cannot use (a ``ValueError``; checked here, at start,
                rather than on the first connection of a round).
        """
        self.authenticator = authenticator
        self.run_id = authenticator.run_id
        self.config = config or AllReduceConfig()
        if self.config.congestion_control is not None and self.config.data_plane:
            check_congestion_control(self.config.congestion_control)
        self.executor: ThreadPoolExecutor | None = None
        if self.config.executor_threads > 0:
            self.executor = ThreadPoolExecutor(
                self.config.executor_threads, thread_name_prefix="swarmavg-allreduce"
            )
        self.combiner: ThreadPoolExecutor = self.executor or ThreadPoolExecutor(
            1, thread_name_prefix="swarmavg-combine"
        )
        """Where reducers run a robust rule's combination of a final chunk: the executor,
        or without one (codec work on the loop, machines of at most 2 cores) a thread of
        its own. A combination is 1-3 ms per MiB chunk, a thread hop tens of microseconds:
        off the loop, this member goes on receiving and sending while the kernels (GIL
        released) or numpy combine. No thread starts until a robust round needs it."""
        self._rounds: dict[bytes, ReducerRound] = {}
        self._recent: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._member_hosts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._registered = asyncio.Event()
        self._waiting = 0
        self._waiting_by_range: collections.Counter[str] = collections.Counter()
        self._waiting_by_peer: collections.Counter[str] = collections.Counter()
        self._pending_by_range: collections.Counter[str] = collections.Counter()
        self.waiting = Gauge()
        """Streams waiting for a group not started here (status, tests)."""
        self.refused = 0
        """Streams refused for a per-range, per-peer or total limit (status, tests)."""
        self.inbound = Gauge()
        """``Reduce`` streams being served now, over either transport (status, tests)."""
        self._closed = False
        self.bytes_per_element: dict[tuple[str, str], float] = {}
        self.buffers = BufferPool()
        """Reducers' accumulators, reused round after round (no page faults per round)."""
        self._codecs: collections.OrderedDict[str, Codec] = collections.OrderedDict()
        self.resumptions = ResumptionCache()
        """Secrets of keyed streams' full handshakes, for later streams between the same
        peers without one (stream_resume.py): this daemon's as a sender and as a reducer."""
        self._tls = tls
        self.data_connector: DataConnector | None = None
        if self.config.data_plane:
            self.data_connector = DataConnector(
                self.config.data_connect_timeout,
                self.config.data_retry_after,
                tls,
                hello_timeout=self.config.registration_wait,
                congestion_control=self.config.congestion_control,
            )
        self._data_server: DataPlaneServer | None = None
        self.data_port = 0
        """Port of this daemon's data plane (0: not serving one)."""

    async def start_data_plane(self, host: str) -> int:
        """Serve ``Reduce`` over framed TCP on ``host`` (and ``config.data_port``).

        Returns the port, or 0 when the data plane is disabled or cannot listen on a free
        port (logged: the peer then serves ``Reduce`` over gRPC only).

        Raises:
            DataPlaneBindError: the port was chosen (``data_port`` > 0) and cannot be bound:
                the user asked for that port, so a silent fallback would hide the mistake.
        """
        if not self.config.data_plane or self._closed or self._data_server is not None:
            return self.data_port
        server = DataPlaneServer(
            self, tls=self._tls, congestion_control=self.config.congestion_control
        )
        try:
            self.data_port = await server.start(host, self.config.data_port)
        except OSError as e:
            if self.config.data_port:
                port = self.config.data_port
                raise DataPlaneBindError(
                    f"the data plane cannot listen on {host}:{port} (--data-port {port}): "
                    f"{e.strerror or e}; choose another --data-port, 0 for a free one, or -1 "
                    "to turn the data plane off"
                ) from None
            log.warning(
                "data plane cannot listen on %s:%d (%s); serving Reduce over gRPC only",
                host,
                self.config.data_port,
                e,
            )
            return 0
        self._data_server = server
        log.info("data plane listening on %s:%d", host, self.data_port)
        return self.data_port

    @property
    def data_plane_budget(self) -> ByteBudget | None:
        """The data plane's byte budget for frame bodies (``None``: not serving one)."""
        return self._data_server.budget if self._data_server is not None else None

    def codec(self, name: str) -> Codec:
        """The daemon's one instance of codec ``name``, for the chunks it sends and returns.

        Kept across rounds because stateful codecs (``topk``) hold each chunk's
        error-feedback residual in the instance: a fresh instance per round would drop the
        residuals and turn error feedback into plain sparsification. Senders and the
        reducer's return path use distinct keys, so their residuals never mix.

        The name comes from the group's leader, a stranger: spellings of one codec share
        one instance (:func:`~swarmavg.compression.canonical_name`), and at most
        ``config.max_codec_instances`` are kept, least recently used first out (a round in
        flight keeps its own reference), so a leader that names a new codec every round
        cannot hold more than that many instances' residuals here.

        Raises:
            ValueError: unknown codec name.
        """
        key = canonical_name(name)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = get_codec(name)
            while len(self._codecs) > self.config.max_codec_instances:
                self._codecs.popitem(last=False)
        else:
            self._codecs.move_to_end(key)
        return codec

    @property
    def codec_instances(self) -> int:
        """Codec instances kept across rounds now (at most ``config.max_codec_instances``)."""
        return len(self._codecs)

    def register(self, round_: ReducerRound) -> None:
        """Make ``round_`` reachable by its group id (the runner calls this)."""
        if self._closed:
            raise RuntimeError("AllReduceService is closed")
        group_id = round_.group.group_id
        if group_id in self._rounds or group_id in self._recent:
            raise ValueError(f"group {group_id.hex()} already ran on this peer")
        self._rounds[group_id] = round_
        for member in round_.group.members:
            host = split_host(member.address or "")
            if host:
                self._member_hosts[host] = None
                self._member_hosts.move_to_end(host)
        while len(self._member_hosts) > _MEMBER_HOSTS:
            self._member_hosts.popitem(last=False)
        self._registered.set()
        self._registered = asyncio.Event()

    def is_member_host(self, host: str) -> bool:
        """Whether ``host`` is the address of a member of a round registered here lately:
        its data-plane connections then carry a member's streams (the first message of a
        resumed stream holds a chunk, which a slow link takes seconds to deliver, and may
        arrive before this peer's side of the round is registered)."""
        return bool(host) and host in self._member_hosts

    def unregister(self, round_: ReducerRound) -> None:
        """Forget ``round_``; later streams for its group are refused at once."""
        group_id = round_.group.group_id
        if self._rounds.get(group_id) is round_:
            del self._rounds[group_id]
        self._recent[group_id] = None
        while len(self._recent) > _RECENT_ROUNDS:
            self._recent.popitem(last=False)

    async def close(self) -> None:
        """Abort every round in flight and stop the worker threads. Idempotent."""
        self._closed = True
        rounds = list(self._rounds.values())
        await asyncio.gather(
            *(r.close(Abort(grpc.StatusCode.UNAVAILABLE, "peer is shutting down")) for r in rounds)
        )
        if self.data_connector is not None:
            self.data_connector.close()
        if self._data_server is not None:
            await self._data_server.close()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self.combiner is not self.executor:
            self.combiner.shutdown(wait=False, cancel_futures=True)

    async def _find_round(self, group_id: bytes, until: float) -> ReducerRound | None:
        while True:
            round_ = self._rounds.get(group_id)
            if round_ is not None or group_id in self._recent or self._closed:
                return round_
            remaining = until - time.monotonic()
            if remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._registered.wait(), remaining)

    def _authenticate(self, first: Request) -> bytes:
        """The sender of a stream, from its first message's signature (both transports carry
        the same bytes). Once per stream: later chunks cost no signature work.

        Raises:
            HeaderError: unsigned, copied, replayed, stale, for another reducer or group.
        """
        digest = reduce_digest(
            first.group_id,
            first.part_index,
            first.weight,
            first.chunk_index,
            first.stream_key,
            first.resume,
            first.stripe,
            first.stripes,
        )
        return self.authenticator.check(first.header or common_pb2.RequestHeader(), REDUCE, digest)

    async def rpc_reduce(
        self,
        request_iterator: AsyncIterator[Request],
        context: ReduceContext,
    ) -> None:
        """Serve one sender's ``Reduce`` stream (see the module docstring).

        Ends with OK once the sender got every averaged chunk of this part; otherwise
        aborts with INVALID_ARGUMENT (bad input), UNAUTHENTICATED (bad header),
        INVALID_ARGUMENT also when no first message came within ``first_message_timeout``;
        NOT_FOUND (no round of that group started here within ``registration_wait``),
        PERMISSION_DENIED (not a sender of the group), FAILED_PRECONDITION (round over,
        sender dropped), RESOURCE_EXHAUSTED (too many streams of its address range not
        serving a round yet, or waiting in all, of its range or of its sender), or
        UNAVAILABLE (this peer is shutting down).
        """
        until = time.monotonic() + self.config.registration_wait
        host = stream_host(context)
        # No address (a unix socket, a test double): the total limits only, as exempt ranges.
        source = limited_range(host, self.config.limit_local_ranges) if host else None
        if source is not None and (
            self._pending_by_range[source] >= self.config.max_pending_per_range
        ):
            # Nothing read, no await before the abort: the handler is free again at once.
            self.refused += 1
            await abort_stream(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many streams from address range {source} not serving a round yet",
            )
        iterator = request_iterator.__aiter__()
        pending = _Counted(self._pending_by_range, source)
        self.inbound.add(1)
        try:
            await self._serve_checked(iterator, context, until, source, pending)
        finally:
            pending.release()
            self.inbound.add(-1)

    def _waiting_refusal(self, source: str | None, peer_id: bytes) -> str | None:
        """Why a verified stream from ``source`` by ``peer_id`` may not wait for its
        group now (None: it may). No await between it and the count it checks."""
        config = self.config
        if self._waiting >= config.max_waiting_streams:
            return "too many pending streams"
        if source is not None and self._waiting_by_range[source] >= config.max_waiting_per_range:
            return f"too many pending streams from address range {source}"
        if self._waiting_by_peer[peer_id.hex()] >= config.max_waiting_per_peer:
            return "too many pending streams from this peer"
        return None

    async def _serve_checked(
        self,
        iterator: AsyncIterator[Request],
        context: ReduceContext,
        until: float,
        source: str | None,
        pending: _Counted,
    ) -> None:
        # The first message is read before any waiting slot is taken, within a short
        # deadline: a silent stream (64 of them fit on one HTTP/2 connection) costs only
        # its own place among its range's pending streams, and that briefly.
        first_wait = min(self.config.first_message_timeout, self.config.registration_wait)
        try:
            first = await asyncio.wait_for(iterator.__anext__(), first_wait)
        except (StopAsyncIteration, TimeoutError):
            first = None
        if first is None:
            await abort_stream(context, grpc.StatusCode.INVALID_ARGUMENT, "no first message")
        if first.error:
            await abort_stream(context, grpc.StatusCode.INVALID_ARGUMENT, first.error)
        try:
            peer_id = self._authenticate(first)
        except HeaderError as e:
            await abort_stream(context, grpc.StatusCode.UNAUTHENTICATED, str(e))
        if first.resume and not first.stream_key:
            await abort_stream(
                context, grpc.StatusCode.INVALID_ARGUMENT, "a resumed stream carries a stream key"
            )
        if first.stream_key and first.chunk is not None:
            # Only its naming fields are signed and it carries no tag: a chunk in it would
            # be the one message of the stream nothing covers.
            await abort_stream(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "a keyed stream's first message carries no chunk",
            )
        if not first.stream_key and self.config.keyed_streams_only:
            await abort_stream(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                "this peer serves keyed streams only: the first message carries no stream key",
            )
        round_ = self._rounds.get(first.group_id)
        if round_ is None and first.group_id not in self._recent and not self._closed:
            # Only a stream that passed the header check waits for its round, in a slot of
            # the total, of its address range and of its verified sender.
            refusal = self._waiting_refusal(source, peer_id)
            if refusal is not None:
                self.refused += 1
                await abort_stream(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            self._waiting += 1
            by_range = _Counted(self._waiting_by_range, source)
            by_peer = _Counted(self._waiting_by_peer, peer_id.hex())
            self.waiting.add(1)
            try:
                round_ = await self._find_round(first.group_id, until)
            finally:
                self._waiting -= 1
                by_range.release()
                by_peer.release()
                self.waiting.add(-1)
        if round_ is None and self._closed:
            await abort_stream(context, grpc.StatusCode.UNAVAILABLE, "this peer is shutting down")
        if round_ is None and first.group_id in self._recent:
            # Distinct from NOT_FOUND, which a sender takes for "not started yet" and asks
            # again (streams.py): a round that is over here will not start.
            await abort_stream(
                context, grpc.StatusCode.FAILED_PRECONDITION, "that round is over here"
            )
        if round_ is None:
            await abort_stream(context, grpc.StatusCode.NOT_FOUND, "unknown group id")
        sender = round_.group.index_of(peer_id)
        if sender is None or sender == round_.my_index or sender not in round_.group.senders:
            await abort_stream(
                context, grpc.StatusCode.PERMISSION_DENIED, "not a sender of this group"
            )
        if first.part_index != round_.my_index:
            await abort_stream(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"part {first.part_index} is not reduced here (this is part {round_.my_index})",
            )
        if not math.isfinite(first.weight):
            await abort_stream(context, grpc.StatusCode.INVALID_ARGUMENT, "weight is not finite")
        # A sender of a round here: bounded by the group from now on, not by its range.
        pending.release()
        admitted = getattr(context, "admitted", None)
        if callable(admitted):  # the data plane: charge its bytes to this member now
            admitted(peer_id)
        if not first.stream_key:
            await round_.serve(sender, first, iterator, context)
            return
        requests, sealing = await self._open_keyed(first, peer_id, round_, iterator, context)
        await round_.serve(sender, first, requests, sealing)
        if sealing.replies < stream_chunks(round_.reducer.num_chunks, first.stripe, first.stripes):
            # Ended with OK before the last average (the round closed): said under the
            # stream's tag, like any end the reducer chooses.
            await sealing.end("the round ended before this stream's last average")

    async def _open_keyed(
        self,
        first: Request,
        peer_id: bytes,
        round_: ReducerRound,
        iterator: AsyncIterator[Request],
        context: ReduceContext,
    ) -> tuple[AsyncIterator[Request], SealingContext]:
        """Answer a keyed stream's first message with this reducer's handshake (none for a
        resumed stream whose ticket is held here); return the stream's requests, each
        checked against its tag, and a context that seals every reply and marks an early
        end."""
        if round_.signer is None:
            await abort_stream(
                context, grpc.StatusCode.FAILED_PRECONDITION, "this round answers no keyed streams"
            )
        seal: StreamSeal
        if first.resume:
            resumption = self.resumptions.for_sender(peer_id, first.resume)
            if resumption is None:
                # Before any chunk is read: the sender opens the stream again with a full
                # handshake (streams.py).
                await abort_stream(
                    context,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "unknown or expired resumption ticket: a full handshake is needed",
                )
            seal = resume(first, peer_id, round_.signer.peer_id, resumption)
        else:
            try:
                handshake, seal = answer(first, peer_id, round_.signer)
            except KeyAgreementError as e:
                await abort_stream(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            try:
                async with asyncio.timeout(self.config.write_timeout):
                    await context.write(handshake)
            except TimeoutError:
                reason = f"sender read no handshake for {self.config.write_timeout:.1f}s"
                await abort_stalled(context, grpc.StatusCode.DEADLINE_EXCEEDED, reason)
            if seal.resumption is not None:
                self.resumptions.remember_sender(peer_id, seal.resumption)
        sealing = SealingContext(context, seal.outbound, MAX_STREAMS_PER_SENDER)
        return checked_requests(iterator, seal.inbound), sealing
