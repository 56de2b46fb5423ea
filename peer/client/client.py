"""The client a training process uses to talk to its local daemon (docs/peer.md).

``connect()`` gives a blocking :class:`Client`, ``connect_async()`` an :class:`AsyncClient`;
both have the same methods (the async ones are coroutines). Inputs are validated here,
before anything is sent; large tensors travel through shared memory (``swarmavg.peer.client.shm``).
Every failure is raised as a :class:`~swarmavg.peer.client.errors.SwarmError` subclass.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Generator, Sequence
from types import TracebackType
from typing import Any

import grpc

from swarmavg.peer.client.calls import (
    AverageResult,
    DaemonSupport,
    PreparedAverage,
    PreparedPublish,
    StateReceiver,
    pack_value,
    shm_usable,
    status_to_dict,
    unpack_get,
)
from swarmavg.peer.client.control_access import (
    ControlAccessError,
    call_metadata,
    check_socket_owner,
)
from swarmavg.peer.client.download_display import DownloadDisplay
from swarmavg.peer.client.endpoint import (
    DEFAULT_RUN_ID,
    ControlEndpoint,
    parse_control_endpoint,
    running_daemons,
)
from swarmavg.peer.client.errors import (
    DaemonUnavailableError,
    NoGroupError,
    SwarmError,
    ValidationError,
    error_from_rpc,
)
from swarmavg.peer.client.reconnect import PROBE_TIMEOUT, RECONNECT_TIMEOUT, STOPPING, DaemonLink
from swarmavg.peer.client.run_view import view_to_dict
from swarmavg.peer.client.shm import NOT_MAPPED, LoadOffer, SegmentPool
from swarmavg.peer.client.validation import validate_key
from swarmavg.proto import control_pb2, control_pb2_grpc

CONNECT_TIMEOUT = 5.0
SHORT_CALL_TIMEOUT = 30.0
_OPTIONS = [
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 8 << 20),
    # A restarted daemon is found within a second or two: gRPC's default backoff between
    # connection attempts grows to 2 minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
_AWAY_CODES = frozenset({"UNAVAILABLE", "UNAUTHENTICATED", "CANCELLED"})
"""Codes of a call that did not reach the daemon it connected to: gone, shutting down (a
stopping server cancels the calls in flight: CANCELLED), or a restarted one that wrote a
new token (peer/client/reconnect.py)."""


def _away_reason(exc: grpc.RpcError) -> str | None:
    """Why ``exc``'s call did not reach the daemon, or None when the daemon answered it."""
    code = exc.code()
    if code is None or code.name not in _AWAY_CODES:
        return None
    details = exc.details() or ""
    if code.name == "UNAVAILABLE" and "failed to connect" in details:
        return "nothing answers at the endpoint"  # gRPC's text names the socket again
    return f"{code.name}: {details}" if details else code.name


def resolve_endpoint(endpoint: str | None, run_id: str | None = None) -> ControlEndpoint:
    """The endpoint to use (docs/peer.md, "The client").

    In order: ``endpoint``; ``$SWARMAVG_CONTROL``; the default socket of ``run_id`` or
    ``$SWARMAVG_RUN_ID``; else the one daemon of this user that listens on a default socket
    (so ``swarmavg peer --run-id my-run`` then ``swarmavg status`` just works); else the
    default socket of run ``default``.

    Raises:
        ValidationError: a public TCP endpoint, an over-long socket path, or several
            daemons running with none named (the message lists them).
    """
    text = endpoint or os.environ.get("SWARMAVG_CONTROL") or None
    run = run_id or os.environ.get("SWARMAVG_RUN_ID") or None
    if text is None and run is None:
        running = running_daemons()
        if len(running) > 1:
            listed = ", ".join(f"{name} ({path})" for name, path in running.items())
            raise ValidationError(
                f"several swarmavg daemons run for this user: {listed}; say which with "
                "--run-id NAME (SWARMAVG_RUN_ID) or --control ENDPOINT (SWARMAVG_CONTROL)"
            )
        if running:
            text = str(next(iter(running.values())))
    try:
        return parse_control_endpoint(text, run or DEFAULT_RUN_ID)
    except ValueError as exc:
        raise ValidationError(str(exc)) from None


def _store_request(key: str, value: Any, ttl: float, subkey: Any) -> control_pb2.DHTStoreRequest:
    validate_key(key)
    if not isinstance(ttl, int | float) or not 0 < ttl <= 86400 * 30:
        raise ValidationError(f"ttl must be in (0, 30 days] seconds, got {ttl!r}")
    return control_pb2.DHTStoreRequest(
        key=key,
        value=pack_value(value, "value"),
        ttl=float(ttl),
        subkey=pack_value(subkey, "subkey") if subkey is not None else b"",
        has_subkey=subkey is not None,
    )


def _unavailable(endpoint: ControlEndpoint, reason: object) -> DaemonUnavailableError:
    return DaemonUnavailableError(
        f"no swarmavg daemon answers at {endpoint} ({reason}); start one with `swarmavg peer`"
    )


def _average_failure(
    call: PreparedAverage,
    exc: grpc.RpcError,
    endpoint: ControlEndpoint,
    segments: SegmentPool,
    early_writes: DaemonSupport,
    attempt: int,
) -> SwarmError | None:
    """The error a failed ``average`` call raises, or ``None`` to retry it once: when the
    daemon no longer maps the reused segment (it restarted or evicted it), every idle
    segment is forgotten and the retry hands over a fresh one; when the daemon is older
    than ``start_before_inputs``, the retry writes the inputs before the start."""
    if call.write_error is not None:  # NaN/Inf while writing: the daemon saw the stream end
        return call.write_error
    error = error_from_rpc(exc, str(endpoint))
    refused = isinstance(error, ValidationError) and "must be its start" in str(error)
    if attempt == 0 and call.early and refused:  # a daemon older than start_before_inputs
        early_writes.supported = False
        return None
    if isinstance(error, NoGroupError):
        call.found_no_group()
    lost = call.reused_segment and isinstance(error, ValidationError) and NOT_MAPPED in str(error)
    if attempt == 0 and lost:
        segments.clear()
        return None
    return error


def _publish_pool(
    segments: SegmentPool, use_shm: bool, shm_publishes: DaemonSupport
) -> SegmentPool | None:
    """The segments of a client's publishes, when they can go through shared memory."""
    return segments if use_shm and shm_publishes.supported else None


def _access(endpoint: ControlEndpoint) -> tuple[tuple[str, str], ...]:
    """Check that the endpoint is this user's daemon; return the metadata every call carries.

    Fails at once, with a clear message, when the socket file is not there at all, belongs to
    another user, or (TCP) this user holds no token for it (peer/client/control_access.py).
    """
    try:
        if endpoint.path is not None:
            check_socket_owner(endpoint.path)
        return call_metadata(endpoint)
    except FileNotFoundError:
        # One look, not "exists, then whose": a daemon shutting down removes its socket
        # between any two, and a trainer waiting for its restart looks again.
        raise _unavailable(endpoint, "no socket file") from None
    except ControlAccessError as exc:
        raise DaemonUnavailableError(str(exc)) from None


def _refreshed_metadata(
    endpoint: ControlEndpoint, current: tuple[tuple[str, str], ...]
) -> tuple[tuple[str, str], ...]:
    """The endpoint's call metadata read anew, or ``current`` while the daemon is still away
    (the call then fails as a round does while it is)."""
    try:
        return _access(endpoint)
    except DaemonUnavailableError:
        return current


_PROBE = control_pb2.StatusRequest()


def _probe_options(metadata: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """A look for a daemon that went away: a Status call that waits for the connection."""
    return {"timeout": PROBE_TIMEOUT, "wait_for_ready": True, "metadata": metadata}


def _probe_failure(exc: Exception) -> str:
    """Why a look for the daemon found none."""
    if isinstance(exc, grpc.RpcError):
        return _away_reason(exc) or str(exc.code())
    return str(exc)


def _note_away(link: DaemonLink, exc: grpc.RpcError) -> None:
    """A failed round: when it did not reach the daemon, the daemon is away."""
    away = _away_reason(exc)
    if away is not None:
        link.lost(away)


def _connect_error(endpoint: ControlEndpoint, exc: grpc.RpcError) -> DaemonUnavailableError:
    code = exc.code()
    return _unavailable(endpoint, code.name if code is not None else exc)


class _SyncDHT:
    """``client.dht``: the run's DHT through the daemon."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: Any = None) -> bool:
        """Store ``value`` (any msgpack-able object) for ``ttl`` seconds; True if stored."""
        request = _store_request(key, value, ttl, subkey)
        response = self._client._unary(self._client._stub.DHTStore, request)
        return bool(response.stored)

    def get(self, key: str) -> Any:
        """The value, a dict subkey -> value for dictionary values, or ``None``."""
        validate_key(key)
        request = control_pb2.DHTGetRequest(key=key)
        return unpack_get(self._client._unary(self._client._stub.DHTGet, request))


class Client:
    """A blocking connection to the local daemon. Thread-safe; close it when done."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        use_shm: bool = True,
        connect_timeout: float = CONNECT_TIMEOUT,
        reconnect_timeout: float = RECONNECT_TIMEOUT,
    ) -> None:
        """Connect and check that a daemon answers. When the daemon goes away later
        (restarted), see peer/client/reconnect.py: rounds fail at once, other calls wait up to
        ``reconnect_timeout`` seconds for it to come back on the same endpoint.

        Raises:
            DaemonUnavailableError: nothing answers at the endpoint within ``connect_timeout``.
            ValidationError: the endpoint is not a local one.
        """
        self.endpoint = resolve_endpoint(endpoint)
        self._link = DaemonLink(str(self.endpoint), reconnect_timeout)
        self._metadata = _access(self.endpoint)
        self._channel = grpc.insecure_channel(self.endpoint.grpc_target(), options=_OPTIONS)
        self._stub = control_pb2_grpc.ControlStub(self._channel)  # type: ignore[no-untyped-call]
        self.dht = _SyncDHT(self)
        self._client_id = secrets.token_hex(8)
        self._segments = SegmentPool()
        self._early_writes = DaemonSupport()
        # A published state is copied out by the daemon at once: one segment is enough.
        self._publish_segments = SegmentPool(keep=1)
        self._shm_publishes = DaemonSupport()
        try:
            status = self._stub.Status(
                control_pb2.StatusRequest(),
                timeout=connect_timeout,
                wait_for_ready=True,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            self._channel.close()
            raise _connect_error(self.endpoint, exc) from None
        except BaseException:
            self._channel.close()
            raise
        self._use_shm = use_shm and shm_usable(status)
        self._link.answered(status.peer_id, status.pid)

    def _unary(
        self, method: Any, request: Any, timeout: float = SHORT_CALL_TIMEOUT, stream: bool = False
    ) -> Any:
        """One short call; when the daemon is away, it waits for it and runs again, until
        ``reconnect_timeout`` after the first failure.
        ``stream``: ``request`` is a list of messages sent as a request stream."""
        give_up_at: float | None = None
        while True:
            try:
                sent = iter(request) if stream else request
                response = method(sent, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                away = _away_reason(exc)
                give_up_at = self._link.retry_until(give_up_at)
                if away is None or time.monotonic() >= give_up_at:
                    raise error_from_rpc(exc, str(self.endpoint)) from None
                self._wait_for_daemon(away)
                continue
            self._link.answered()
            return response

    def _wait_for_daemon(self, reason: str) -> None:
        """Look for the daemon with backoff until it answers (peer/client/reconnect.py).

        Raises:
            DaemonUnavailableError: it did not come back within ``reconnect_timeout``.
        """
        self._link.lost(reason)
        for pause in self._link.waits():
            try:
                self._metadata = _access(self.endpoint)
                status = self._stub.Status(_PROBE, **_probe_options(self._metadata))
                if self._link.back(status.peer_id, status.pid):
                    return
                reason = STOPPING
            except (DaemonUnavailableError, grpc.RpcError) as exc:
                reason = _probe_failure(exc)
            time.sleep(pause)
        raise self._link.gave_up(reason)

    def _refresh_access(self) -> None:
        """Before a round while the daemon is away: its token may be new (restarted)."""
        if self._link.gone:
            self._metadata = _refreshed_metadata(self.endpoint, self._metadata)

    def average(
        self,
        tensors: Sequence[Any],
        key: str,
        weight: float = 1.0,
        group_size: int | None = None,
        min_group_size: int = 2,
        timeout: float = 30.0,
        codec: str | None = None,
        state_digest: bytes | None = None,
        aggregation: str = "mean",
        max_group_size: int | None = None,
    ) -> AverageResult:
        """Average ``tensors`` with the peers that use the same ``key``.

        ``state_digest`` (at most 64 bytes): a digest of this process's shared state,
        handed to every member of the group; the result's ``state_digests`` holds the
        digest of every member that attached one (docs/peer.md, "State digests").

        ``aggregation``: ``"mean"``, ``"centered-clip"`` or ``"trimmed-mean"``, parameters
        in the name (``"centered-clip:tau=1.0,iters=5"``, ``"trimmed-mean:trim=0.25"``):
        robust aggregation for runs that admit strangers (docs/averaging.md,
        "Aggregation"). Only peers asking for the same rule average together; the
        result's ``aggregation``, ``num_adjusted`` and ``weights_clipped`` say what ran.

        ``max_group_size``: with a ``group_size``, the most members a group may hold, so
        that ``group_size`` is the number of peers to wait for rather than a cap: room for
        peers that call under the key although the caller did not count them (a
        newcomer's first report reaches some members before others). ``None``: groups
        hold at most ``group_size``. A daemon older than this parameter ignores it.

        Raises:
            ValidationError: bad input (nothing was sent).
            NoGroupError: fewer than ``min_group_size`` peers within ``timeout``.
            DaemonUnavailableError: the daemon is gone or shutting down.
            SwarmError: any other failure of the round.
        """
        for attempt in range(2):
            call = PreparedAverage(
                tensors,
                key=key,
                weight=weight,
                group_size=group_size,
                min_group_size=min_group_size,
                timeout=timeout,
                codec=codec,
                segments=self._segments if self._use_shm else None,
                state_digest=state_digest,
                aggregation=aggregation,
                max_group_size=max_group_size,
                client_id=self._client_id,
                write_during_declaration=self._early_writes.supported,
            )
            self._refresh_access()
            try:
                responses = self._stub.Average(
                    call.requests(), timeout=call.transport_timeout, metadata=self._metadata
                )
                for response in responses:
                    call.feed(response)
                result = call.result()
                self._link.answered()
                return result
            except grpc.RpcError as exc:
                _note_away(self._link, exc)
                error = _average_failure(
                    call, exc, self.endpoint, self._segments, self._early_writes, attempt
                )
                if error is None:
                    continue
                raise error from None
            finally:
                call.cleanup()
        raise AssertionError("unreachable")

    def publish_state(self, tensors: Sequence[Any], metadata: Any) -> None:
        """Serve ``tensors`` and ``metadata`` (msgpack-able) to peers that load state.

        Large states go through shared memory, as ``average``'s tensors do.

        Raises:
            ValidationError: bad tensors (types, dtypes, NaN/Inf) or metadata; nothing
                was sent.
        """
        pool = _publish_pool(self._publish_segments, self._use_shm, self._shm_publishes)
        call = PreparedPublish(tensors, metadata, pool)
        try:
            while True:
                try:
                    self._unary(self._stub.PublishState, call.messages(), stream=True)
                except SwarmError as exc:
                    if call.retry(exc, self._shm_publishes):
                        continue
                    raise
                call.succeeded()
                return
        finally:
            call.cleanup()

    def load_state(
        self, timeout: float = 60.0, max_bytes: int | None = None
    ) -> tuple[Any, list[Any]]:
        """Download the newest published state of the run: ``(metadata, numpy arrays)``.

        Args:
            timeout: seconds the download may take.
            max_bytes: the largest state (tensors and metadata) this caller accepts, e.g.
                what its own model's state takes; a larger one is refused before any of
                it is downloaded. ``None``: the daemon's cap (``max_state_bytes``).
        While the daemon downloads, its progress (bytes, rate, ETA) shows as a tqdm bar on
        a terminal when tqdm is installed, else as INFO lines of ``swarmavg.peer.client``
        every few seconds.

        Raises:
            NoStateError: no peer has published state.
        """
        display = DownloadDisplay()
        receiver = StateReceiver(display.update, LoadOffer.or_none(self._use_shm))
        try:
            for message in self._stub.LoadState(
                receiver.request(timeout, max_bytes),
                timeout=timeout + 10.0,
                metadata=self._metadata,
            ):
                receiver.feed(message)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, str(self.endpoint)) from None
        finally:
            display.close()
            receiver.close()
        return receiver.result()

    def status(self) -> dict[str, Any]:
        """The daemon's figures (see ``swarmavg status --json``)."""
        return status_to_dict(self._unary(self._stub.Status, control_pb2.StatusRequest()))

    def peers(self, training_run: str | None = None) -> dict[str, Any]:
        """Every peer of the run and the run's progress (see ``swarmavg peers --json``).

        Args:
            training_run: the run id the trainers report progress under (default: the
                daemon's run id, which is what the wrappers use when given the same one).
        """
        request = control_pb2.PeersRequest(training_run=training_run or "")
        return view_to_dict(self._unary(self._stub.Peers, request, SHORT_CALL_TIMEOUT))

    def close(self) -> None:
        """Close the channel (idempotent)."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def connect(
    endpoint: str | None = None,
    *,
    use_shm: bool = True,
    connect_timeout: float = CONNECT_TIMEOUT,
    reconnect_timeout: float = RECONNECT_TIMEOUT,
) -> Client:
    """Connect to the local daemon; use as ``with connect() as client:``.

    Args:
        endpoint: a unix socket path or ``127.0.0.1:PORT``; ``None``: ``$SWARMAVG_CONTROL``,
            else the default socket of ``$SWARMAVG_RUN_ID``, else the one daemon of this
            user on a default socket (:func:`resolve_endpoint`).
        use_shm: pass large tensors through shared memory when the daemon can map it.
        connect_timeout: seconds to wait for the daemon to answer.
        reconnect_timeout: seconds a call other than ``average`` waits for a daemon that
            went away to come back on the same endpoint (a restart); ``average`` fails at
            once meanwhile (peer/client/reconnect.py).

    Raises:
        DaemonUnavailableError: no daemon answers at the endpoint.
    """
    return Client(
        endpoint,
        use_shm=use_shm,
        connect_timeout=connect_timeout,
        reconnect_timeout=reconnect_timeout,
    )


class _AsyncDHT:
    """``client.dht`` of an :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def store(self, key: str, value: Any, ttl: float = 60.0, subkey: Any = None) -> bool:
        """Store ``value`` (any msgpack-able object) for ``ttl`` seconds; True if stored."""
        request = _store_request(key, value, ttl, subkey)
        response = await self._client._unary(self._client._stub.DHTStore, request)
        return bool(response.stored)

    async def get(self, key: str) -> Any:
        """The value, a dict subkey -> value for dictionary values, or ``None``."""
        validate_key(key)
        request = control_pb2.DHTGetRequest(key=key)
        return unpack_get(await self._client._unary(self._client._stub.DHTGet, request))


class AsyncClient:
    """An asyncio connection to the local daemon; create it with ``connect_async``."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        use_shm: bool = True,
        reconnect_timeout: float = RECONNECT_TIMEOUT,
    ) -> None:
        """Set up the channel (no I/O; :meth:`open` checks the daemon). A daemon that goes
        away later is waited for as :class:`Client` does (``reconnect_timeout``)."""
        self.endpoint = resolve_endpoint(endpoint)
        self._link = DaemonLink(str(self.endpoint), reconnect_timeout)
        self._requested_shm = use_shm
        self._use_shm = False
        self._channel: grpc.aio.Channel | None = None
        self._stub_or_none: control_pb2_grpc.ControlStub | None = None
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._client_id = secrets.token_hex(8)
        self._segments = SegmentPool()
        self._early_writes = DaemonSupport()
        # A published state is copied out by the daemon at once: one segment is enough.
        self._publish_segments = SegmentPool(keep=1)
        self._shm_publishes = DaemonSupport()
        self.dht = _AsyncDHT(self)

    @property
    def _stub(self) -> control_pb2_grpc.ControlStub:
        if self._stub_or_none is None:
            raise DaemonUnavailableError("client is not connected (use `await connect_async()`)")
        return self._stub_or_none

    async def open(self, connect_timeout: float = CONNECT_TIMEOUT) -> AsyncClient:
        """Open the channel (inside the running loop) and check that a daemon answers.

        Raises:
            DaemonUnavailableError: nothing answers within ``connect_timeout``.
        """
        self._metadata = _access(self.endpoint)
        self._channel = grpc.aio.insecure_channel(self.endpoint.grpc_target(), options=_OPTIONS)
        self._stub_or_none = control_pb2_grpc.ControlStub(self._channel)  # type: ignore[no-untyped-call]
        try:
            status = await self._stub.Status(
                control_pb2.StatusRequest(),
                timeout=connect_timeout,
                wait_for_ready=True,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            await self.close()
            raise _connect_error(self.endpoint, exc) from None
        except BaseException:
            await self.close()
            raise
        self._use_shm = self._requested_shm and shm_usable(status)
        self._link.answered(status.peer_id, status.pid)
        return self

    async def _unary(
        self, method: Any, request: Any, timeout: float = SHORT_CALL_TIMEOUT, stream: bool = False
    ) -> Any:
        """Same as :meth:`Client._unary`, as a coroutine."""
        give_up_at: float | None = None
        while True:
            try:
                sent = iter(request) if stream else request
                response = await method(sent, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                away = _away_reason(exc)
                give_up_at = self._link.retry_until(give_up_at)
                if away is None or time.monotonic() >= give_up_at:
                    raise error_from_rpc(exc, str(self.endpoint)) from None
                await self._wait_for_daemon(away)
                continue
            self._link.answered()
            return response

    async def _wait_for_daemon(self, reason: str) -> None:
        """Same as :meth:`Client._wait_for_daemon`, as a coroutine."""
        self._link.lost(reason)
        for pause in self._link.waits():
            try:
                self._metadata = _access(self.endpoint)
                status = await self._stub.Status(_PROBE, **_probe_options(self._metadata))
                if self._link.back(status.peer_id, status.pid):
                    return
                reason = STOPPING
            except (DaemonUnavailableError, grpc.RpcError) as exc:
                reason = _probe_failure(exc)
            await asyncio.sleep(pause)
        raise self._link.gave_up(reason)

    def _refresh_access(self) -> None:
        """Same as :meth:`Client._refresh_access`."""
        if self._link.gone:
            self._metadata = _refreshed_metadata(self.endpoint, self._metadata)

    async def average(
        self,
        tensors: Sequence[Any],
        key: str,
        weight: float = 1.0,
        group_size: int | None = None,
        min_group_size: int = 2,
        timeout: float = 30.0,
        codec: str | None = None,
        state_digest: bytes | None = None,
        aggregation: str = "mean",
        max_group_size: int | None = None,
    ) -> AverageResult:
        """Same as :meth:`Client.average`, as a coroutine."""
        for attempt in range(2):
            call = PreparedAverage(
                tensors,
                key=key,
                weight=weight,
                group_size=group_size,
                min_group_size=min_group_size,
                timeout=timeout,
                codec=codec,
                segments=self._segments if self._use_shm else None,
                state_digest=state_digest,
                aggregation=aggregation,
                max_group_size=max_group_size,
                client_id=self._client_id,
                write_during_declaration=self._early_writes.supported,
            )
            self._refresh_access()
            try:
                stream = self._stub.Average(
                    call.requests(), timeout=call.transport_timeout, metadata=self._metadata
                )
                async for response in stream:
                    call.feed(response)
                result = call.result()
                self._link.answered()
                return result
            except grpc.RpcError as exc:
                _note_away(self._link, exc)
                error = _average_failure(
                    call, exc, self.endpoint, self._segments, self._early_writes, attempt
                )
                if error is None:
                    continue
                raise error from None
            finally:
                call.cleanup()
        raise AssertionError("unreachable")

    async def publish_state(self, tensors: Sequence[Any], metadata: Any) -> None:
        """Same as :meth:`Client.publish_state`, as a coroutine."""
        pool = _publish_pool(self._publish_segments, self._use_shm, self._shm_publishes)
        call = PreparedPublish(tensors, metadata, pool)
        try:
            while True:
                try:
                    await self._unary(self._stub.PublishState, call.messages(), stream=True)
                except SwarmError as exc:
                    if call.retry(exc, self._shm_publishes):
                        continue
                    raise
                call.succeeded()
                return
        finally:
            call.cleanup()

    async def load_state(
        self, timeout: float = 60.0, max_bytes: int | None = None
    ) -> tuple[Any, list[Any]]:
        """Same as :meth:`Client.load_state`, as a coroutine."""
        display = DownloadDisplay()
        receiver = StateReceiver(display.update, LoadOffer.or_none(self._use_shm))
        try:
            stream = self._stub.LoadState(
                receiver.request(timeout, max_bytes),
                timeout=timeout + 10.0,
                metadata=self._metadata,
            )
            async for message in stream:
                receiver.feed(message)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, str(self.endpoint)) from None
        finally:
            display.close()
            receiver.close()
        return receiver.result()

    async def status(self) -> dict[str, Any]:
        """Same as :meth:`Client.status`, as a coroutine."""
        return status_to_dict(await self._unary(self._stub.Status, control_pb2.StatusRequest()))

    async def peers(self, training_run: str | None = None) -> dict[str, Any]:
        """Same as :meth:`Client.peers`, as a coroutine."""
        request = control_pb2.PeersRequest(training_run=training_run or "")
        return view_to_dict(await self._unary(self._stub.Peers, request, SHORT_CALL_TIMEOUT))

    async def close(self) -> None:
        """Close the channel (idempotent)."""
        channel, self._channel = self._channel, None
        self._stub_or_none = None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        if self._channel is None:
            await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class _AsyncConnect:
    """``await connect_async()`` or ``async with connect_async() as client``."""

    def __init__(self, client: AsyncClient, connect_timeout: float) -> None:
        self._client = client
        self._timeout = connect_timeout

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        return self._client.open(self._timeout).__await__()

    async def __aenter__(self) -> AsyncClient:
        return await self._client.open(self._timeout)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._client.close()


def connect_async(
    endpoint: str | None = None,
    *,
    use_shm: bool = True,
    connect_timeout: float = CONNECT_TIMEOUT,
    reconnect_timeout: float = RECONNECT_TIMEOUT,
) -> _AsyncConnect:
    """Connect an :class:`AsyncClient` to the local daemon (see :func:`connect`).

    Use as ``async with connect_async() as client:`` or ``client = await connect_async()``
    (then ``await client.close()``).
    """
    client = AsyncClient(endpoint, use_shm=use_shm, reconnect_timeout=reconnect_timeout)
    return _AsyncConnect(client, connect_timeout)


__all__ = [
    "AsyncClient",
    "AverageResult",
    "Client",
    "connect",
    "connect_async",
    "resolve_endpoint",
]
