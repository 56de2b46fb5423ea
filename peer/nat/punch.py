"""Hole punching's mechanics: learn where a NAT maps a port, open one TCP connection by
simultaneous open, and check the session on it (docs/peer.md, "Hole punching").

A punch uses one fresh local port per side. :class:`PunchPort` binds it (``SO_REUSEADDR`` and
``SO_REUSEPORT``, so several sockets share it) and asks the peer's relay which public address
a connection from it comes from (:data:`~swarmavg.peer.nat.relay.OBSERVE_MAGIC` on the splice
port). A MASQUERADE router (and most home routers: endpoint-independent mapping) maps the
port's next connection, to anyone, to the same public port, so that is the address the other
side connects to. At the agreed start both sides :func:`open_punched` : each ``connect()``
from its port to the other's observed address, while also listening on it. The first SYN to
leave opens its own NAT for the answer; the second one's NAT lets it out, the first one's
lets it in (it matches the connection the first opened), and the two SYNs cross: one TCP
connection, no relay. Where the other side's SYN arrives before this side has connected
(no NAT in the way: a LAN, loopback) the listener takes it.

The socket is only a transport: the first bytes each way are the punch's random session
(:func:`check_session`), so a stray connection is never taken for the peer's; what the
peers exchange on it (signed gRPC and data-plane messages, TLS in private runs) is checked
exactly as on any other connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

from swarmavg.dht.ranges import parse_ip
from swarmavg.peer.nat.relay import OBSERVE_MAGIC

SESSION_BYTES = 16
MAX_START_MS = 3000
"""The longest start delay a responder accepts (a longer one only keeps sockets open)."""
OBSERVE_TIMEOUT = 3.0
RETRY_DELAY = 0.05
"""Seconds between ``connect()`` attempts after one was refused (a router that answers an
early SYN with a reset, or loopback before the other side bound its port)."""


class PunchError(Exception):
    """A punch that did not give a connection (the message says why)."""


@dataclass(frozen=True)
class Endpoint:
    """An IP literal and a port (never a DNS name: a punch goes where an observer saw)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """``IP:PORT`` (``[v6]:PORT``) as an :class:`Endpoint`.

    Raises:
        ValueError: not an IP literal with a port in 1..65535, or an address nobody can
            connect to (unspecified, multicast).
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"{text!r} is not IP:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    ip = parse_ip(host)
    if ip is None or str(ip) != host.split("%", 1)[0]:
        raise ValueError(f"{text!r}: {host!r} is not an IP address")
    if ip.is_unspecified or ip.is_multicast:
        raise ValueError(f"{text!r}: cannot connect to {ip}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"{text!r}: port out of range")
    return Endpoint(str(ip), port)


def _bound_socket(family: socket.AddressFamily, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setblocking(False)
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    except OSError:
        sock.close()
        raise
    return sock


class PunchPort:
    """One local port for one punch, held (by a listening socket) until :meth:`close`.

    Args:
        family: ``AF_INET`` (the relays' and peers' family).
    """

    def __init__(self, family: socket.AddressFamily = socket.AF_INET) -> None:
        self.family = family
        self._listener = _bound_socket(family, 0)
        self.port: int = self._listener.getsockname()[1]
        self._listener.listen(4)
        self._sockets: list[socket.socket] = []

    def connecting_socket(self) -> socket.socket:
        """A new socket bound to this port, for one ``connect()``."""
        sock = _bound_socket(self.family, self.port)
        self._sockets.append(sock)
        return sock

    async def observe(self, relay: Endpoint, timeout: float = OBSERVE_TIMEOUT) -> Endpoint:
        """The address ``relay`` (its splice port) sees a connection from this port come from.

        Raises:
            PunchError: no answer within ``timeout``, or not an address.
        """
        loop = asyncio.get_running_loop()
        sock = self.connecting_socket()
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, (relay.host, relay.port))
                await loop.sock_sendall(sock, OBSERVE_MAGIC)
                answer = b""
                while not answer.endswith(b"\n") and len(answer) < 64:
                    data = await loop.sock_recv(sock, 64)
                    if not data:
                        break
                    answer += data
            return parse_endpoint(answer.decode("ascii", "replace").strip())
        except (OSError, TimeoutError, ValueError) as exc:
            raise PunchError(f"relay {relay} did not tell this port's address: {exc!r}") from None
        finally:
            self._forget(sock)

    async def open(self, remote: Endpoint, start_at: float, deadline: float) -> socket.socket:
        """The connection with ``remote``: ``connect()`` from this port at ``start_at``
        (loop time), retried when refused, raced with the listener, until ``deadline``.

        Raises:
            PunchError: no connection by ``deadline``.
        """
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, start_at - loop.time()))
        dialer = asyncio.ensure_future(self._connect(remote, deadline))
        taker = asyncio.ensure_future(self._accept(remote))
        try:
            async with asyncio.timeout_at(deadline):
                done, _ = await asyncio.wait({dialer, taker}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise PunchError(f"no connection with {remote} by the deadline") from None
        finally:
            for task in (dialer, taker):
                task.cancel()
            for task in (dialer, taker):
                with contextlib.suppress(asyncio.CancelledError, PunchError, OSError):
                    await task
        for task in (dialer, taker):
            if task in done and not task.cancelled() and task.exception() is None:
                sock = task.result()
                self._sockets.remove(sock)  # the caller's now
                return sock
        error = next(iter(done)).exception()
        raise PunchError(f"no connection with {remote}: {error}")

    async def _connect(self, remote: Endpoint, deadline: float) -> socket.socket:
        loop = asyncio.get_running_loop()
        while True:
            sock = self.connecting_socket()
            try:
                await loop.sock_connect(sock, (remote.host, remote.port))
                return sock
            except OSError as exc:
                self._forget(sock)
                if loop.time() + RETRY_DELAY >= deadline:
                    raise PunchError(f"connect to {remote}: {exc.strerror or exc}") from None
                await asyncio.sleep(RETRY_DELAY)

    async def _accept(self, remote: Endpoint) -> socket.socket:
        loop = asyncio.get_running_loop()
        while True:
            sock, peer = await loop.sock_accept(self._listener)
            if (str(peer[0]), int(peer[1])) == (remote.host, remote.port):
                sock.setblocking(False)
                self._sockets.append(sock)
                return sock
            sock.close()  # someone else found the port: not the peer

    def _forget(self, sock: socket.socket) -> None:
        if sock in self._sockets:
            self._sockets.remove(sock)
        sock.close()

    def close(self) -> None:
        """Close the listener and every socket not handed out by :meth:`open`."""
        self._listener.close()
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()


async def check_session(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    session: bytes,
    *,
    initiator: bool,
    timeout: float,
) -> None:
    """The punch's first bytes: the initiator sends ``session``, the responder checks it and
    echoes it, the initiator checks the echo.

    Raises:
        PunchError: another session, a short read, or nothing within ``timeout``.
    """
    try:
        async with asyncio.timeout(timeout):
            if initiator:
                writer.write(session)
                await writer.drain()
                got = await reader.readexactly(SESSION_BYTES)
            else:
                got = await reader.readexactly(SESSION_BYTES)
                if got == session:
                    writer.write(session)
                    await writer.drain()
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        raise PunchError(f"no session on the punched connection: {exc!r}") from None
    if got != session:
        raise PunchError("the punched connection carries another session")
