"""The local control service: what training processes call on the daemon.

Inbound handlers are ``rpc_<verb>``; the generated servicer names map onto them. The
daemon trusts no caller: every request is validated again here (layout, sizes, values)
before anything is allocated for it, and every failure is answered with a gRPC status
whose code the client maps back to its ``SwarmError`` subclass (``swarmavg.peer.client.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc
import msgpack
import numpy as np

from swarmavg.averaging import errors as averaging_errors
from swarmavg.averaging.request import RoundRequest, check_finite
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.transfer_progress import TransferProgress
from swarmavg.peer.client import shm
from swarmavg.peer.client.calls import SHM_THRESHOLD
from swarmavg.peer.client.errors import (
    REASON_KEY,
    STATUS_FOR_ERROR,
    DaemonUnavailableError,
    SwarmError,
    ValidationError,
)
from swarmavg.peer.client.reconnect import STOPPING
from swarmavg.peer.client.tensors import TensorAssembler, iter_bytes, layout_from_specs, specs_of
from swarmavg.peer.client.validation import validate_finite, validate_key
from swarmavg.peer.daemon.combiner import LocalCombiner
from swarmavg.proto import control_pb2, control_pb2_grpc

log = logging.getLogger(__name__)

PROGRESS_EVERY = 1.0
"""Seconds between two progress messages of a LoadState call."""
READ_TIMEOUT = 30.0
"""Seconds a client may take to send the next message of a request stream."""
MAX_DHT_VALUE_BYTES = 1 << 20
MAX_METADATA_BYTES = 16 << 20


class ControlBackend(Protocol):
    """What the control service needs from the daemon (``swarmavg.peer.daemon.daemon.Peer``)."""

    combiner: LocalCombiner
    segments: shm.DaemonSegmentCache

    async def dht_store(self, key: str, value: Any, ttl: float, subkey: Any) -> bool: ...
    async def dht_get(self, key: str) -> tuple[bool, Any]: ...
    async def publish_state(self, arrays: list[np.ndarray], metadata: bytes) -> None:
        """Serve this state. ``arrays`` may be views of a client's shared-memory segment,
        which the client writes again once this returns: keep copies, not them."""

    async def load_state(
        self, timeout: float, max_bytes: int | None = None
    ) -> tuple[bytes, list[np.ndarray]]: ...
    def status(self) -> control_pb2.StatusResponse: ...
    async def peers(self, training_run: str) -> control_pb2.PeersResponse: ...
    def state_progress(self) -> TransferProgress | None: ...
    def record_failure(self, reason: str) -> None: ...


def classify(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and a failure reason label for an exception."""
    if isinstance(exc, averaging_errors.SchemaMismatchError):
        return grpc.StatusCode.INVALID_ARGUMENT, "schema_mismatch"
    if isinstance(exc, SwarmError):
        code = STATUS_FOR_ERROR.get(type(exc), "UNKNOWN")
        reason = {"INVALID_ARGUMENT": "invalid_input", "UNAVAILABLE": "shutdown"}.get(code, "error")
        return grpc.StatusCode[code], reason
    if isinstance(exc, averaging_errors.InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, "invalid_input"
    if isinstance(exc, averaging_errors.RoundClosedError):
        return grpc.StatusCode.FAILED_PRECONDITION, "round_closed"
    if isinstance(exc, averaging_errors.NoGroupError):
        return grpc.StatusCode.FAILED_PRECONDITION, "no_group"
    if isinstance(exc, averaging_errors.StateNotFoundError):
        return grpc.StatusCode.NOT_FOUND, "no_state"
    if isinstance(exc, averaging_errors.AveragingError):
        return grpc.StatusCode.ABORTED, "averaging_error"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "timeout"
    if isinstance(exc, ValueError):  # e.g. an unknown codec name
        return grpc.StatusCode.INVALID_ARGUMENT, "invalid_input"
    return grpc.StatusCode.INTERNAL, "internal"


def _quiet_future(work: Awaitable[float]) -> asyncio.Future[float]:
    """``work`` as a future whose exception is marked retrieved, so that a call that failed
    for another reason first logs no "exception was never retrieved" warning."""
    future = asyncio.ensure_future(work)
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


def _start_check(arrays: list[np.ndarray]) -> asyncio.Future[float]:
    """Check ``arrays`` for NaN/Inf in a worker thread; the future gives the
    ``time.monotonic()`` at which it finished (or the check's error)."""

    def run() -> float:
        check_finite(arrays)
        return time.monotonic()

    return _quiet_future(asyncio.to_thread(run))


START_KINDS = ("start", "start_before_inputs")
"""The first messages of an ``Average`` call this daemon takes (control.proto)."""


def _await_inputs(
    requests: AsyncIterator[control_pb2.AverageRequest],
    arrays: list[np.ndarray],
    deadline: float,
    scan: bool,
) -> asyncio.Future[float]:
    """After ``start_before_inputs``: wait (until the call's ``deadline``, monotonic) for
    the client's ``inputs_written``, then scan the inputs unless the client checked them.
    The future gives the ``time.monotonic()`` at which they were ready (or the error)."""

    async def run() -> float:
        try:
            message = await asyncio.wait_for(anext(requests), deadline - time.monotonic())
        except StopAsyncIteration:
            raise ValidationError("the request stream ended before inputs_written") from None
        except TimeoutError:
            raise ValidationError("no inputs_written before the call's deadline") from None
        if message.WhichOneof("kind") != "inputs_written":
            raise ValidationError("after start_before_inputs, expected inputs_written")
        if scan:
            await asyncio.to_thread(check_finite, arrays)
        return time.monotonic()

    return _quiet_future(run())


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> None:
    code, reason = classify(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("control call failed", exc_info=exc)
    message = str(exc) or type(exc).__name__
    # The reason label travels beside the code: one code (INVALID_ARGUMENT) covers both
    # the caller's bad input and other peers' schema, which a training loop must tell apart.
    await context.abort(code, message, trailing_metadata=((REASON_KEY, reason),))


async def _next(stream: AsyncIterator[Any], what: str) -> Any:
    try:
        return await asyncio.wait_for(anext(stream), READ_TIMEOUT)
    except StopAsyncIteration:
        raise ValidationError(f"request stream ended before {what}") from None
    except TimeoutError:
        raise ValidationError(f"no {what} within {READ_TIMEOUT:.0f} s") from None


class ControlService(control_pb2_grpc.ControlServicer):
    """Serves one daemon's control endpoint. Create it inside the running loop."""

    def __init__(self, backend: ControlBackend) -> None:
        self._backend = backend
        self.active_calls = 0
        self._accepting = True

    def add_to_server(self, server: grpc.aio.Server) -> None:
        control_pb2_grpc.add_ControlServicer_to_server(self, server)  # type: ignore[no-untyped-call]

    def stop_accepting(self) -> None:
        """New calls are answered UNAVAILABLE from now on (shutdown's first step)."""
        self._accepting = False

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise DaemonUnavailableError(STOPPING)

    # ---- generated servicer names -> rpc_<verb> ----

    async def Average(
        self, requests: AsyncIterator[control_pb2.AverageRequest], context: Any
    ) -> AsyncIterator[control_pb2.AverageResponse]:
        # grpc.aio needs an async generator function here to stream the responses.
        async for response in self.rpc_average(requests, context):
            yield response

    async def DHTStore(
        self, request: control_pb2.DHTStoreRequest, context: Any
    ) -> control_pb2.DHTStoreResponse:
        response: control_pb2.DHTStoreResponse = await self._unary(
            self.rpc_dht_store, request, context
        )
        return response

    async def DHTGet(
        self, request: control_pb2.DHTGetRequest, context: Any
    ) -> control_pb2.DHTGetResponse:
        response: control_pb2.DHTGetResponse = await self._unary(self.rpc_dht_get, request, context)
        return response

    async def PublishState(
        self, requests: AsyncIterator[control_pb2.StateMessage], context: Any
    ) -> control_pb2.PublishStateResponse:
        response: control_pb2.PublishStateResponse = await self._unary(
            self.rpc_publish_state, requests, context
        )
        return response

    async def LoadState(
        self, request: control_pb2.LoadStateRequest, context: Any
    ) -> AsyncIterator[control_pb2.StateMessage]:
        async for message in self.rpc_load_state(request, context):
            yield message

    async def Status(
        self, request: control_pb2.StatusRequest, context: Any
    ) -> control_pb2.StatusResponse:
        response = self._backend.status()
        response.active_calls = self.active_calls
        return response

    async def Peers(
        self, request: control_pb2.PeersRequest, context: Any
    ) -> control_pb2.PeersResponse:
        response: control_pb2.PeersResponse = await self._unary(self.rpc_peers, request, context)
        return response

    async def _unary(
        self, handler: Callable[[Any], Awaitable[Any]], request: Any, context: Any
    ) -> Any:
        try:
            self._check_accepting()
            return await handler(request)
        except Exception as exc:
            await _abort(context, exc)
            raise  # unreachable: abort raises

    # ---- handlers ----

    async def rpc_average(
        self, requests: AsyncIterator[control_pb2.AverageRequest], context: Any
    ) -> AsyncIterator[control_pb2.AverageResponse]:
        """One averaging call: inputs in (inline or shared memory), results out.

        A new shared-memory segment is mapped and unlinked before anything else happens
        and kept for the client's next call; it is dropped when the call fails (except
        when no group formed: the round never wrote into it), and the cache drops the
        segments of exited client processes. After ``start_before_inputs`` the client is
        still writing the segment: matchmaking declares this peer meanwhile and waits for
        ``inputs_written`` before it joins a group.
        """
        segment: shm.DaemonSegment | None = None
        checking: asyncio.Future[float] | None = None
        by_client = False  # only the client checked the inputs (it says so)
        shm_name = ""
        in_round = False  # failures of the round itself are counted by the daemon's backend
        self.active_calls += 1
        started = time.monotonic()
        try:
            self._check_accepting()
            first = await _next(requests, "the AverageStart message")
            kind = first.WhichOneof("kind")
            if kind not in START_KINDS:
                raise ValidationError("the first message of an Average call must be its start")
            # start_before_inputs: the client writes the segment while this peer declares.
            early = kind == "start_before_inputs"
            start = first.start_before_inputs if early else first.start
            if early and not start.shm_name:
                raise ValidationError("start_before_inputs needs a shared-memory segment")
            shm_name = start.shm_name
            # The one place a call's parameters are checked and its timeout becomes a
            # deadline; the combiner, matchmaking and the all-reduce take them as they are.
            request = RoundRequest.from_wire(start, now=started)
            dtypes, shapes, _ = layout_from_specs(start.tensors)
            out: list[np.ndarray] | None = None
            if start.shm_name:
                segment = self._backend.segments.open(
                    start.shm_name, start.shm_size, start.shm_reuse
                )
                # The round averages in the segment itself (peer/client/handoff.py): the inputs
                # are read where the client wrote them, the result written over them.
                out = segment.inputs(dtypes, shapes)
                arrays = out
            else:
                assembler = TensorAssembler(dtypes, shapes)
                while not assembler.complete:
                    message = await _next(requests, "the tensor bytes")
                    if message.WhichOneof("kind") != "data":
                        raise ValidationError("expected tensor bytes")
                    assembler.add(message.data)
                arrays = assembler.finish()
            yield control_pb2.AverageResponse(accepted=control_pb2.AverageAccepted())
            accepted_at = time.monotonic()
            checked_at = accepted_at
            # The client library checks what it copies into shared memory and says so;
            # the round then checks each chunk as its codec encodes it (or, for `none`
            # sent to another reducer, as that reducer decodes it) instead of scanning the
            # whole segment before it joins a group (FiniteCheck.AS_ENCODED).
            by_client = out is not None and start.inputs_checked
            if early:
                # Matchmaking declares meanwhile and joins no group before this is done.
                checking = _await_inputs(requests, arrays, request.deadline, not by_client)
            elif out is not None and not by_client:
                # The check runs in a thread while matchmaking declares this peer; the
                # round waits for it before it joins a group (Matchmaker.find_group).
                checking = _start_check(arrays)
            elif out is None:
                await asyncio.to_thread(check_finite, arrays)
                checked_at = time.monotonic()
            in_round = True
            try:
                outcome = await self._backend.combiner.submit(
                    arrays,
                    request,
                    start.client_id[:64],
                    out=out,
                    inputs_ready=checking,
                    checked_by_client=by_client,
                )
                if checking is not None:
                    checked_at = await checking
            finally:
                if checking is not None and not checking.done():
                    checking.cancel()
            returned_at = time.monotonic()
            if segment is not None:
                await asyncio.to_thread(segment.write_results, outcome.tensors)
            written_at = time.monotonic()
            outcome = dataclasses.replace(
                outcome,
                timings={
                    **outcome.timings,
                    # The handoff's share of the call, as the client cannot see it.
                    "daemon.accept": accepted_at - started,
                    "daemon.check": checked_at - accepted_at,
                    "daemon.write_back": written_at - returned_at,
                },
            )
            if segment is None:
                for piece in iter_bytes(outcome.tensors):
                    yield control_pb2.AverageResponse(data=piece)
            yield control_pb2.AverageResponse(done=_done_message(outcome))
        except BaseException as exc:
            if segment is not None:
                # The client drops its side too; don't keep ours. No group formed: the
                # round never wrote into the segment, and both sides keep it for the next
                # call (a fresh one's page faults would make this peer late again).
                if not isinstance(exc, averaging_errors.NoGroupError):
                    self._backend.segments.drop(segment.name)
            elif shm_name:  # never mapped: remove the file now if its client is gone
                shm.unlink_if_orphaned(shm_name)
            if not isinstance(exc, Exception):
                raise  # cancelled: the client went away
            _, reason = classify(exc)
            # Rejected before it reached the round (bad input here, or a layout the local
            # batch refuses): count it once here. The round's own failures (a schema
            # mismatch with other peers, ...) were counted where the round ran.
            # the caller's tensors failed the check that ran alongside matchmaking, or
            # (checked only by its client) the batch's check or the round's codec
            refused = (
                checking is not None
                and checking.done()
                and not checking.cancelled()
                and checking.exception() is exc
            ) or (by_client and isinstance(exc, averaging_errors.InvalidTensorsError))
            if reason == "invalid_input" and (
                not in_round or refused or isinstance(exc, ValidationError)
            ):
                self._backend.record_failure(reason)
            await _abort(context, exc)
        finally:
            self.active_calls -= 1

    async def rpc_dht_store(
        self, request: control_pb2.DHTStoreRequest
    ) -> control_pb2.DHTStoreResponse:
        validate_key(request.key)
        if len(request.value) > MAX_DHT_VALUE_BYTES:
            raise ValidationError(f"value is larger than {MAX_DHT_VALUE_BYTES} bytes")
        if not 0 < request.ttl <= 86400 * 30:
            raise ValidationError(f"ttl {request.ttl} out of range")
        value = _unpack(request.value, "value")
        subkey = _unpack(request.subkey, "subkey") if request.has_subkey else None
        stored = await self._backend.dht_store(request.key, value, request.ttl, subkey)
        return control_pb2.DHTStoreResponse(stored=stored)

    async def rpc_dht_get(self, request: control_pb2.DHTGetRequest) -> control_pb2.DHTGetResponse:
        validate_key(request.key)
        found, value = await self._backend.dht_get(request.key)
        if not found:
            return control_pb2.DHTGetResponse(found=False)
        return control_pb2.DHTGetResponse(
            found=True,
            value=msgpack.packb(value, use_bin_type=True),
            is_dict=isinstance(value, dict),
        )

    async def rpc_peers(self, request: control_pb2.PeersRequest) -> control_pb2.PeersResponse:
        if request.training_run:
            validate_key(request.training_run)
        return await self._backend.peers(request.training_run)

    async def rpc_publish_state(
        self, requests: AsyncIterator[control_pb2.StateMessage]
    ) -> control_pb2.PublishStateResponse:
        first = await _next(requests, "the state header")
        if first.WhichOneof("kind") != "header":
            raise ValidationError("the first message of PublishState must be its header")
        if len(first.header.metadata) > MAX_METADATA_BYTES:
            raise ValidationError(f"metadata is larger than {MAX_METADATA_BYTES} bytes")
        header = first.header
        dtypes, shapes, _ = layout_from_specs(header.tensors)
        if header.shm_name:
            await self._publish_from_segment(header, dtypes, shapes)
            return control_pb2.PublishStateResponse()
        assembler = TensorAssembler(dtypes, shapes)
        while not assembler.complete:
            message = await _next(requests, "the state bytes")
            if message.WhichOneof("kind") != "data":
                raise ValidationError("expected state bytes")
            assembler.add(message.data)
        arrays = assembler.finish()
        await asyncio.to_thread(validate_finite, arrays)
        await self._backend.publish_state(arrays, header.metadata)
        return control_pb2.PublishStateResponse()

    async def _publish_from_segment(
        self,
        header: control_pb2.StateHeader,
        dtypes: list[np.dtype[np.generic]],
        shapes: list[tuple[int, ...]],
    ) -> None:
        """Publish tensors the client wrote into a shared-memory segment. Publishing copies
        them into the state's chunks before the call returns, so the client may write the
        segment again at its next publish; the mapping is kept for that one (as for
        ``average``'s segments) and dropped when the call fails."""
        segment = self._backend.segments.open(header.shm_name, header.shm_size, header.shm_reuse)
        try:
            arrays = segment.inputs(dtypes, shapes)
            await asyncio.to_thread(validate_finite, arrays)
            await self._backend.publish_state(arrays, header.metadata)
        except BaseException:
            self._backend.segments.drop(segment.name)
            raise

    async def rpc_load_state(
        self, request: control_pb2.LoadStateRequest, context: Any
    ) -> AsyncIterator[control_pb2.StateMessage]:
        try:
            self._check_accepting()
            if not 0 < request.timeout <= 3600:
                raise ValidationError(f"timeout {request.timeout} out of range (0, 3600]")
            if request.shm_name and shm.NAME_RE.match(request.shm_name) is None:
                raise ValidationError(f"bad shared-memory segment name {request.shm_name!r}")
            started = time.monotonic()
            # The download runs as this handler's task; meanwhile the caller hears how far
            # it has come (a multi-GB state takes minutes, and silence looks like a hang).
            load = asyncio.ensure_future(
                self._backend.load_state(request.timeout, request.max_bytes or None)
            )
            try:
                while not load.done():
                    await asyncio.wait({load}, timeout=PROGRESS_EVERY)
                    progress = self._backend.state_progress()
                    if not load.done() and progress is not None and progress.started >= started:
                        yield control_pb2.StateMessage(
                            progress=control_pb2.StateProgress(
                                bytes_done=progress.done,
                                bytes_total=progress.total,
                                seconds=progress.elapsed(),
                            )
                        )
            finally:
                if not load.done():
                    load.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await load
            metadata, arrays = load.result()
            header = control_pb2.StateHeader(metadata=metadata, tensors=specs_of(arrays))
            if request.shm_name and sum(a.nbytes for a in arrays) >= SHM_THRESHOLD:
                header.shm_size = await _fill_offer(request.shm_name, arrays)
                header.shm_name = request.shm_name if header.shm_size else ""
            yield control_pb2.StateMessage(header=header)
            if not header.shm_name:
                for piece in iter_bytes(arrays):
                    yield control_pb2.StateMessage(data=piece)
        except Exception as exc:
            await _abort(context, exc)


async def _fill_offer(name: str, arrays: list[np.ndarray]) -> int:
    """Write a loaded state into the segment its client offered (DESIGN 6.4: tensors
    above a small threshold go through shared memory); its size, or 0 when the offer
    cannot take them (no room, a file that is not an empty segment of this user's): the
    bytes then go on the stream, as to a client that offered none."""
    try:
        return await asyncio.to_thread(shm.fill_offer, name, arrays)
    except (OSError, ValidationError) as exc:
        log.info("the loaded state goes inline: segment %s not usable (%s)", name, exc)
        return 0


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ValidationError(f"{what} is not valid msgpack: {exc}") from None


def _done_message(outcome: AveragingResult) -> control_pb2.AverageDone:
    return control_pb2.AverageDone(**outcome.summary_fields(), state_digests=outcome.state_digests)
