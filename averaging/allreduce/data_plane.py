"""The data plane: ``Reduce`` streams over plain framed TCP, beside the gRPC service.

Why it exists: on fast links a round is CPU-bound, and gRPC's HTTP/2 stack costs about
2.2-2.6x the CPU per byte of a plain TCP stream (``benchmarks/transport_floor.py``: a
64 MB butterfly between 4 processes on loopback takes 0.26 s over gRPC streams and
0.12 s over sockets, before any averaging). The data plane carries exactly the messages
of the gRPC ``Reduce`` stream, byte for byte, so the reducer code, its checks of hostile
input and its fault handling are the same for both transports; only the framing differs.

It is opportunistic: a member that serves it advertises its port in matchmaking
(``JoinRequest.data_port`` -> ``GroupMember.data_port``); a sender that cannot connect
within ``AllReduceConfig.data_connect_timeout`` remembers that for a while and uses the
gRPC ``Reduce`` method, which every member always serves.

Wire, version 2. Every connection starts with a HELLO frame from the client, which the
server answers with its own HELLO; the client sends nothing more until that answer came
(a member told to stream to some ``host:port`` must not pump its part at whatever
listens there, a reflection attack; version 1 sent its chunks right behind its HELLO).
Frames::

    <u32 little-endian body length> <u8 kind> <body>

    HELLO  (0)  client -> server, then server -> client, body ``swarmavg-reduce/2``, once
                per connection
    MSG    (1)  one ``ReduceRequest`` (client -> server) or ``ReduceResponse``
                (server -> client), the bytes the gRPC stream would carry
    CLOSE  (2)  client -> server, empty: the client wrote its last message (half-close)
    STATUS (3)  server -> client: <u8 gRPC status code> <UTF-8 details>: the stream
                ended; ``OK`` after every averaged chunk was sent

A connection carries one stream at a time. When a stream ended with ``OK`` and both
sides saw its end, the client keeps the connection for the next stream to the same
reducer (across rounds); anything else closes it. Bodies above :data:`MAX_BODY` (gRPC's
message cap here) and unknown kinds close the connection at once.

In a private run every connection is mutual TLS 1.3 with the run's credentials
(:class:`~swarmavg.dht.tls.PeerTLS`, the same files as the gRPC port): a client without a
credential of the run fails the handshake, before its HELLO is read, and the first message of
every stream must name the peer id of the connection's credential (else ``PERMISSION_DENIED``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import struct
import time
from collections.abc import AsyncIterator, Callable, Container, Sequence
from typing import Any, NoReturn, Protocol, cast

import grpc
import numpy as np

from swarmavg.averaging.allreduce.admission import ByteBudget, host_group
from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.congestion import (
    CongestionControlError,
    set_congestion_control,
)
from swarmavg.averaging.allreduce.round import ReduceContext
from swarmavg.averaging.allreduce.wire import (
    OutgoingChunk,
    Request,
    deserialize_reply,
    deserialize_request,
)
from swarmavg.dht.tasks import TaskSet
from swarmavg.dht.tls import (
    HANDSHAKE_TIMEOUT,
    REVOKED_DETAILS,
    SERVER_HOSTNAME,
    PeerTLS,
    peer_id_of_der,
)

log = logging.getLogger(__name__)

__all__ = [
    "MAX_BODY",
    "DataCall",
    "DataConnector",
    "DataPlaneServer",
    "DataStreamError",
    "ReduceHandler",
    "split_host",
]

HELLO, MSG, CLOSE, STATUS = 0, 1, 2, 3
_KINDS = frozenset((HELLO, MSG, CLOSE, STATUS))
_HEAD = struct.Struct("<IB")
MAGIC = b"swarmavg-reduce/2"
MAX_BODY = (4 << 20) + (64 << 10)
"""Largest frame body accepted: gRPC's 4 MiB message cap, which every chunk respects
(``AllReduceConfig.chunk_bytes`` is at most ``partition.MAX_CHUNK_BYTES``, 3 MiB), plus
room for headers."""
_MAX_DETAILS = 1024
# Flow control: a connection stops being read while this much is buffered, so that a
# peer that sends faster than we reduce (or a hostile one) holds little memory here.
_QUEUE_HIGH_FRAMES = 16
_QUEUE_HIGH_BYTES = 4 << 20
_WRITE_HIGH = 4 << 20
_WRITE_LOW = 1 << 20
_END_WAIT = 2.0  # seconds the server waits for a client's CLOSE after the stream ended
_IDLE_CLIENT = 30.0  # a client reuses a connection idle for less than this...
_IDLE_SERVER = 120.0  # ...and the server closes one idle for longer than this
_MAX_IDLE_PER_PEER = 8
_MAX_UNREACHABLE = 1024  # remembered unreachable reducers; their addresses come from leaders
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class DataStreamError(grpc.RpcError):  # type: ignore[misc]  # grpc has no stubs
    """A data-plane stream ended with an error status, or its connection broke."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _ProtocolError(ValueError):
    pass


class _StreamAborted(Exception):
    """Raised by :meth:`_ServerStream.abort`, as ``context.abort`` does in gRPC."""


def split_host(address: str) -> str:
    """The host of ``HOST:PORT`` (brackets of an IPv6 literal removed)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _status_body(code: grpc.StatusCode, details: str) -> bytes:
    return bytes((code.value[0],)) + details.encode("utf-8", "replace")[:_MAX_DETAILS]


def _parse_status(body: memoryview) -> tuple[grpc.StatusCode, str]:
    if len(body) < 1 or len(body) > 1 + _MAX_DETAILS or body[0] not in _CODES:
        return grpc.StatusCode.INTERNAL, "malformed status frame"
    return _CODES[body[0]], bytes(body[1:]).decode("utf-8", "replace")


class _FrameProtocol(asyncio.BufferedProtocol):
    """Frames in (read straight into their final buffers) and out, with flow control."""

    def __init__(
        self,
        admit: Callable[[_FrameProtocol, str], bool] | None = None,
        budget: ByteBudget | None = None,
        congestion_control: str | None = None,
    ) -> None:
        """Args:
        admit: on a server, called with the client's host group once connected;
            ``False`` refuses the connection (see :attr:`reject`).
        budget: on a server, the bytes every frame body is charged to before it is
            allocated (:mod:`~swarmavg.averaging.allreduce.admission`).
        congestion_control: TCP congestion control algorithm for the connection's socket
            (:mod:`~swarmavg.averaging.allreduce.congestion`); ``None``: the kernel's default.
        """
        self._admit = admit
        self._budget = budget
        self._congestion_control = congestion_control
        self.host_group = ""
        self._held = 0  # budget bytes of this connection: the body being read, queued bodies
        self._wanted = 0  # a declared body length waiting for the budget
        self._budget_paused = False
        self.transport: asyncio.Transport | None = None
        self._head = bytearray(_HEAD.size)
        self._body: np.ndarray | None = None
        self._kind = 0
        self._filled = 0
        self._frames: collections.deque[tuple[int, memoryview]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._queued_bytes = 0
        self._reading_paused = False
        self.reject = False
        """Refuse the connection as soon as it is made (the server is at its limit): send a
        ``RESOURCE_EXHAUSTED`` status, discard what arrives, close when the client does."""
        self.error: Exception | None = None
        self.closed = asyncio.Event()
        self.peer_id: bytes | None = None
        """On a TLS connection, the peer id of the other side's verified credential."""

    # ---- asyncio callbacks ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.set_write_buffer_limits(high=_WRITE_HIGH, low=_WRITE_LOW)
        if self._congestion_control is not None:
            self._set_congestion_control(self._congestion_control)
        ssl_object = self.transport.get_extra_info("ssl_object")
        if ssl_object is not None:  # called after the handshake: the certificate is verified
            der = ssl_object.getpeercert(binary_form=True)
            self.peer_id = peer_id_of_der(der) if der else None
        if self._admit is not None:
            peer = self.transport.get_extra_info("peername")
            host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            self.host_group = host_group(host)
            self.reject = not self._admit(self, self.host_group)
        if self.reject:
            # A status the client can read before it has sent anything that was processed,
            # so it knows it may use gRPC instead. Closing at once, with its bytes unread,
            # would reset the connection and lose the status: drain until it closes.
            body = _status_body(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many data connections")
            self.transport.writelines([_HEAD.pack(len(body), STATUS), body])
            asyncio.get_running_loop().call_later(_END_WAIT, self.transport.abort)

    def _set_congestion_control(self, name: str) -> None:
        """Give this connection's socket algorithm ``name``. Both ends set it: each side's
        algorithm governs what that side sends (the chunks one way, the averages back).
        The daemon checked the name at start, so a refusal here is unexpected: logged,
        and the connection goes on with the kernel's default rather than failing."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return
        try:
            set_congestion_control(sock, name)
        except (CongestionControlError, OSError) as exc:
            log.warning("data plane connection keeps the default congestion control: %s", exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.reject:
            return memoryview(self._head)  # scratch: a refused connection's bytes are dropped
        if self._body is None:
            return memoryview(self._head)[self._filled :]
        return self._body.data[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.reject:
            return
        self._filled += nbytes
        if self._body is None:
            if self._filled < _HEAD.size:
                return
            length, kind = _HEAD.unpack(self._head)
            self._filled = 0
            if length > MAX_BODY or kind not in _KINDS:
                self._fail(_ProtocolError(f"bad frame (kind {kind}, {length} bytes)"))
                return
            self._kind = kind
            if length:
                self._admit_body(length)
                return
            self._deliver(memoryview(b""))
        elif self._filled == self._body.size:
            body, self._body, self._filled = self._body, None, 0
            self._deliver(body.data)

    def _admit_body(self, length: int) -> None:
        """Allocate the next body once the budget has its bytes (never on the
        header's word alone); until then this connection is not read."""
        if self._budget is None:
            self._body = np.empty(length, np.uint8)  # no zero-fill: recv writes it all
        elif self._budget.try_acquire(self.host_group, length):
            self._held += length
            self._body = np.empty(length, np.uint8)
        else:
            self._wanted = length
            self._budget_paused = True
            self._update_reading()
            self._budget.wait(self._retry_body)

    def _retry_body(self) -> bool:
        if self._budget is None or self.error is not None or not self._wanted:
            return True  # closed meanwhile: stop waiting
        if not self._budget.try_acquire(self.host_group, self._wanted):
            return False
        self._held += self._wanted
        self._body = np.empty(self._wanted, np.uint8)
        self._wanted = 0
        self._budget_paused = False
        self._update_reading()
        return True

    def _release(self, nbytes: int) -> None:
        if self._budget is not None and nbytes:
            nbytes = min(nbytes, self._held)
            self._held -= nbytes
            self._budget.release(self.host_group, nbytes)

    def _update_reading(self) -> None:
        """Read the socket unless the frame queue is full or a body waits for the budget."""
        paused = self._budget_paused or self._over_high_water()
        if self.transport is None or paused == self._reading_paused:
            return
        self._reading_paused = paused
        if paused:
            self.transport.pause_reading()
        elif not self.transport.is_closing():
            self.transport.resume_reading()

    def _deliver(self, body: memoryview) -> None:
        self._frames.append((self._kind, body))
        self._queued_bytes += body.nbytes
        self._update_reading()
        self._wake()

    def _over_high_water(self) -> bool:
        return len(self._frames) >= _QUEUE_HIGH_FRAMES or self._queued_bytes >= _QUEUE_HIGH_BYTES

    def eof_received(self) -> bool:
        self._fail(ConnectionResetError("connection closed by the other side"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionResetError("connection closed"))
        self.closed.set()
        if self._budget is not None:
            # The body being read is lost; frames queued before stay readable (and
            # charged) until taken or discarded.
            self._wanted = 0
            self._budget.forget(self._retry_body)
            self._body = None
            self._release(self._held - self._queued_bytes)
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # ---- used by streams ----

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def usable(self) -> bool:
        return self.error is None and self.transport is not None and not self.transport.is_closing()

    async def next_frame(self) -> tuple[int, memoryview]:
        """The next frame; raises the connection's error once no frame is left."""
        await self.wait_for_frame()
        frame = self._frames.popleft()
        self._queued_bytes -= frame[1].nbytes
        self._release(frame[1].nbytes)
        self._update_reading()
        return frame

    def send(self, kind: int, pieces: Sequence[bytes | memoryview]) -> None:
        """Queue one frame (never blocks; :meth:`drain` waits for room)."""
        if not self.usable or self.transport is None:
            raise self.error or ConnectionResetError("connection closed")
        size = sum(memoryview(p).nbytes for p in pieces)
        self.transport.writelines([_HEAD.pack(size, kind), *pieces])

    async def drain(self) -> None:
        if self._writable is not None and not self._writable.done():
            await self._writable
        if self.error is not None:
            raise self.error

    async def wait_for_frame(self) -> None:
        """Wait until a frame is buffered (not taking it), or raise the connection's error."""
        while not self._frames:
            if self.error is not None:
                raise self.error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def discard_buffered(self) -> None:
        """Drop every queued frame and give its bytes back to the budget (the server
        calls this when it stops serving the connection)."""
        self._frames.clear()
        self._queued_bytes = 0
        if not self.closed.is_set():
            self._wanted = 0
            if self._budget is not None:
                self._budget.forget(self._retry_body)
            self._body = None
        self._release(self._held)

    def close(self, *, discard: bool = False) -> None:
        """Close the connection; ``discard`` drops unsent bytes instead of flushing them
        (a sender's unsent chunks may be views of its caller's tensors)."""
        if self.transport is not None:
            if discard:
                self.transport.abort()
            else:
                self.transport.close()


def _connection_error(error: BaseException) -> DataStreamError:
    return DataStreamError(grpc.StatusCode.UNAVAILABLE, f"data connection failed: {error!r}")


# ---------------------------------------------------------------------------------------
# Client side


class DataCall:
    """One ``Reduce`` stream on a data connection; quacks like the gRPC call for the sender.

    ``read`` returns :class:`~swarmavg.averaging.allreduce.wire.Reply` objects and then
    ``grpc.aio.EOF``; an error status raises :class:`DataStreamError`. Always
    :meth:`cancel` it at the end: a cleanly finished stream gives its connection back for
    reuse, anything else closes the connection.
    """

    def __init__(self, protocol: _FrameProtocol, release: Callable[[_FrameProtocol], None]):
        self._protocol = protocol
        self._release = release
        self._wrote_close = False
        self._finished_ok = False
        self._done = False

    async def write_pieces(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Send one ``ReduceRequest`` given as the pieces of its wire bytes."""
        try:
            self._protocol.send(MSG, pieces)
            await self._protocol.drain()
        except (OSError, _ProtocolError) as e:
            raise _connection_error(e) from e
        # Yield even when the socket took everything: a sender that encodes chunk after
        # chunk without suspending would starve this peer's reads (its reducer and the
        # replies), and the other peers would then wait on it instead of working.
        await asyncio.sleep(0)

    async def write(self, message: bytes) -> None:
        await self.write_pieces((message,))

    async def done_writing(self) -> None:
        try:
            self._protocol.send(CLOSE, ())
        except (OSError, _ProtocolError) as e:
            raise _connection_error(e) from e
        self._wrote_close = True

    async def read(self) -> Any:  # Reply | grpc.aio.EOF, as the gRPC call (untyped)
        """The next :class:`Reply`, or ``grpc.aio.EOF`` after an ``OK`` status."""
        if self._finished_ok:
            return grpc.aio.EOF
        try:
            kind, body = await self._protocol.next_frame()
        except (OSError, _ProtocolError) as e:
            raise _connection_error(e) from e
        if kind == MSG:
            return deserialize_reply(body)  # type: ignore[arg-type]  # scans any buffer
        if kind == STATUS:
            code, details = _parse_status(body)
            if code is grpc.StatusCode.OK:
                self._finished_ok = True
                return grpc.aio.EOF
            raise DataStreamError(code, details)
        self._protocol.close(discard=True)
        raise DataStreamError(grpc.StatusCode.INTERNAL, f"unexpected frame kind {kind}")

    async def finish(self, timeout: float) -> bool:
        """After the last reply: read the stream's final status (at most ``timeout``
        seconds); return whether it ended cleanly (the connection is then reusable)."""
        try:
            async with asyncio.timeout(timeout):
                while await self.read() is not grpc.aio.EOF:
                    self._protocol.close(discard=True)  # a reply too many
                    return False
        except (TimeoutError, DataStreamError):
            return False
        return True

    def cancel(self) -> None:
        """End the call: reuse the connection if the stream finished cleanly, else close it."""
        if self._done:
            return
        self._done = True
        if self._finished_ok and self._wrote_close and self._protocol.usable:
            self._release(self._protocol)
        else:
            self._protocol.close(discard=True)


class DataConnector:
    """Opens data-plane streams to reducers, reusing idle connections (one per daemon)."""

    def __init__(
        self,
        connect_timeout: float = 1.0,
        retry_after: float = 300.0,
        tls: PeerTLS | None = None,
        hello_timeout: float = 5.0,
        congestion_control: str | None = None,
    ) -> None:
        """Args:
        connect_timeout: at most this long to open a connection (TLS handshake included).
        retry_after: after a failed connect, use gRPC for this reducer this long.
        tls: this peer's TLS setup in a private run (None: plain TCP).
        hello_timeout: at most this long for the server's HELLO once connected (a loaded
            reducer answers late, and falling back to gRPC for ``retry_after`` costs more;
            the server gives a client as long, ``registration_wait``, for its HELLO).
        congestion_control: TCP congestion control algorithm of every connection opened
            (``None``: the kernel's default).
        """
        self._congestion_control = congestion_control
        self.connect_timeout = connect_timeout
        self.hello_timeout = hello_timeout
        self.retry_after = retry_after
        self._tls = tls
        self._idle: dict[tuple[str, int], list[tuple[float, _FrameProtocol]]] = {}
        self._unreachable: dict[tuple[str, int], float] = {}
        self._closed = False
        self.opened = 0
        """Connections opened so far (the rest of the streams reused one)."""
        self.route: Callable[[str | None, str, int], tuple[str, int]] | None = None
        """Where a new connection to ``(peer's gRPC address, host, port)`` connects (None:
        ``host:port``); set by a NATed peer's direct links after hole punching. Idle
        connections stay filed under ``host:port``."""

    def refused(self, host: str, port: int) -> None:
        """The reducer at ``host:port`` refused or could not take a stream: use gRPC for
        it for ``retry_after`` seconds."""
        now = time.monotonic()
        key = (host, port)
        self._unreachable.pop(key, None)  # re-inserted last: the dict stays in expiry order
        self._unreachable[key] = now + self.retry_after
        if len(self._unreachable) > _MAX_UNREACHABLE:
            # Addresses come from group leaders, strangers: keep the table bounded, first
            # by forgetting expired entries, then the oldest.
            self._unreachable = {k: t for k, t in self._unreachable.items() if t > now}
            while len(self._unreachable) > _MAX_UNREACHABLE:
                del self._unreachable[next(iter(self._unreachable))]

    @property
    def remembered_unreachable(self) -> int:
        """Reducers remembered as unreachable now (at most 1024)."""
        return len(self._unreachable)

    def forget(self, host: str, port: int) -> None:
        """Close the idle connections to ``host:port`` (its route changed)."""
        for _, protocol in self._idle.pop((host, port), []):
            protocol.close()

    async def open(
        self, host: str, port: int, timeout: float, peer: str | None = None
    ) -> DataCall | None:
        """A new stream to ``host:port`` (the data plane of the peer at gRPC address
        ``peer``), or ``None`` (unreachable now: use gRPC)."""
        key = (host, port)
        now = time.monotonic()
        if self._closed or self._unreachable.get(key, 0.0) > now:
            return None
        # Idle connections are filed under where they lead: when the route changes (a direct
        # link after hole punching), the next stream takes the new route, not an old one.
        target = key if self.route is None else self.route(peer, host, port)
        idle = self._idle.get(target, [])
        while idle:
            since, idle_protocol = idle.pop()
            if idle_protocol.usable and now - since < _IDLE_CLIENT:
                return DataCall(idle_protocol, self._release_to(target))
            idle_protocol.close()
        self._idle.pop(target, None)  # no empty lists left behind for every address ever used
        loop = asyncio.get_running_loop()
        protocol: _FrameProtocol | None = None
        until = now + max(timeout, 0.001)
        try:
            async with asyncio.timeout(max(min(timeout, self.connect_timeout), 0.001)):
                if self._tls is None:
                    _, protocol = await loop.create_connection(self._new_protocol, *target)
                else:
                    _, protocol = await loop.create_connection(
                        self._new_protocol,
                        *target,
                        ssl=self._tls.client_context,
                        server_hostname=SERVER_HOSTNAME,
                    )
            protocol.send(HELLO, (MAGIC,))
            # Not one byte of a part before the remote proved it is a data plane.
            wait = min(until - time.monotonic(), self.hello_timeout)
            async with asyncio.timeout(max(wait, 0.001)):
                kind, body = await protocol.next_frame()
                if kind != HELLO or bytes(body) != MAGIC:
                    raise _ProtocolError(f"answered frame kind {kind}, not a data-plane HELLO")
            self.opened += 1
        except (OSError, TimeoutError, _ProtocolError) as e:
            log.info("data plane %s:%d unreachable (%r); using gRPC", host, port, e)
            if protocol is not None:
                protocol.close(discard=True)
            self.refused(host, port)
            return None
        return DataCall(protocol, self._release_to(target))

    def _new_protocol(self) -> _FrameProtocol:
        return _FrameProtocol(congestion_control=self._congestion_control)

    def _release_to(self, key: tuple[str, int]) -> Callable[[_FrameProtocol], None]:
        def release(protocol: _FrameProtocol) -> None:
            idle = self._idle.setdefault(key, [])
            if self._closed or len(idle) >= _MAX_IDLE_PER_PEER:
                protocol.close()
            else:
                idle.append((time.monotonic(), protocol))

        return release

    def close(self) -> None:
        """Close every idle connection; later :meth:`open` calls return ``None``."""
        self._closed = True
        for idle in self._idle.values():
            for _, protocol in idle:
                protocol.close()
        self._idle.clear()


# ---------------------------------------------------------------------------------------
# Server side


class _ServerStream:
    """The context and request iterator of one inbound stream (as gRPC gives a handler)."""

    def __init__(
        self,
        protocol: _FrameProtocol,
        write_timeout: float,
        *,
        expect_peer: bytes | None = None,
        revoked: Container[bytes] = (),
    ) -> None:
        """Args:
        expect_peer: on a TLS connection, the peer id its credential names: the stream's
            first message must name it too.
        revoked: peer ids the run's organiser revoked: their streams are refused at the
            first message (read per stream, so a list adopted later applies to the next
            stream of a connection already open).
        """
        self._protocol = protocol
        self._write_timeout = write_timeout
        self._expect_peer = expect_peer
        self._revoked = revoked
        self.client_closed = False
        self.status_sent = False

    def peer_host(self) -> str:
        """The host this stream's connection comes from ("" when unknown): what a gRPC
        context's ``peer()`` says, for the per-source limits of the Reduce service."""
        transport = getattr(self._protocol, "transport", None)
        name = transport.get_extra_info("peername") if transport is not None else None
        return str(name[0]) if isinstance(name, tuple) and name else ""

    async def requests(self) -> AsyncIterator[Request]:
        first = True
        while True:
            kind, body = await self._protocol.next_frame()
            if kind == CLOSE:
                self.client_closed = True
                return
            if kind != MSG:
                raise _ProtocolError(f"unexpected frame kind {kind} in a stream")
            request = deserialize_request(body)  # type: ignore[arg-type]  # scans any buffer
            if first and self._expect_peer is not None:
                if self._expect_peer in self._revoked:
                    await self.abort(grpc.StatusCode.PERMISSION_DENIED, REVOKED_DETAILS)
                claimed = request.header.peer_id if request.header is not None else b""
                if claimed != self._expect_peer:
                    await self.abort(
                        grpc.StatusCode.PERMISSION_DENIED,
                        "the stream names another peer than its TLS credential "
                        f"({self._expect_peer.hex()[:12]})",
                    )
            first = False
            yield request

    async def write(self, message: OutgoingChunk) -> None:
        self._protocol.send(MSG, message.pieces)  # no join: the socket takes pieces
        async with asyncio.timeout(self._write_timeout):  # a sender that stops reading
            await self._protocol.drain()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        self.finish(code, details)
        raise _StreamAborted(details)

    def finish(self, code: grpc.StatusCode, details: str = "") -> None:
        if not self.status_sent:
            self.status_sent = True
            with contextlib.suppress(OSError):
                self._protocol.send(STATUS, (_status_body(code, details),))


class ReduceHandler(Protocol):
    """What the data plane needs of the reducer side: its timings and its stream handler
    (:class:`~swarmavg.averaging.allreduce.service.AllReduceService` is one)."""

    @property
    def config(self) -> AllReduceConfig: ...

    async def rpc_reduce(
        self, request_iterator: AsyncIterator[Request], context: ReduceContext
    ) -> None: ...


class DataPlaneServer:
    """Accepts data-plane connections and hands their streams to the reduce handler."""

    def __init__(
        self,
        service: ReduceHandler,
        max_connections: int = 256,
        max_connections_per_host: int = 64,
        max_buffered_bytes: int = 256 << 20,
        max_buffered_bytes_per_host: int = 64 << 20,
        tls: PeerTLS | None = None,
        congestion_control: str | None = None,
    ) -> None:
        """Args:
        tls: this peer's TLS setup in a private run (None: plain TCP): only clients with a
            credential of the run complete the handshake.
        congestion_control: TCP congestion control algorithm of every accepted connection
            (``None``: the kernel's default).
        max_connections: open connections in all; more are refused.
        max_connections_per_host: open connections from one host group (an IPv4
            address, an IPv6 /64). An honest member holds one per concurrent stream to
            this peer; the cap keeps one host from taking every slot.
        max_buffered_bytes: frame bodies being received or queued, in all; a body that
            does not fit waits (its connection is not read) until others are consumed.
        max_buffered_bytes_per_host: the same, per host group. An honest sender has
            at most one queued stream's worth (4 MiB) plus one body in flight per
            connection; a 16-peer group's senders together stay under 128 MiB.
        """
        self._service = service
        self.budget = ByteBudget(max_buffered_bytes, max_buffered_bytes_per_host)
        """Bytes of frame bodies held now (see :mod:`~swarmavg.averaging.allreduce.admission`)."""
        self._max_connections = max_connections
        self._max_per_host = max_connections_per_host
        self._server: asyncio.Server | None = None
        self._tasks = TaskSet()  # one per served connection
        self._protocols: set[_FrameProtocol] = set()
        self._per_host: collections.Counter[str] = collections.Counter()
        self._refused: set[_FrameProtocol] = set()  # closing themselves (see reject)
        self._tls = tls
        self._congestion_control = congestion_control
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0: any free port); return the port."""
        loop = asyncio.get_running_loop()
        if self._tls is None:
            self._server = await loop.create_server(self._accept, host or None, port)
        else:
            self._server = await loop.create_server(
                self._accept,
                host or None,
                port,
                ssl=self._tls.server_context,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
            )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def _accept(self) -> _FrameProtocol:
        return _FrameProtocol(
            admit=self._admit, budget=self.budget, congestion_control=self._congestion_control
        )

    def _admit(self, protocol: _FrameProtocol, host: str) -> bool:
        """Serve a new connection from ``host``, or refuse it (at a limit)."""
        if (
            len(self._protocols) >= self._max_connections
            or self._per_host[host] >= self._max_per_host
            # A certificate of the run's authority that names no peer: never served.
            or (self._tls is not None and protocol.peer_id is None)
        ):
            self._refused = {p for p in self._refused if not p.closed.is_set()}
            self._refused.add(protocol)
            return False
        self._protocols.add(protocol)
        self._per_host[host] += 1
        self._tasks.spawn(self._serve_connection(protocol, host), name=f"data-plane:{host}")
        return True

    async def _serve_connection(self, protocol: _FrameProtocol, host: str) -> None:
        config = self._service.config
        try:
            async with asyncio.timeout(config.registration_wait):
                kind, body = await protocol.next_frame()
            if kind != HELLO or bytes(body) != MAGIC:
                return
            protocol.send(HELLO, (MAGIC,))  # the client streams only after this answer
            while True:
                try:
                    async with asyncio.timeout(_IDLE_SERVER):
                        await protocol.wait_for_frame()
                except TimeoutError:
                    return
                if not await self._serve_stream(protocol):
                    return
        except (OSError, TimeoutError, _ProtocolError):
            return
        finally:
            protocol.close()
            protocol.discard_buffered()
            self._protocols.discard(protocol)
            self._per_host[host] -= 1
            if self._per_host[host] <= 0:
                del self._per_host[host]

    async def _serve_stream(self, protocol: _FrameProtocol) -> bool:
        """Run one stream; return whether the connection may carry another."""
        config = self._service.config
        tls = self._tls
        expect = protocol.peer_id if tls is not None else None
        revoked = tls.revocations if tls is not None else ()
        stream = _ServerStream(protocol, config.write_timeout, expect_peer=expect, revoked=revoked)
        try:
            await self._service.rpc_reduce(stream.requests(), stream)
        except _StreamAborted:
            return False  # the client may still be writing: do not resync, close
        except (OSError, TimeoutError, _ProtocolError) as e:
            stream.finish(grpc.StatusCode.UNAVAILABLE, f"stream failed: {e!r}")
            return False
        except Exception:
            log.exception("data plane: Reduce handler failed")
            stream.finish(grpc.StatusCode.INTERNAL, "internal error")
            return False
        stream.finish(grpc.StatusCode.OK)
        # The client half-closes right after its last chunk; skip to its CLOSE.
        try:
            async with asyncio.timeout(_END_WAIT):
                while not stream.client_closed:
                    kind, _ = await protocol.next_frame()
                    if kind == CLOSE:
                        stream.client_closed = True
                    elif kind != MSG:
                        return False
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop listening, close every connection and wait for their tasks."""
        if self._server is not None:
            self._server.close()
        for protocol in list(self._protocols):
            protocol.close()
        for protocol in self._refused:
            protocol.close(discard=True)
        await self._tasks.close()
        if self._server is not None:
            await self._server.wait_closed()
