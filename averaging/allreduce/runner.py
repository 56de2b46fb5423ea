"""The butterfly all-reduce runner: one member's side of one round (docs/averaging.md).

Given a formed :class:`~swarmavg.averaging.group.GroupInfo`, every member flattens its
tensors (:mod:`~swarmavg.averaging.allreduce.partition`), cuts the vector into one part per
reducing member sized by bandwidth (:mod:`~swarmavg.averaging.allreduce.load_balancing`), streams
its chunks of part ``j`` to member ``j`` over one ``Reduce`` stream, and writes the
averaged chunks that come back into its result. Its own part is reduced locally by a
:class:`~swarmavg.averaging.allreduce.service.ReducerRound` that the inbound streams of the
other members feed.

Pipelining: the sender encodes chunk ``c + 1`` while chunk ``c`` is on the wire, reads
averaged chunks while it writes (one send task and one receive loop per stream), and
the reducer returns every chunk as soon as all live senders delivered it.

Failure (the reason this module exists): every wait has a deadline derived from the
round's deadline and the observed progress. A stalled or broken sender is dropped by
the reducer, whose part then averages the others; a reducer that dies or stalls leaves
the chunks it did not return with this member's local values and ``partial=True``. The
runner returns by ``deadline`` (plus the time to cancel its streams) and never mutates
the caller's tensors, unless the caller asks for the result in place (``out`` is
``tensors``: the daemon does, for a client's shared memory).

Honest reporting: what a member reports comes from what it observed itself,
not from the reducers' word. A reducer that answers inconsistently (more senders than the
group has, or than it can have heard from: ``num_senders`` counting this member for a chunk
it had not sent yet; a chunk out of range, twice, of the wrong size or codec) is distrusted
for its whole part: the part keeps this member's local values, counts as not averaged
(``failed_parts``, ``distrusted``) and makes the result partial.

API (used by ``swarmavg.averaging.averager``)::

    service = AllReduceService(node.authenticator)  # once per daemon, inside the loop
    outcome = await run_allreduce(group, my_index, tensors, weight,
                                  deadline=time.monotonic() + 30,
                                  service=service, channels=pool, signer=node.signer)
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import grpc
import numpy as np
from numpy.lib.array_utils import byte_bounds

from swarmavg.averaging.aggregation import MEAN
from swarmavg.averaging.allreduce.buffers import BufferPool
from swarmavg.averaging.allreduce.chunking import link_chunk_bytes
from swarmavg.averaging.allreduce.data_plane import DataCall, DataStreamError
from swarmavg.averaging.allreduce.faults import FaultPlan, InjectedCrash
from swarmavg.averaging.allreduce.keyed_stream import SenderHandshake, StreamSeal
from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.part_check import DeviationTally, forged_parts
from swarmavg.averaging.allreduce.partition import (
    PartPlan,
    TensorLayout,
    chunk_elements_for,
    contiguous_span,
    flat_view,
    flatten,
    unflatten,
)
from swarmavg.averaging.allreduce.round import Abort, ReducerRound, offload
from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.allreduce.stream_keys import KeyAgreementError
from swarmavg.averaging.allreduce.stream_mac import IntegrityError, StreamMac
from swarmavg.averaging.allreduce.wire import (
    OutgoingChunk,
    Reply,
    encode_request,
    sealed,
    serialize_pieces,
)
from swarmavg.averaging.errors import InvalidTensorsError
from swarmavg.averaging.group import GroupInfo, schema_hash
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.stubs import reduce_method
from swarmavg.compression import Codec, CodecInfo
from swarmavg.compression.base import Buffer, Encoded, Header
from swarmavg.compression.kernels import all_finite, check_copy
from swarmavg.compression.native import copy_finite
from swarmavg.dht.auth import RequestSigner
from swarmavg.dht.identity import HeaderError
from swarmavg.dht.ranges import split_host

log = logging.getLogger(__name__)

__all__ = [
    "AllReduceError",
    "AllReduceService",
    "ChannelSource",
    "FiniteCheck",
    "run_allreduce",
]

_PROBE_ELEMENTS = 65536
_T = TypeVar("_T")


class ChannelSource(Protocol):
    """Where the runner gets channels (``swarmavg.dht.ChannelPool`` fits)."""

    def channel(self, address: str, peer_id: bytes | None = None) -> grpc.aio.Channel: ...


class AllReduceError(RuntimeError):
    """The round could not run at all (e.g. its deadline had already passed)."""


class FiniteCheck(enum.Enum):
    """Where a member's tensors are checked for NaN/Inf, which would poison the group."""

    UPFRONT = "upfront"
    """:func:`run_allreduce` scans them whole before it sends anything."""
    DONE = "done"
    """The caller scanned them already (the ``Averager`` does, before matchmaking)."""
    AS_ENCODED = "as-encoded"
    """For inputs whose writer checked them and says so (a client's shared memory): no scan
    here. Each chunk is checked by the codec as it encodes it (fused into its pass for the
    lossy codecs), and with ``none`` under the mean where the values are checked anyway:
    by the reducer that decodes a chunk, or, for our own part, by our reducer as it
    encodes each average. A bad chunk fails the call with :class:`InvalidTensorsError`:
    at once when the codec finds it, at the end of the round when a reducer refused it
    and it kept our values. Only a caller that lied gets that error, after its group
    formed, and the group then goes on without it (or without the chunks it spoiled)."""


def _bytes_per_element(codec: Codec, dtype: np.dtype) -> float:
    """Encoded bytes per element of ``codec`` on a fixed pseudo-random probe.

    Deterministic (same codec code -> same answer), so every member derives the same
    chunk size without negotiating it.
    """
    probe = np.random.default_rng(0).standard_normal(_PROBE_ELEMENTS).astype(dtype)
    message = codec.encode(probe, CodecInfo(key="swarmavg.chunk-size-probe"))
    return max(message.ByteSize(), 1) / _PROBE_ELEMENTS


class _Outcome(enum.Enum):
    """How one ``Reduce`` stream to a reducer ended."""

    DONE = "done"
    """Finished, failed or gave up: whatever came back is kept, the rest stays local."""
    REFUSED = "refused"
    """``RESOURCE_EXHAUSTED`` before any reply: the reducer's data plane is full."""
    NOT_STARTED = "not started"
    """``NOT_FOUND`` before any reply: the reducer has no round of this group (yet)."""


def _not_started_pause(attempt: int, registration_wait: float) -> float:
    """Seconds before asking again a reducer that has not started the round.

    Its service already held each stream up to ``registration_wait`` before refusing it,
    so the pause only spreads the group's senders: short, jittered, growing a little.
    """
    base = min(0.05 * 2.0 ** min(attempt, 6), max(registration_wait, 0.05))
    return base * random.uniform(0.5, 1.5)


class _Exchange:
    """This member's side of one round; :func:`run_allreduce` is its only user."""

    def __init__(
        self,
        group: GroupInfo,
        my_index: int,
        layout: TensorLayout,
        plan: PartPlan,
        codec: Codec,
        weight: float,
        deadline: float,
        service: AllReduceService,
        channels: ChannelSource,
        signer: RequestSigner,
        fault_plan: FaultPlan | None,
    ) -> None:
        self.group = group
        self.my_index = my_index
        self.layout = layout
        self.plan = plan
        self.codec = codec
        self.weight = weight
        self.deadline = deadline
        self.service = service
        self.config = service.config
        self.channels = channels
        self.signer = signer
        self.fault_plan = fault_plan
        self.vector = np.empty(0, dtype=layout.dtype)
        self.result = np.empty(0, dtype=layout.dtype)
        self.received = {j: np.zeros(plan.num_chunks(j), dtype=bool) for j in range(group.size)}
        self.full_chunks = {j: 0 for j in range(group.size)}  # averaged over every sender
        self.adjusted = {j: 0 for j in range(group.size)}  # inputs clipped/trimmed, per part
        self.weights_clipped = {j: 0 for j in range(group.size)}  # as each reducer said
        self.handed = dict.fromkeys(range(group.size), 0)  # chunks of part j given to its stream
        self.distrusted: dict[int, str] = {}  # part -> why its reducer's word is refused
        # How far each part's averages are from our own values (part_check), counted as
        # they are decoded; None: the check is off. Only under a robust rule: under the
        # mean any member bends every part by what it sends, so a run that admits
        # strangers chooses a robust rule, and the check completes it at the reducers.
        self.deviation_factor = (
            self.config.part_deviation_factor if group.aggregation != MEAN else None
        )
        self.tallies = {j: DeviationTally() for j in range(group.size)}
        self.backup: np.ndarray | None = None
        """In place with the check on: where our values of each chunk of the other
        members' parts are kept (at the chunk's own offset), written in the pass that
        writes its average over them, until every part was checked: a refused part gets
        them back (:meth:`fill_missing`). Our own part is never refused and keeps none.
        Kept, not the averages held back: the averages are written as they come, as
        without the check, and the pass that writes them reads our values anyway."""
        self.backed_up: set[tuple[int, int]] = set()  # (part, chunk) held in `backup`
        self.crashed = asyncio.Event()
        # FiniteCheck.AS_ENCODED, and whether the codec checks our chunks (run_allreduce)
        self.check_as_encoded = False
        self.codec_checks = False
        self.refused = asyncio.Event()  # a chunk of our own tensors held NaN/Inf
        self.refusal: InvalidTensorsError | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.in_place = False
        """``result`` is ``vector``'s memory: a chunk's local values are gone once its
        average is written, so a reply is checked whole before it is written."""
        self.keep_backups = False
        """In place with the part check on: see :attr:`backup`."""
        # Replies decode straight into `result` in executor threads, which outlive the
        # round's cancelled tasks: the lock lets fill_missing() wait for a decode in
        # flight, and `_sealed` keeps any later one from writing over the final result.
        self._result_lock = threading.Lock()
        self._sealed = False

    # ---- helpers run in the executor ----

    def _chunk(self, part: int, chunk: int) -> tuple[np.ndarray, CodecInfo]:
        """Our values of one chunk of ``part``, and what the codec is told about them."""
        base = self.plan.bounds[part][0]
        start, end = self.plan.chunk_bounds(part, chunk)
        # Keyed by the tensors' schema and the chunk's place in them, so a stateful codec's
        # residual (top-k error feedback) meets the same slice of the same tensors next round.
        info = CodecInfo(
            key=f"{self.group.schema_hash.hex()[:16]}/flat[{base + start}:{base + end}]",
            part_index=part,
            part_size=self.plan.part_size(part),
            finite=not self.codec_checks,
        )
        return self.vector[base + start : base + end], info

    def _chunk_size(self, part: int, chunk: int) -> int:
        """Elements of ``chunk`` of ``part`` (how much work its coding is)."""
        start, end = self.plan.chunk_bounds(part, chunk)
        return end - start

    def refuse_local_non_finite(self) -> None:
        """With :attr:`FiniteCheck.AS_ENCODED`, after :meth:`fill_missing`: raise
        :class:`InvalidTensorsError` when a chunk that kept our own values holds NaN/Inf
        (a reducer refused it, returned it empty, or never got it). A pass over the
        unaveraged chunks only."""
        if not self.check_as_encoded:
            return
        for part, received in self.received.items():
            base = self.plan.bounds[part][0]
            for chunk in np.flatnonzero(~received):
                start, end = self.plan.chunk_bounds(part, int(chunk))
                if not all_finite(self.result[base + start : base + end]):
                    raise InvalidTensorsError(
                        f"the tensors hold NaN or Inf (in elements "
                        f"flat[{base + start}:{base + end}], which part {part}'s reducer "
                        "did not average)"
                    )

    @staticmethod
    def _coded(
        code: Callable[[np.ndarray, CodecInfo], _T], values: np.ndarray, info: CodecInfo
    ) -> _T:
        """``code(values, info)``, where a refusal caused by NaN/Inf in our own unchecked
        values becomes :class:`InvalidTensorsError` (the round ends) rather than a failed
        part."""
        try:
            return code(values, info)
        except ValueError as e:  # CodecError included
            if info.finite or all_finite(values):
                raise
            where = info.key.rpartition("/")[2]  # the chunk's place in the flattened tensors
            raise InvalidTensorsError(f"the tensors hold NaN or Inf (in elements {where})") from e

    def _encode(self, part: int, chunk: int) -> Encoded:
        return self._coded(self.codec.encode_payload, *self._chunk(part, chunk))

    def _encode_request(self, part: int, chunk: int, mac: StreamMac) -> OutgoingChunk:
        """One chunk of ``part`` as the wire pieces of its ``ReduceRequest``, sealed with
        the stream's next tag (here, off the loop with the encoding; chunks are encoded
        one at a time, in the order they are written)."""
        return sealed(encode_request(self._encode(part, chunk), chunk), mac)

    def _round_trip_local(self, chunk: int) -> np.ndarray:
        """This member's own copy of one chunk of its part, through the codec and back."""
        start, end = self.plan.chunk_bounds(self.my_index, chunk)
        values = self._coded(self.codec.round_trip, *self._chunk(self.my_index, chunk))
        if values.shape != (end - start,) or values.dtype != self.layout.dtype:
            raise ValueError(f"codec {self.codec.name} changed the shape or dtype of a chunk")
        return values

    def _decode_reply(self, part: int, reply: Reply) -> None:
        """Decode one averaged chunk of ``part`` into the result; ``ValueError`` if bad."""
        if reply.header is None or reply.payload is None:
            raise ValueError("reply carries no chunk")
        if not self.codec.accepts(reply.header.codec):
            raise ValueError(f"reply uses codec {reply.header.codec!r}")
        start, end = self.plan.chunk_bounds(part, reply.chunk_index)
        header = reply.header
        if header.shape != (end - start,) or header.dtype != self.layout.dtype:
            raise ValueError(
                f"reply declares {header.dtype}{list(header.shape)}, "
                f"expected {self.layout.dtype}[{end - start}]"
            )
        base = self.plan.bounds[part][0]
        values = self.result[base + start : base + end]
        own = self.vector[base + start : base + end]
        if self.deviation_factor is not None:
            self._decode_checked(part, reply.chunk_index, header, reply.payload, values, own)
            return
        if self.in_place and not self.codec.decodes_into_cleanly:
            # The local values live where the average goes: decode and check the whole
            # chunk first (codec none: a checked view of the payload, no copy), so that
            # a bad reply leaves them as they were; then one copy that cannot fail.
            decoded = self.codec.decode_payload(header, reply.payload).reshape(-1)
            if not self.codec.decodes_finite and not all_finite(decoded):
                raise ValueError("reply holds NaN or Inf")
            with self._result_lock:
                if self._sealed:
                    raise ValueError("the round is over")
                _copy_into(values, decoded)
            return
        # Straight into the result: if this raises, the chunk stays unreceived and
        # fill_missing() puts the local values back over whatever was written (in place,
        # the codec wrote nothing: it checks the whole payload first).
        with self._result_lock:
            if self._sealed:
                raise ValueError("the round is over")
            self.codec.decode_payload_into(header, reply.payload, values)
            if not self.codec.decodes_finite and not all_finite(values):
                raise ValueError("reply holds NaN or Inf")

    def _decode_checked(
        self,
        part: int,
        chunk: int,
        header: Header,
        payload: Buffer,
        values: np.ndarray,
        own: np.ndarray,
    ) -> None:
        """:meth:`_decode_reply` with the part check on: the averages are copied where
        they go in the pass that counts the check's sums against our values there (and
        in place keeps those in :attr:`backup`), so the check reads nothing twice."""
        backup = None
        if self.keep_backups and self.backup is not None:
            base = self.plan.bounds[part][0]
            start, end = self.plan.chunk_bounds(part, chunk)
            backup = self.backup[base + start : base + end]
        if self.in_place and self.codec.decodes_into_cleanly:
            # The codec writes only a payload it checked whole: keep our values, decode
            # over them, then count (a pass of its own; no codec of the data path does this
            # unless chosen).
            with self._result_lock:
                if self._sealed:
                    raise ValueError("the round is over")
                if backup is None:
                    raise ValueError("in place with the check on, but no backup")
                self.backed_up.add((part, chunk))
                _copy_into(backup, own)
                self.codec.decode_payload_into(header, payload, values)
                self.tallies[part].add(values, backup)
            return
        # Unchecked where the codec can (none: a view of the payload): the pass below
        # checks every value as it copies it.
        decoded, _ = self.codec.decode_payload_unchecked(header, payload)
        decoded = decoded.reshape(-1)
        if decoded.dtype != values.dtype:  # float16's words: decode them (checked)
            decoded = self.codec.decode_payload(header, payload).reshape(-1)
        with self._result_lock:
            if self._sealed:
                raise ValueError("the round is over")
            if backup is not None:
                self.backed_up.add((part, chunk))
            finite, sums = check_copy(decoded, own, values, backup)
            if not finite:
                if backup is not None:  # in place: our values were written over
                    _copy_into(values, backup)
                # out of place fill_missing() puts them back: the chunk stays unreceived
                raise ValueError("reply holds NaN or Inf")
            self.tallies[part].add_sums(sums, own.size)

    def seal(self) -> None:
        """Refuse every later reply (decodes in executor threads may outlive the round's
        tasks); returns once none is being decoded. Idempotent."""
        with self._result_lock:
            self._sealed = True

    def check_parts(self) -> None:
        """After :meth:`seal`: refuse the parts whose averages are too far from our own
        values against the other parts (:func:`~swarmavg.averaging.allreduce.part_check.
        forged_parts`), as from a distrusted reducer. Our own part, reduced here, is only a
        reference. A member that sends nothing has nothing to compare."""
        if self.deviation_factor is None or not self.group.members[self.my_index].mode.sends:
            return
        deviations = {}
        for part, tally in self.tallies.items():
            deviation = tally.result()
            if deviation is not None and part not in self.distrusted:
                deviations[part] = deviation
        refused = forged_parts(
            deviations,
            {self.my_index},
            self.deviation_factor,
            lambda part: self.tallies[part].zeros(),
            lambda parts: {part: self.tallies[part].mean_absolute() for part in parts},
        )
        for part, reason in sorted(refused.items()):
            self._distrust(part, f"forged averages: {reason}")

    def fill_missing(self) -> None:
        """Copy local values into every chunk that no reducer returned, once no reply is
        being decoded any more and none will be; in place, only into the chunks of a part
        refused after its averages were written (from :attr:`backup`)."""
        self.seal()
        if self.in_place:
            # nothing else overwrote the chunks no reducer returned: they are local
            backup = self.backup
            if backup is not None:
                for part, index in sorted(self.backed_up):
                    if not self.received[part][index]:
                        base = self.plan.bounds[part][0]
                        start, end = self.plan.chunk_bounds(part, index)
                        span = slice(base + start, base + end)
                        _copy_into(self.result[span], backup[span])
                self.backup = None
                self.backed_up.clear()
                self.service.buffers.give(backup)
            return
        for part, received in self.received.items():
            base = self.plan.bounds[part][0]
            for chunk in np.flatnonzero(~received):
                start, end = self.plan.chunk_bounds(part, int(chunk))
                self.result[base + start : base + end] = self.vector[base + start : base + end]

    # ---- the local part ----

    def on_local_result(self, chunk: int, values: np.ndarray, contributors: int) -> None:
        """Called by the local ReducerRound with the decoded average of one chunk."""
        base = self.plan.bounds[self.my_index][0]
        start, end = self.plan.chunk_bounds(self.my_index, chunk)
        own = self.vector[base + start : base + end]
        if self.deviation_factor is None:
            _copy_into(self.result[base + start : base + end], values)
        else:  # our own part: a reference for the others, never refused (no backup)
            _, sums = check_copy(values.reshape(-1), own, self.result[base + start : base + end])
            self.tallies[self.my_index].add_sums(sums, own.size)
        self.received[self.my_index][chunk] = True
        if contributors == len(self.group.senders):
            self.full_chunks[self.my_index] += 1

    def _refuse_own_tensors(self, error: InvalidTensorsError) -> None:
        """End the round: our own tensors hold NaN/Inf (found as a chunk was encoded)."""
        if self.refusal is None:
            self.refusal = error
            self.refused.set()

    async def contribute_local(self, round_: ReducerRound) -> None:
        for chunk in range(self.plan.num_chunks(self.my_index)):
            try:
                values = await offload(
                    self.service.executor,
                    self._round_trip_local,
                    chunk,
                    elements=self._chunk_size(self.my_index, chunk),
                )
            except InvalidTensorsError as e:
                self._refuse_own_tensors(e)
                return
            round_.add_local(chunk, values)
            # Work run inline (no executor, or a small chunk: ``offload``) never suspends:
            # yield, so that the sends to the other reducers start now instead of after our
            # whole part was encoded.
            await asyncio.sleep(0)

    # ---- one remote part ----

    async def _send_part(
        self,
        part: int,
        call: grpc.aio.StreamStreamCall | DataCall,
        handshake: SenderHandshake,
        seal: asyncio.Future[StreamSeal],
    ) -> None:
        # Signed for part's reducer and this group: a captured first message opens no stream
        # to another reducer, into another group, or twice (dht/auth.py). No chunk goes
        # before the reducer's handshake: every chunk carries a tag under the stream's key.
        opening = handshake.opening(self.signer, self.weight)
        await self._write(call, opening)
        mac = (await seal).outbound
        for chunk in range(self.plan.num_chunks(part)):
            if self.fault_plan is not None:
                if self.fault_plan.crashes(chunk):
                    self.crashed.set()
                    await asyncio.Event().wait()
                if self.fault_plan.stops_sending(chunk):
                    await asyncio.Event().wait()  # a stalled sender: the stream stays open
            try:
                request = await offload(
                    self.service.executor,
                    self._encode_request,
                    part,
                    chunk,
                    mac,
                    elements=self._chunk_size(part, chunk),
                )
            except InvalidTensorsError as e:
                self._refuse_own_tensors(e)
                return  # the round ends now: run_allreduce cancels this stream
            # Counted before the write: a reply may come back before the write returns.
            self.handed[part] = chunk + 1
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

    async def _open_call(self, part: int, address: str) -> grpc.aio.StreamStreamCall | DataCall:
        """A ``Reduce`` stream to the reducer of ``part``: over its data plane when it
        serves one and we can reach it, else over gRPC."""
        data_port = self.group.members[part].data_port
        connector = self.service.data_connector
        if data_port and connector is not None:
            remaining = self.deadline - time.monotonic()
            member = self.group.members[part]
            call = await connector.open(
                split_host(address), data_port, remaining, address, member.peer_id
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
        floor = max(3 * self.config.min_stall, self.config.registration_wait)
        return max(floor, self.config.stall_factor * mean)

    async def exchange_part(self, part: int) -> None:
        """Stream our chunks of ``part`` to its reducer; store what comes back.

        Never raises (except CancelledError): a failure leaves the missing chunks local.
        """
        address = self.group.members[part].address
        if address is None:  # GroupInfo guarantees reducers have one; keep mypy honest
            return
        if self.fault_plan is not None and self.fault_plan.crashes(0):
            self.crashed.set()  # before connecting: a crash at the start sends nothing
            return
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
        while True:
            call = await self._open_call(part, address)
            outcome = await self._exchange(part, address, call)
            if outcome is _Outcome.REFUSED and isinstance(call, DataCall):
                # Refused before the stream started (the reducer's data plane is full):
                # nothing we sent was processed, so the same stream over gRPC is not a
                # duplicate.
                log.info("part %d: %s refused a data-plane stream; using gRPC", part, address)
                connector = self.service.data_connector
                if connector is not None:
                    connector.refused(split_host(address), self.group.members[part].data_port)
                outcome = await self._exchange(part, address, self._grpc_call(part, address))
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

    async def _exchange(
        self, part: int, address: str, call: grpc.aio.StreamStreamCall | DataCall
    ) -> _Outcome:
        """Run one ``Reduce`` stream for ``part``; say whether the reducer refused it
        before starting it. Never raises (except CancelledError)."""
        loop = asyncio.get_running_loop()
        num_chunks = self.plan.num_chunks(part)
        reducer_id = self.group.members[part].peer_id
        handshake = SenderHandshake(self.signer.peer_id, reducer_id, self.group.group_id, part)
        seal: asyncio.Future[StreamSeal] = loop.create_future()
        sender = loop.create_task(self._send_part(part, call, handshake, seal))
        started = time.monotonic()
        replies = 0
        try:
            while replies < num_chunks:
                patience = self._reply_patience(started, replies)
                wait = min(patience, self.deadline - time.monotonic())
                try:
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
                    log.info("part %d: reducer %s ended the stream early", part, address)
                    return _Outcome.DONE
                if not seal.done():
                    try:
                        seal.set_result(handshake.accept(response, self.service.authenticator))
                    except (HeaderError, IntegrityError, KeyAgreementError) as e:
                        self._distrust(part, f"its handshake failed: {e}")
                        return _Outcome.DONE
                    continue
                try:
                    seal.result().inbound.check(response.covered, response.mac)
                except IntegrityError as e:
                    # Altered on the way or by the reducer: either way, not used.
                    self._distrust(part, str(e))
                    return _Outcome.DONE
                replies += 1
                if not await self._accept_reply(part, response):
                    return _Outcome.DONE
            if isinstance(call, DataCall):  # read its OK, so the connection can be reused
                await call.finish(min(1.0, max(self.deadline - time.monotonic(), 0.0)))
        except grpc.RpcError as e:
            known = isinstance(e, grpc.aio.AioRpcError | DataStreamError)
            code = e.code() if known else None
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED and replies == 0:
                return _Outcome.REFUSED
            if code is grpc.StatusCode.NOT_FOUND and replies == 0:
                return _Outcome.NOT_STARTED
            details = e.details() if known else str(e)
            log.info("part %d: stream to %s failed: %s %s", part, address, code, details)
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

    def _distrust(self, part: int, reason: str) -> bool:
        """Refuse everything the reducer of ``part`` returned: the whole part keeps local
        values (``fill_missing``) and counts as not averaged. Returns ``False``.

        In place (:attr:`in_place`) with the part check off, the chunks it returned before
        are already written over their local values, which are gone: they keep the
        averages, each of which passed every check on its own, and only the rest of the
        part stays local. The part still counts as distrusted and not averaged, the result
        as partial. With the check on, their local values come back from
        :attr:`backup`."""
        log.warning(
            "part %d: reducer %s answered inconsistently (%s); keeping local values",
            part,
            self.group.members[part].peer_id.hex()[:12],
            reason,
        )
        self.distrusted.setdefault(part, reason)
        if not self.in_place or self.keep_backups:
            self.received[part][:] = False
        self.full_chunks[part] = 0
        return False

    def _senders_bound(self, part: int, chunk: int) -> int:
        """The most senders an honest reducer of ``part`` can have averaged ``chunk`` over:
        every sender of the group, less this member if it had not sent that chunk yet."""
        senders = len(self.group.senders)
        return senders if self.handed[part] > chunk else senders - 1

    async def _accept_reply(self, part: int, reply: Reply) -> bool:
        """Validate and store one averaged chunk; ``False`` means "stop trusting it"."""
        chunk = reply.chunk_index
        if reply.error:
            log.warning("part %d: %s", part, reply.error)
            return False
        if chunk >= self.plan.num_chunks(part) or self.received[part][chunk]:
            return self._distrust(part, f"chunk {chunk} out of range or twice")
        self.bytes_received += reply.nbytes
        if reply.num_senders > self._senders_bound(part, chunk):
            return self._distrust(
                part,
                f"chunk {chunk} claims {reply.num_senders} senders, at most "
                f"{self._senders_bound(part, chunk)} possible",
            )
        if reply.num_senders == 0:
            return True  # nobody delivered this chunk in time: it stays local
        try:
            await offload(
                self.service.executor,
                self._decode_reply,
                part,
                reply,
                elements=self._chunk_size(part, chunk),
            )
        except ValueError as e:  # CodecError included
            return self._distrust(part, f"invalid chunk {chunk}: {e}")
        self.received[part][chunk] = True
        if reply.num_senders >= len(self.group.senders):
            self.full_chunks[part] += 1
        self.adjusted[part] += reply.num_adjusted
        self.weights_clipped[part] = max(self.weights_clipped[part], reply.weights_clipped)
        return True


def _copy_into(out: np.ndarray, values: np.ndarray) -> None:
    """``out[...] = values`` through the compiled checked copy where it applies: its
    stores bypass the caches for copies of 256 KiB and more (a reply's chunk), so the
    destination is not read first as memmove's stores read it (the replies'
    copies into the caller's memory were 6.5% of a daemon's CPU at 8 peers). What it
    says of finiteness is not needed here: the values were checked already."""
    if copy_finite(values, out) is None:
        np.copyto(out, values)


def _aligned_like(buffers: BufferPool, vector: np.ndarray) -> np.ndarray:
    """A buffer of ``vector``'s length and dtype from ``buffers``, at the same address
    modulo 32 bytes: a chunk of it is 32-byte aligned where that chunk of ``vector`` is, so
    the compiled pass that keeps our values there streams its stores (check_copy)."""
    item = vector.dtype.itemsize
    raw = buffers.take(vector.size + 32 // item, vector.dtype)
    shift = (vector.ctypes.data - raw.ctypes.data) % 32
    if shift % item:  # the vector is not aligned to its items: any place will do
        return raw[: vector.size]
    start = shift // item
    return raw[start : start + vector.size]


def _result_target(
    out: Sequence[np.ndarray] | None, tensors: Sequence[np.ndarray], layout: TensorLayout
) -> np.ndarray | None:
    """The flat view of ``out`` that replies decode into, ``None`` when ``out`` is not
    one span of the reduction dtype (then the result is copied into it at the end).

    Raises:
        ValueError: ``out`` has another layout, is read-only, or overlaps ``tensors``
            without being exactly them (the round still reads the inputs after the first
            replies came back; in place, it reads each chunk only before its average).
    """
    if out is None:
        return None
    if not layout.matches(out):
        raise ValueError("out does not have the tensors' shapes and dtypes")
    if not all(o.flags.writeable for o in out):
        raise ValueError("out is read-only")
    if not _same_memory(out, tensors) and _extents_overlap(out, tensors):
        raise ValueError("out overlaps the input tensors")
    return contiguous_span(out, layout)


def _same_memory(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Whether ``a`` and ``b`` are the same arrays of memory, pairwise (in place)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and x.strides == y.strides
        and byte_bounds(x) == byte_bounds(y)
        for x, y in zip(a, b, strict=True)
    )


def _same_vector(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat vectors span the same memory (the result is the inputs)."""
    return a.size == b.size and a.size > 0 and byte_bounds(a) == byte_bounds(b)


def _extents_overlap(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Whether any array of ``a`` spans memory that an array of ``b`` spans (each taken
    from its lowest to its highest byte): O((len(a) + len(b)) log len(b))."""
    union: list[list[int]] = []  # b's extents merged, sorted, disjoint
    for lo, hi in sorted(byte_bounds(x) for x in b if x.size):
        if union and lo < union[-1][1]:
            union[-1][1] = max(union[-1][1], hi)
        else:
            union.append([lo, hi])
    starts = [lo for lo, _ in union]
    for x in a:
        if not x.size:
            continue
        lo, hi = byte_bounds(x)
        k = bisect.bisect_left(starts, hi) - 1  # the last of b's extents starting below hi
        if k >= 0 and union[k][1] > lo:
            return True
    return False


async def run_allreduce(
    group: GroupInfo,
    my_index: int,
    tensors: Sequence[np.ndarray],
    weight: float,
    *,
    deadline: float,
    service: AllReduceService,
    channels: ChannelSource,
    signer: RequestSigner,
    fault_plan: FaultPlan | None = None,
    finite_check: FiniteCheck = FiniteCheck.UPFRONT,
    out: Sequence[np.ndarray] | None = None,
) -> AveragingResult:
    """Run this member's side of one butterfly all-reduce round.

    Args:
        group: the formed group (identical on every member).
        my_index: this member's position in ``group.members``.
        tensors: this member's tensors (never modified). ``AUX`` members pass arrays of
            the group's schema too (e.g. zeros); their values are not sent.
        weight: this member's weight, finite and >= 0 (ignored for ``AUX``).
        deadline: absolute ``time.monotonic()`` by which the round ends.
        service: this daemon's :class:`AllReduceService` (serves our part).
        channels: a channel pool (``swarmavg.dht.ChannelPool``).
        signer: signs this peer's stream openings (``DHTNode.signer``).
        fault_plan: test seam; ``None`` in production.
        finite_check: where the tensors are checked for NaN/Inf (:class:`FiniteCheck`):
            here before anything is sent (the default), already by the caller, or chunk
            by chunk as the codec encodes them.
        out: arrays of the tensors' layout (writable, not overlapping ``tensors``) that
            receive the result; the result's ``tensors`` are then these arrays. When they
            lie back to back in the reduction dtype (one float32 tensor, say) the replies
            are decoded straight into them: no fresh result buffer, no copy afterwards.
            ``out`` may also be ``tensors`` themselves (the same memory): the round then
            averages in place, and a chunk no reducer returned keeps its values. (With the
            part check off, a reducer distrusted mid-part leaves the chunks it returned
            before averaged, see ``_Exchange._distrust``.) ``None``: the result goes into
            new arrays.

    Returns:
        The outcome; ``partial`` when a member failed mid-round.

    Raises:
        ValueError: the tensors do not match ``group.schema_hash``, hold NaN/Inf, the
            weight is invalid, ``my_index``/``signer`` do not name a member, or ``out``
            has another layout, is read-only or overlaps ``tensors``.
        InvalidTensorsError: (a ``ValueError``) with ``FiniteCheck.AS_ENCODED``, a chunk
            of the tensors held NaN/Inf; the round stopped when it was found, and the
            group goes on without this member.
        AllReduceError: the deadline has already passed.
        InjectedCrash: only when ``fault_plan`` says so.
    """
    t0 = time.monotonic()
    if not 0 <= my_index < group.size:
        raise ValueError(f"my_index {my_index} is not in a group of {group.size}")
    me = group.members[my_index]
    if signer.peer_id != me.peer_id:
        raise ValueError("the signer's peer id is not the peer id of member my_index")
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"weight must be finite and >= 0, got {weight}")
    if schema_hash(tensors) != group.schema_hash:
        raise ValueError("tensors do not match the group's schema (shapes/dtypes differ)")
    if deadline <= t0:
        raise AllReduceError("the round's deadline has already passed")
    layout = TensorLayout.of(tensors)
    target = _result_target(out, tensors, layout)
    codec = service.codec(group.codec)
    loop = asyncio.get_running_loop()
    executor = service.executor

    probe_key = (codec.name, layout.dtype.name)
    if probe_key not in service.bytes_per_element:
        service.bytes_per_element[probe_key] = await offload(
            executor, _bytes_per_element, codec, layout.dtype
        )
    # A chunk is at most chunk_bytes on the wire AND in the reduction dtype, so that
    # strongly compressing codecs keep enough chunks per part to pipeline. Unless set, the
    # target follows the group's links (every member reads the same bandwidths).
    chunk_bytes = service.config.chunk_bytes or link_chunk_bytes(group.members)
    chunk_elements = min(
        chunk_elements_for(service.bytes_per_element[probe_key], chunk_bytes),
        chunk_elements_for(float(layout.dtype.itemsize), chunk_bytes),
    )
    plan = PartPlan.build(part_sizes(group.members, layout.total), chunk_elements)
    ex = _Exchange(
        group,
        my_index,
        layout,
        plan,
        codec,
        weight,
        deadline,
        service,
        channels,
        signer,
        fault_plan,
    )
    ex.check_as_encoded = finite_check is FiniteCheck.AS_ENCODED
    # Even then the codec need not check our chunks when it passes the values themselves
    # and refuses NaN/Inf as it decodes or encodes them (`none`), under the mean: a chunk
    # sent to another reducer is checked as that reducer decodes it, a chunk of our own
    # part as our reducer encodes its average (a NaN/Inf spoils the average, and the chunk
    # comes back empty). Either way the chunk keeps our values, where
    # refuse_local_non_finite() finds it. The robust rules get checked copies: their
    # kernels sort and compare the values.
    checked_anyway = codec.exact and codec.decodes_finite and not group.rule.robust
    ex.codec_checks = ex.check_as_encoded and not checked_anyway

    def prepare() -> None:
        view = flat_view(tensors, layout)
        ex.vector = view if view is not None else flatten(tensors, layout)
        # Flattening only widens (partition.reduction_dtype), so checked inputs stay finite.
        upfront = finite_check is FiniteCheck.UPFRONT
        if me.mode.sends and upfront and not all_finite(ex.vector):
            raise ValueError("tensors hold NaN or Inf")
        ex.result = target if target is not None else np.empty_like(ex.vector)
        ex.in_place = _same_vector(ex.result, ex.vector)
        ex.keep_backups = ex.in_place and ex.deviation_factor is not None
        if ex.keep_backups:
            ex.backup = _aligned_like(service.buffers, ex.vector)

    await offload(executor, prepare, elements=layout.total)
    t_prepared = time.monotonic()

    round_: ReducerRound | None = None
    tasks: set[asyncio.Task[None]] = set()
    if plan.part_size(my_index) > 0:
        round_ = ReducerRound(
            group,
            my_index,
            plan,
            layout.dtype,
            codec,
            service.config,
            executor,
            deadline,
            ex.on_local_result,
            fault_plan,
            buffers=service.buffers,
            combiner=service.combiner,
            signer=signer,
        )
        service.register(round_)
        round_.start()
        if me.mode.sends:
            round_.set_local_weight(weight)
            tasks.add(loop.create_task(ex.contribute_local(round_)))
    if me.mode.sends:
        for part in range(group.size):
            if part != my_index and plan.part_size(part) > 0:
                tasks.add(loop.create_task(ex.exchange_part(part)))

    async def everything() -> None:
        await asyncio.gather(*tasks)
        if round_ is not None:
            await round_.finished.wait()

    main = loop.create_task(everything())
    crash = loop.create_task(ex.crashed.wait())
    refused = loop.create_task(ex.refused.wait())
    errors: list[str] = []
    try:
        # Every exchange and our reducer, a crash, our own tensors refused, or the
        # deadline: whichever is first.
        done, _ = await asyncio.wait(
            {main, crash, refused},
            timeout=deadline - time.monotonic(),
            return_when=asyncio.FIRST_COMPLETED,
        )
        if main in done:
            main.result()  # re-raise a programming error; exchanges themselves never raise
    finally:
        t_exchanged = time.monotonic()
        for task in (*tasks, main, crash, refused):
            task.cancel()
        outcomes = await asyncio.gather(*tasks, main, crash, refused, return_exceptions=True)
        for outcome in outcomes[: len(tasks)]:  # main re-raised above; the events never fail
            if isinstance(outcome, Exception):
                # A task of the round died: say why, and count it in the result, rather
                # than let the gather swallow it.
                reason = f"a task of the round failed: {outcome!r}"
                log.error("round %s: %s", group.group_id.hex(), reason, exc_info=outcome)
                errors.append(reason)
        if round_ is not None:
            abort = None
            if ex.crashed.is_set():
                abort = Abort(grpc.StatusCode.UNAVAILABLE, "peer crashed (injected)")
            elif ex.refusal is not None:
                abort = Abort(
                    grpc.StatusCode.UNAVAILABLE, "the member's own tensors held NaN or Inf"
                )
            elif not round_.finished.is_set():
                abort = Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "round deadline passed")
            await round_.close(abort)
            service.unregister(round_)
            errors.extend(round_.errors)
    if ex.crashed.is_set():
        raise InjectedCrash(f"member {my_index} crashed as its fault plan says")
    if ex.refusal is not None:
        raise ex.refusal

    def settle() -> None:
        ex.seal()  # waits for a decode still running in a thread: never on the loop
        ex.check_parts()  # a few medians of the sums counted as replies came: no data pass

    await offload(executor, settle)
    failed = tuple(
        j
        for j in range(group.size)
        if plan.part_size(j) > 0 and (not ex.received[j].all() or j in ex.distrusted)
    )
    if not me.mode.sends:  # AUX: only our own part is ours to report
        failed = tuple(j for j in failed if j == my_index)
    considered = [j for j in range(group.size) if me.mode.sends or j == my_index]
    elements = sum(plan.part_size(j) for j in considered)
    local_elements = sum(
        plan.chunk_bounds(j, int(c))[1] - plan.chunk_bounds(j, int(c))[0]
        for j in considered
        for c in np.flatnonzero(~ex.received[j])
    )
    averaged_by_all = all(
        ex.full_chunks[j] == plan.num_chunks(j)
        for j in range(group.size)
        if plan.part_size(j) > 0 and (me.mode.sends or j == my_index)
    )

    def finish() -> list[np.ndarray]:
        ex.fill_missing()
        ex.refuse_local_non_finite()
        if out is None:
            return unflatten(ex.result, layout, copy=False)  # result is ours to hand over
        if target is None:  # `out` is not one span: one copy into the caller's arrays
            for dst, src in zip(out, unflatten(ex.result, layout, copy=False), strict=True):
                np.copyto(dst, src)
        return list(out)

    out = await offload(executor, finish, elements=layout.total)
    t_done = time.monotonic()
    if round_ is not None:
        ex.adjusted[my_index] = round_.adjusted
        ex.weights_clipped[my_index] = round_.reducer.weights_clipped
    return AveragingResult(
        tensors=out,
        group_size=group.size,
        peers=[m.peer_id.hex() for m in group.members],
        group_id=group.group_id.hex(),
        codec=group.codec,
        partial=bool(failed) or not averaged_by_all or bool(errors),
        timings={
            "allreduce.prepare": t_prepared - t0,
            "allreduce.exchange": t_exchanged - t_prepared,
            "allreduce.finish": t_done - t_exchanged,
            "allreduce.total": t_done - t0,
        },
        bytes_sent=ex.bytes_sent + (round_.bytes_sent if round_ is not None else 0),
        bytes_received=ex.bytes_received + (round_.bytes_received if round_ is not None else 0),
        gathered={m.peer_id.hex(): m.user_data for m in group.members},
        failed_parts=failed,
        dropped=dict(round_.dropped) if round_ is not None else {},
        errors=tuple(errors),
        aggregation=group.aggregation,
        num_adjusted=sum(ex.adjusted.values()),
        weights_clipped=sum(ex.weights_clipped.values()),
        distrusted=dict(ex.distrusted),
        local_fraction=local_elements / elements if elements else 0.0,
    )
