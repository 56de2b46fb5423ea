"""Transport-free halves of the client's calls, shared by the sync and async clients.

A call is prepared here (inputs converted and validated, shared memory filled, request
messages built), the transport (``grpc`` or ``grpc.aio``) moves the messages, and the
responses are fed back here to build the result. Nothing in this module does I/O other
than the shared-memory segment.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from swarmavg.averaging.errors import InvalidRequestError, InvalidTensorsError
from swarmavg.averaging.request import RoundRequest
from swarmavg.averaging.result import RoundSummary
from swarmavg.peer.client import shm
from swarmavg.peer.client.errors import MalformedStateError, SwarmError, ValidationError
from swarmavg.peer.client.tensors import (
    Origin,
    TensorAssembler,
    from_numpy,
    iter_bytes,
    layout_from_specs,
    specs_of,
    to_numpy,
)
from swarmavg.peer.client.validation import validate_finite, validate_layout
from swarmavg.proto import control_pb2

SHM_THRESHOLD = 1 << 20
"""Calls whose tensors hold at least this many bytes go through shared memory."""
CALL_MARGIN = 10.0
"""Seconds the transport deadline adds to a call's timeout, so the daemon reports first."""


@dataclass(frozen=True, kw_only=True)
class AverageResult(RoundSummary):
    """What ``client.average`` returns (docs/peer.md, "The client"): the round's
    :class:`~swarmavg.averaging.result.RoundSummary`, with the caller's tensors.

    Attributes:
        tensors: the averaged tensors: same type, shape, dtype, device and order as the input.
        state_digests: the state digest each member of the group attached
            (``average(..., state_digest=...)``), peer id hex -> bytes; members that
            attached none are absent. Every member of the group sees the same map.
    """

    tensors: list[Any]
    state_digests: dict[str, bytes] = field(default_factory=dict)


class PreparedAverage:
    """One ``average`` call: validated inputs, the request stream, the result assembly.

    Always call :meth:`cleanup` when the call ends (it removes a shared-memory segment
    the daemon never mapped).
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        *,
        key: str,
        weight: float,
        group_size: int | None,
        min_group_size: int,
        timeout: float,
        codec: str | None,
        segments: shm.SegmentPool | None,
        state_digest: bytes | None = None,
        aggregation: str | None = None,
        max_group_size: int | None = None,
        client_id: str = "",
        shm_threshold: int = SHM_THRESHOLD,
        write_during_declaration: bool = True,
    ) -> None:
        """Validate everything before anything is sent, except, with
        ``write_during_declaration``, the values of tensors that go through shared memory:
        those are copied in and checked while the daemon declares this peer
        (``start_before_inputs``); a NaN/Inf found then fails the call with
        :attr:`write_error`.

        Raises:
            ValidationError: bad key, parameters, tensor types, dtypes or values.
        """
        began = time.monotonic()
        try:  # the daemon's rules, so a bad argument fails here, before anything is sent
            request = RoundRequest.build(
                key=key,
                weight=weight,
                timeout=timeout,
                group_size=group_size,
                min_group_size=min_group_size,
                codec=codec,
                state_digest=state_digest,
                aggregation=aggregation,
                max_group_size=max_group_size,
            )
        except InvalidRequestError as exc:
            raise ValidationError(str(exc)) from None
        arrays, self.origins = to_numpy(tensors)
        self.total_bytes = validate_layout([a.dtype for a in arrays], [a.shape for a in arrays])
        self.timeout = float(timeout)
        self._arrays: list[np.ndarray] | None = arrays
        self._pool = segments
        self.segment: shm.ClientSegment | None = None
        self._ok = False
        self.early = False
        """The segment is written after the start is sent (``start_before_inputs``)."""
        self.write_error: ValidationError | None = None
        """Why the inputs could not be written during the declaration (NaN/Inf)."""
        self._write_s: float | None = None
        # The sync client's transport runs requests() in its own thread: cleanup() must
        # neither hand the segment back while the copy runs, nor let it start afterwards.
        self._write_lock = threading.Lock()
        self._cleaned_up = False
        if segments is not None and self.total_bytes >= shm_threshold:
            # The NaN/Inf check runs on each block as it is copied in: one pass, not two.
            try:
                self.segment = shm.segment_or_inline(
                    segments, arrays, fill=not write_during_declaration
                )
            except InvalidTensorsError as exc:
                raise ValidationError(str(exc)) from None
            self.early = self.segment is not None and write_during_declaration
        if self.segment is None:  # inline: checked here, before anything is sent
            validate_finite(arrays)
        self.start = control_pb2.AverageStart(
            **request.wire_fields(self.timeout),
            tensors=specs_of(arrays),
            shm_name=self.segment.name if self.segment is not None else "",
            shm_size=self.segment.size if self.segment is not None else 0,
            client_id=client_id,
            shm_reuse=self.segment is not None and self.segment.daemon_mapped,
            # acquire() checked the tensors as it copied them in (copy_checked)
            inputs_checked=self.segment is not None,
        )
        self._assembler: TensorAssembler | None = None
        self._done: control_pb2.AverageDone | None = None
        self._prepared_at = time.monotonic()
        self._prepare_s = self._prepared_at - began

    @property
    def transport_timeout(self) -> float:
        """Seconds the transport waits for the whole call."""
        return self.timeout + CALL_MARGIN

    def requests(self) -> Iterator[control_pb2.AverageRequest]:
        """The request stream: the start message, then inline bytes (if not in shm); or,
        when writing during the declaration, the early start, the copy into the segment
        (checked as it goes) and ``inputs_written``. A NaN/Inf ends the stream there: the
        daemon fails the call and :attr:`write_error` says why."""
        arrays, self._arrays = self._arrays, None  # sent once; let the copies go
        if self.early:
            yield control_pb2.AverageRequest(start_before_inputs=self.start)
            with self._write_lock:
                if self._cleaned_up or self.segment is None or arrays is None:
                    return
                began = time.monotonic()
                try:
                    self.segment.fill(arrays)
                except InvalidTensorsError as exc:
                    self.write_error = ValidationError(str(exc))
                    return
                self._write_s = time.monotonic() - began
            yield control_pb2.AverageRequest(inputs_written=control_pb2.InputsWritten())
            return
        yield control_pb2.AverageRequest(start=self.start)
        if self.segment is None and arrays is not None:
            for piece in iter_bytes(arrays):
                yield control_pb2.AverageRequest(data=piece)

    def feed(self, response: control_pb2.AverageResponse) -> None:
        """Take one response message from the daemon."""
        kind = response.WhichOneof("kind")
        if kind == "accepted" and self.segment is not None:
            self.segment.daemon_mapped = True  # and unlinked: nothing left to clean up
        elif kind == "data":
            if self.segment is not None:
                raise SwarmError("daemon sent inline bytes for a shared-memory call")
            if self._assembler is None:
                dtypes, shapes, _ = layout_from_specs(self.start.tensors)
                self._assembler = TensorAssembler(dtypes, shapes)
            self._assembler.add(response.data)
        elif kind == "done":
            self._done = response.done

    def result(self) -> AverageResult:
        """The result, once the Done message arrived."""
        done = self._done
        if done is None:
            raise SwarmError("the daemon ended the call without a result")
        if self.segment is not None:
            dtypes, shapes, _ = layout_from_specs(self.start.tensors)
            arrays = self.segment.results(dtypes, shapes)
        elif self._assembler is not None:
            arrays = self._assembler.finish()
        else:
            raise SwarmError("the daemon sent no result tensors")
        self._ok = True
        # The client's own share: conversion, checks and the copy into shared memory
        # (prepare), then everything until the daemon's answer was read (call).
        summary = RoundSummary.fields_from(done)
        timings = summary["timings"]
        timings["client.prepare"] = self._prepare_s
        timings["client.call"] = time.monotonic() - self._prepared_at
        if self._write_s is not None:  # within client.call, while the daemon declared
            timings["client.write"] = self._write_s
        return AverageResult(
            tensors=from_numpy(arrays, self.origins),
            state_digests={str(peer): bytes(digest) for peer, digest in done.state_digests.items()},
            **summary,
        )

    @property
    def reused_segment(self) -> bool:
        """The call asked the daemon to reuse its mapping of an earlier call's segment."""
        return self.start.shm_reuse

    def found_no_group(self) -> None:
        """The daemon answered that no group formed: its round never wrote into the
        segment and it keeps its mapping (peer/daemon/control.py), so the pool may keep the
        segment as after a success. A fresh segment costs its page faults in the next
        call's copy (0.07-0.4 s for 64 MB), enough to make this peer late for that round
        too (docs/benchmarks-testbed.md, "First rounds of a key")."""
        self._ok = True

    def cleanup(self) -> None:
        """Remove the segment file if the daemon did not, and give the segment back to the
        pool for reuse when the call succeeded or found no group (idempotent)."""
        with self._write_lock:  # waits for a copy under way in the transport's thread
            self._cleaned_up = True
        segment, self.segment = self.segment, None
        if segment is not None and self._pool is not None:
            self._pool.release(segment, self._ok)


def _packed_metadata(metadata: Any) -> bytes:
    try:
        return msgpack.packb(metadata, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"metadata is not msgpack-serialisable: {exc}") from None


class DaemonSupport:
    """Whether this client's daemon takes a newer form of a call (``start_before_inputs``,
    shared-memory publishes; control.proto): assumed until a daemon older than it refuses
    one, then never tried again."""

    def __init__(self) -> None:
        self.supported = True


SHM_REFUSED = "ended before the state bytes"
"""What a daemon older than shared-memory publishes answers one: it waits for the tensor
bytes that never come (peer/daemon/control.py's ``_next``)."""


class PreparedPublish:
    """One ``publish_state`` call: the validated state and, when it is large and the
    daemon maps this client's segments, its tensors copied into a shared-memory segment
    (checked for NaN/Inf as they are copied) instead of streamed through the socket.

    A training loop publishes the same layout after every step, so the segment comes from
    its own pool and the daemon keeps its mapping: after the first call, a publish costs
    the client one copy and the daemon the copy into its chunks. Always call
    :meth:`cleanup` when the call ends.
    """

    def __init__(
        self,
        tensors: Sequence[Any],
        metadata: Any,
        segments: shm.SegmentPool | None,
        shm_threshold: int = SHM_THRESHOLD,
    ) -> None:
        """Validate everything before anything is sent.

        Raises:
            ValidationError: bad tensors (types, dtypes, NaN/Inf) or metadata.
        """
        arrays, _ = to_numpy(tensors)
        total = validate_layout([a.dtype for a in arrays], [a.shape for a in arrays])
        self._metadata = _packed_metadata(metadata)
        self._specs = specs_of(arrays)
        self._arrays = arrays
        self._pool = segments
        self.segment: shm.ClientSegment | None = None
        self._ok = False
        if segments is not None and total >= shm_threshold:
            try:  # checks for NaN/Inf as it copies
                self.segment = shm.segment_or_inline(segments, arrays)
            except InvalidTensorsError as exc:
                raise ValidationError(str(exc)) from None
        if self.segment is None:
            validate_finite(arrays)

    def messages(self) -> list[control_pb2.StateMessage]:
        """The request stream: the header naming the segment, or the header and the bytes."""
        segment = self.segment
        header = control_pb2.StateHeader(metadata=self._metadata, tensors=self._specs)
        if segment is not None:
            header.shm_name = segment.name
            header.shm_size = segment.size
            header.shm_reuse = segment.daemon_mapped
            return [control_pb2.StateMessage(header=header)]
        inline = (control_pb2.StateMessage(data=piece) for piece in iter_bytes(self._arrays))
        return [control_pb2.StateMessage(header=header), *inline]

    def retry(self, error: SwarmError, shm_publishes: DaemonSupport) -> bool:
        """After a failed call through shared memory: whether to send it again, and how.
        A daemon that no longer maps the reused segment (it restarted or evicted it) gets a
        fresh one; a daemon older than shared-memory publishes gets the bytes inline, from
        now on (``shm_publishes``)."""
        segment = self.segment
        if segment is None or self._pool is None or not isinstance(error, ValidationError):
            return False
        if SHM_REFUSED in str(error):
            shm_publishes.supported = False
            self._release(ok=False)
            return True
        if segment.daemon_mapped and shm.NOT_MAPPED in str(error):
            self._pool.clear()
            self._release(ok=False)
            self.segment = shm.segment_or_inline(self._pool, self._arrays)
            return True
        return False

    def succeeded(self) -> None:
        """The daemon published the state: it mapped the segment and keeps the mapping."""
        self._ok = True
        if self.segment is not None:
            self.segment.daemon_mapped = True

    def cleanup(self) -> None:
        """Give the segment back to its pool (kept after a success; idempotent)."""
        self._release(ok=self._ok)

    def _release(self, *, ok: bool) -> None:
        segment, self.segment = self.segment, None
        if segment is not None and self._pool is not None:
            self._pool.release(segment, ok)


def unpack_state_metadata(data: bytes) -> Any:
    """Decode a loaded state's metadata: msgpack bytes that come, unchanged, from the donor
    that published the state, so from any peer of the run (a donor's undecodable
    metadata made ``load_state`` raise msgpack's own exception, which no caller catches).

    Raises:
        MalformedStateError: not exactly one msgpack object.
    """
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types (FormatError,
        # ExtraData, StackError, UnicodeDecodeError, TypeError for an unhashable map key...)
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise MalformedStateError(
            f"the loaded state's metadata ({len(data)} bytes from its donor) is not valid "
            f"msgpack: {why}"
        ) from None


class StateReceiver:
    """Rebuilds ``(metadata, tensors)`` from a LoadState stream (numpy arrays): from the
    bytes on the stream, or from the segment ``offer`` when the daemon's header names it.

    The metadata and the tensor layout are the donor's (the daemon passes them on), so
    what cannot be decoded raises :class:`MalformedStateError`.
    """

    def __init__(
        self,
        on_progress: Callable[[control_pb2.StateProgress], None] | None = None,
        offer: shm.LoadOffer | None = None,
    ) -> None:
        self._metadata: bytes | None = None
        self._assembler: TensorAssembler | None = None
        self._arrays: list[np.ndarray] | None = None  # from the offered segment
        self._on_progress = on_progress
        self._offer = offer

    def request(self, timeout: float, max_bytes: int | None) -> control_pb2.LoadStateRequest:
        """The LoadState request (offering the segment, if any)."""
        return control_pb2.LoadStateRequest(
            timeout=timeout,
            max_bytes=max_bytes or 0,
            shm_name=self._offer.name if self._offer is not None else "",
        )

    def feed(self, message: control_pb2.StateMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "progress":
            if self._on_progress is not None:
                self._on_progress(message.progress)
        elif kind == "header":
            try:
                dtypes, shapes, _ = layout_from_specs(message.header.tensors)
            except ValidationError as exc:
                raise MalformedStateError(f"the loaded state's tensor layout: {exc}") from None
            self._metadata = message.header.metadata
            if message.header.shm_name:
                self._arrays = self._from_offer(message.header, dtypes, shapes)
            else:
                self._assembler = TensorAssembler(dtypes, shapes)
        elif kind == "data":
            if self._assembler is None:
                raise SwarmError("state bytes arrived before the state header, or with a segment")
            self._assembler.add(message.data)

    def _from_offer(
        self,
        header: control_pb2.StateHeader,
        dtypes: list[np.dtype[np.generic]],
        shapes: list[tuple[int, ...]],
    ) -> list[np.ndarray]:
        if self._offer is None or header.shm_name != self._offer.name:
            raise SwarmError(f"the daemon named segment {header.shm_name!r}, not the one offered")
        try:
            return self._offer.arrays(header.shm_size, dtypes, shapes)
        except (OSError, ValidationError) as exc:
            raise SwarmError(f"the loaded state's segment cannot be read: {exc}") from None

    def close(self) -> None:
        """Unlink the offered segment (the arrays mapped from it stay valid)."""
        if self._offer is not None:
            self._offer.unlink()

    def result(self) -> tuple[Any, list[np.ndarray]]:
        if self._metadata is None:
            raise SwarmError("the daemon sent no state")
        if self._arrays is not None:
            tensors = self._arrays
        elif self._assembler is not None:
            tensors = self._assembler.finish()
        else:
            raise SwarmError("the daemon sent no state")
        metadata = unpack_state_metadata(self._metadata) if self._metadata else None
        return metadata, tensors


def pack_value(value: Any, what: str) -> bytes:
    """msgpack a DHT value or subkey; ``ValidationError`` when it cannot be."""
    try:
        return bytes(msgpack.packb(value, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValidationError(f"{what} is not msgpack-serialisable: {exc}") from None


def unpack_get(response: control_pb2.DHTGetResponse) -> Any:
    """The value of a DHTGet answer: a value, a dict subkey -> value, or ``None``."""
    if not response.found:
        return None
    return msgpack.unpackb(response.value, raw=False, strict_map_key=False)


def status_to_dict(status: control_pb2.StatusResponse) -> dict[str, Any]:
    """A plain dict (JSON-ready) of the daemon's status."""
    return {
        "peer_id": status.peer_id,
        "run_id": status.run_id,
        "address": status.address or None,
        "control": status.control,
        "client_mode": status.client_mode,
        "known_peers": status.known_peers,
        "dht_size_estimate": status.dht_size_estimate,
        "rounds_done": status.rounds_done,
        "rounds_failed": status.rounds_failed,
        "rounds_partial": status.rounds_partial,
        "bytes_sent": status.bytes_sent,
        "bytes_received": status.bytes_received,
        "codecs": {
            name: {
                "rounds": c.rounds,
                "bytes_sent": c.bytes_sent,
                "bytes_received": c.bytes_received,
                "seconds": c.seconds,
            }
            for name, c in sorted(status.codecs.items())
        },
        "failures": dict(sorted(status.failures.items())),
        "uptime": status.uptime,
        "version": status.version,
        "active_calls": status.active_calls,
        "pid": status.pid,
        "bandwidth": status.bandwidth,
        "bandwidth_measured": status.bandwidth_measured,
        "bandwidth_samples": status.bandwidth_samples,
        "kind": status.kind or "peer",
        "stored_records": status.stored_records,
        "reachability": status.reachability or "unknown",
        "relay": status.relay or None,
        "relay_id": status.relay_id or None,
        "observed_host": status.observed_host or None,
        "relay_moves": status.relay_moves,
        "relaying_reservations": status.relaying_reservations,
        "relayed_bytes": status.relayed_bytes,
        "relayed_connections": status.relayed_connections,
        "direct_peers": list(status.direct_peers),
        "punches_succeeded": status.punches_succeeded,
        "punches_failed": status.punches_failed,
        "trainers": [{"run": t.run, "method": t.method, "alone": t.alone} for t in status.trainers],
    }


def shm_usable(status: control_pb2.StatusResponse) -> bool:
    """Whether this process sees the same shared-memory folder as the daemon."""
    if not status.shm_dir or not shm.shm_available(shm.SHM_DIR):
        return False
    try:
        info = os.stat(status.shm_dir)
    except OSError:
        return False
    return info.st_dev == status.shm_dev and info.st_ino == status.shm_ino


__all__ = [
    "AverageResult",
    "DaemonSupport",
    "Origin",
    "PreparedAverage",
    "PreparedPublish",
    "StateReceiver",
    "pack_value",
    "shm_usable",
    "status_to_dict",
    "unpack_get",
    "unpack_state_metadata",
]
