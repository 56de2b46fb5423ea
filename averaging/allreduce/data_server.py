"""The data plane: ``Reduce`` streams over plain framed TCP, beside the gRPC service; its
server side (the client side is :mod:`~swarmavg.averaging.allreduce.data_connector`).

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
The client checks the server's side too: its credential must name the member the client
meant to dial (:meth:`DataConnector.open`), before the HELLO, so that another member of the
run on the path (a relay, a hijacked address) cannot take the reducer's place.

A server charges every frame body to a byte budget before it reads it (framing.py,
admission.py): until a stream's signed first message verified and its sender is a member of
a round here, only the small pending allowance of the connection's address range; a stream
refused there (``RESOURCE_EXHAUSTED``, before anything of it was processed) is sent over gRPC.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Container
from typing import NoReturn, Protocol

import grpc

from swarmavg.averaging.allreduce.admission import BudgetCaps, ByteBudget, Standing, host_group
from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.framing import (
    CLOSE,
    HELLO,
    MAGIC,
    MSG,
    STATUS,
    FrameProtocol,
    ProtocolError,
    status_body,
)
from swarmavg.averaging.allreduce.round import ReduceContext
from swarmavg.averaging.allreduce.wire import OutgoingChunk, Request, deserialize_request
from swarmavg.dht.ranges import limited_range
from swarmavg.dht.tasks import TaskSet
from swarmavg.dht.tls import HANDSHAKE_TIMEOUT, REVOKED_DETAILS, PeerTLS

log = logging.getLogger(__name__)

__all__ = ["DataPlaneServer", "ReduceHandler"]

_END_WAIT = 2.0  # seconds the server waits for a client's CLOSE after the stream ended
_IDLE_SERVER = 120.0  # the server closes a connection idle for longer than this (a client
# reuses one idle for less than data_connector._IDLE_CLIENT)


class _StreamAborted(Exception):
    """Raised by :meth:`_ServerStream.abort`, as ``context.abort`` does in gRPC."""


class _ServerStream:
    """The context and request iterator of one inbound stream (as gRPC gives a handler)."""

    def __init__(
        self,
        protocol: FrameProtocol,
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
        self.writes_bounded = True
        """:meth:`write` raises ``TimeoutError`` after ``write_timeout`` without progress
        (the round's own deadline per write is then not needed)."""

    def peer_host(self) -> str:
        """The host this stream's connection comes from ("" when unknown): what a gRPC
        context's ``peer()`` says, for the per-source limits of the Reduce service."""
        transport = getattr(self._protocol, "transport", None)
        name = transport.get_extra_info("peername") if transport is not None else None
        return str(name[0]) if isinstance(name, tuple) and name else ""

    def admitted(self, peer_id: bytes) -> None:
        """The service verified this stream's first message and found its sender
        ``peer_id`` a member of a round here: the connection's next bytes count against
        that member's budget, no longer the small pending allowance of its range."""
        self._protocol.admitted(peer_id)

    async def requests(self) -> AsyncIterator[Request]:
        first = True
        while True:
            kind, body = await self._protocol.next_frame()
            if kind == CLOSE:
                self.client_closed = True
                return
            if kind != MSG:
                raise ProtocolError(f"unexpected frame kind {kind} in a stream")
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
        if not self._protocol.write_paused:
            await self._protocol.drain()  # raises the connection's error; never waits
            return
        async with asyncio.timeout(self._write_timeout):  # a sender that stops reading
            await self._protocol.drain()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        self.finish(code, details)
        raise _StreamAborted(details)

    def finish(self, code: grpc.StatusCode, details: str = "") -> None:
        if not self.status_sent:
            self.status_sent = True
            with contextlib.suppress(OSError):
                self._protocol.send(STATUS, (status_body(code, details),))


class ReduceHandler(Protocol):
    """What the data plane needs of the reducer side: its timings and its stream handler
    (:class:`~swarmavg.averaging.allreduce.service.AllReduceService` is one)."""

    @property
    def config(self) -> AllReduceConfig: ...

    async def rpc_reduce(
        self, request_iterator: AsyncIterator[Request], context: ReduceContext
    ) -> None: ...

    def is_member_host(self, host: str) -> bool: ...


class DataPlaneServer:
    """Accepts data-plane connections and hands their streams to the reduce handler."""

    def __init__(
        self,
        service: ReduceHandler,
        max_connections: int = 256,
        max_connections_per_host: int = 64,
        caps: BudgetCaps | None = None,
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
        caps: the byte budget's caps (:class:`~swarmavg.averaging.allreduce.admission.BudgetCaps`):
            frame bodies being received or queued, in all, pending per range, and per
            member and range of a round's members. A body that does not fit waits (its
            connection is not read) until others are consumed; a pending one for at
            most ``first_message_timeout``, then its stream is refused and its sender
            uses gRPC.
        """
        self._service = service
        self.budget = ByteBudget(caps)
        """Bytes of frame bodies held now (see :mod:`~swarmavg.averaging.allreduce.admission`)."""
        self._max_connections = max_connections
        self._max_per_host = max_connections_per_host
        self._server: asyncio.Server | None = None
        self._tasks = TaskSet()  # one per served connection
        self._protocols: set[FrameProtocol] = set()
        self._per_host: collections.Counter[str] = collections.Counter()
        self._refused: set[FrameProtocol] = set()  # closing themselves (see reject)
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

    def _accept(self) -> FrameProtocol:
        config = self._service.config
        return FrameProtocol(
            admit=self._admit,
            budget=self.budget,
            congestion_control=self._congestion_control,
            make_room=self._make_room,
            pending_wait=min(config.first_message_timeout, config.registration_wait),
            member_host=self._service.is_member_host,
        )

    def _range_key(self, host: str) -> str:
        """The address range whose budget a connection from ``host`` is charged to; an
        exempt local host (``limit_local_ranges`` off) counts as its own range."""
        found = limited_range(host, self._service.config.limit_local_ranges) if host else None
        return found if found is not None else f"local {host_group(host)}"

    def _admit(self, protocol: FrameProtocol, host: str) -> bool:
        """Serve a new connection from ``host``, or refuse it (at a limit)."""
        group = host_group(host)
        protocol.range_key = self._range_key(host)
        if (
            len(self._protocols) >= self._max_connections
            or self._per_host[group] >= self._max_per_host
            # A certificate of the run's authority that names no peer: never served.
            or (self._tls is not None and protocol.peer_id is None)
        ):
            self._refused = {p for p in self._refused if not p.closed.is_set()}
            self._refused.add(protocol)
            return False
        self._protocols.add(protocol)
        self._per_host[group] += 1
        self._tasks.spawn(self._serve_connection(protocol, group), name=f"data-plane:{group}")
        return True

    def _make_room(self, protocol: FrameProtocol, nbytes: int) -> None:
        """Evict pending bodies so that ``protocol``'s next ``nbytes`` fit: the oldest of
        the range that holds most of the pending pool, as long as that range holds more
        than ``protocol``'s would with its body (fair share: ranges that keep the pool
        full cannot keep out one that holds little). A member's body may evict any
        pending one. Evicted streams are refused before anything of theirs was
        processed: their senders use gRPC."""
        budget = self.budget
        member = protocol.standing is Standing.MEMBER
        mine = 0 if member else budget.pending_by_range().get(protocol.range_key, 0)
        for _ in range(len(self._protocols)):
            accounts = protocol.accounts()
            if budget.blocking(accounts, nbytes) not in ("pending", "total"):
                return
            by_range = budget.pending_by_range()
            if not by_range:
                return
            top = max(by_range, key=lambda k: by_range[k])
            if not member and (top == protocol.range_key or by_range[top] < mine + nbytes):
                return
            victims = [
                p
                for p in self._protocols
                if p.range_key == top and p is not protocol and p.pending_held() > 0
            ]
            if not victims:
                return
            victim = min(victims, key=lambda p: p.pending_since)
            budget.evicted += 1
            victim.refuse("data plane busy: evicted for a range that held less")

    async def _serve_connection(self, protocol: FrameProtocol, host: str) -> None:
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
        except (OSError, TimeoutError, ProtocolError):
            return
        finally:
            protocol.close()
            protocol.discard_buffered()
            self._protocols.discard(protocol)
            self._per_host[host] -= 1
            if self._per_host[host] <= 0:
                del self._per_host[host]

    async def _serve_stream(self, protocol: FrameProtocol) -> bool:
        """Run one stream; return whether the connection may carry another."""
        config = self._service.config
        tls = self._tls
        expect = protocol.peer_id if tls is not None else None
        revoked = tls.revocations if tls is not None else ()
        protocol.begin_stream()
        stream = _ServerStream(protocol, config.write_timeout, expect_peer=expect, revoked=revoked)
        try:
            await self._service.rpc_reduce(stream.requests(), stream)
        except _StreamAborted:
            return False  # the client may still be writing: do not resync, close
        except (OSError, TimeoutError, ProtocolError) as e:
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
