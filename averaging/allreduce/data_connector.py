"""The data plane's client side: ``Reduce`` streams to other members' data planes.

A :class:`DataConnector` (one per daemon) opens streams to reducers over plain framed TCP
(mutual TLS in a private run), reusing idle connections across rounds, and remembers the
reducers it could not reach, which are then asked over gRPC. A :class:`DataCall` is one
stream on a connection, used by the sender as it uses the gRPC call. The protocol, and why
the data plane exists, are described in :mod:`~swarmavg.averaging.allreduce.data_server`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from swarmavg.averaging.allreduce.framing import (
    CLOSE,
    HELLO,
    MAGIC,
    MSG,
    STATUS,
    FrameProtocol,
    ProtocolError,
    parse_status,
)
from swarmavg.averaging.allreduce.wire import deserialize_reply
from swarmavg.dht.tls import SERVER_HOSTNAME, PeerTLS

log = logging.getLogger(__name__)

__all__ = ["DataCall", "DataConnector", "DataStreamError", "WrongPeerError"]

_IDLE_CLIENT = 30.0  # a client reuses a connection idle for less than this (the server
# closes one idle for longer than data_server._IDLE_SERVER)
_MAX_IDLE_PER_PEER = 8
_MAX_UNREACHABLE = 1024  # remembered unreachable reducers; their addresses come from leaders


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


class WrongPeerError(ProtocolError):
    """A private run's data-plane server presented the credential of another member than
    the one dialled."""


def _connection_error(error: BaseException) -> DataStreamError:
    return DataStreamError(grpc.StatusCode.UNAVAILABLE, f"data connection failed: {error!r}")


class DataCall:
    """One ``Reduce`` stream on a data connection; quacks like the gRPC call for the sender.

    ``read`` returns :class:`~swarmavg.averaging.allreduce.wire.Reply` objects and then
    ``grpc.aio.EOF``; an error status raises :class:`DataStreamError`. Always
    :meth:`cancel` it at the end: a cleanly finished stream gives its connection back for
    reuse, anything else closes the connection.
    """

    def __init__(self, protocol: FrameProtocol, release: Callable[[FrameProtocol], None]):
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
        except (OSError, ProtocolError) as e:
            raise _connection_error(e) from e
        # Yield even when the socket took everything: a sender that encodes chunk after
        # chunk without suspending would starve this peer's reads (its reducer and the
        # replies), and the other peers would then wait on it instead of working.
        await asyncio.sleep(0)

    async def write(self, message: bytes) -> None:
        await self.write_pieces((message,))

    @property
    def reply_ready(self) -> bool:
        """Whether :meth:`read` returns without waiting (a frame of the stream is queued)."""
        return self._finished_ok or self._protocol.frame_ready

    async def done_writing(self) -> None:
        try:
            self._protocol.send(CLOSE, ())
        except (OSError, ProtocolError) as e:
            raise _connection_error(e) from e
        self._wrote_close = True

    async def read(self) -> Any:  # Reply | grpc.aio.EOF, as the gRPC call (untyped)
        """The next :class:`Reply`, or ``grpc.aio.EOF`` after an ``OK`` status."""
        if self._finished_ok:
            return grpc.aio.EOF
        try:
            kind, body = await self._protocol.next_frame()
        except (OSError, ProtocolError) as e:
            raise _connection_error(e) from e
        if kind == MSG:
            return deserialize_reply(body)  # type: ignore[arg-type]  # scans any buffer
        if kind == STATUS:
            code, details = parse_status(body)
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

    def discard(self) -> None:
        """End the call and close its connection even after an ``OK`` status: one that came
        before the stream's last reply was not the reducer's (it may still be sending)."""
        self._finished_ok = False
        self.cancel()

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
        self._idle: dict[tuple[str, int], list[tuple[float, FrameProtocol]]] = {}
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

    def reachable(self, host: str, port: int) -> bool:
        """Whether a stream to ``host:port`` would be tried here now (not remembered as
        unreachable, the connector not closed)."""
        return not self._closed and self._unreachable.get((host, port), 0.0) <= time.monotonic()

    @property
    def remembered_unreachable(self) -> int:
        """Reducers remembered as unreachable now (at most 1024)."""
        return len(self._unreachable)

    def forget(self, host: str, port: int) -> None:
        """Close the idle connections to ``host:port`` (its route changed)."""
        for _, protocol in self._idle.pop((host, port), []):
            protocol.close()

    async def open(
        self,
        host: str,
        port: int,
        timeout: float,
        peer: str | None = None,
        peer_id: bytes | None = None,
    ) -> DataCall | None:
        """A new stream to ``host:port`` (the data plane of the peer at gRPC address
        ``peer``), or ``None`` (unreachable now: use gRPC).

        In a private run the server's TLS credential must name ``peer_id``, the member
        this stream is meant for, before one byte is sent: a run's credential proves
        membership, not which member, and the route may pass a relay or any other member
        that could answer in the reducer's place. Without ``peer_id`` a private run's
        data plane is not used."""
        if self._tls is not None and peer_id is None:
            return None
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
            if (
                idle_protocol.usable
                and now - since < _IDLE_CLIENT
                and self._serves(idle_protocol, peer_id)
            ):
                idle_protocol.reused()  # its congestion control starts afresh
                return DataCall(idle_protocol, self._release_to(target))
            idle_protocol.close()
        self._idle.pop(target, None)  # no empty lists left behind for every address ever used
        loop = asyncio.get_running_loop()
        protocol: FrameProtocol | None = None
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
            if not self._serves(protocol, peer_id):
                found = protocol.peer_id.hex()[:12] if protocol.peer_id else "no peer id"
                raise WrongPeerError(f"the server's credential names {found}")
            protocol.send(HELLO, (MAGIC,))
            # Not one byte of a part before the remote proved it is a data plane.
            wait = min(until - time.monotonic(), self.hello_timeout)
            async with asyncio.timeout(max(wait, 0.001)):
                kind, body = await protocol.next_frame()
                if kind != HELLO or bytes(body) != MAGIC:
                    raise ProtocolError(f"answered frame kind {kind}, not a data-plane HELLO")
            self.opened += 1
        except (OSError, TimeoutError, ProtocolError) as e:
            log.info("data plane %s:%d unreachable (%r); using gRPC", host, port, e)
            if protocol is not None:
                protocol.close(discard=True)
            self.refused(host, port)
            return None
        return DataCall(protocol, self._release_to(target))

    def _serves(self, protocol: FrameProtocol, peer_id: bytes | None) -> bool:
        """Whether ``protocol`` leads to ``peer_id`` (always so on plain TCP: a public
        run's streams are signed, and a stranger that answers learns only what it could
        have asked for)."""
        return self._tls is None or (peer_id is not None and protocol.peer_id == peer_id)

    def _new_protocol(self) -> FrameProtocol:
        return FrameProtocol(congestion_control=self._congestion_control)

    def _release_to(self, key: tuple[str, int]) -> Callable[[FrameProtocol], None]:
        def release(protocol: FrameProtocol) -> None:
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
