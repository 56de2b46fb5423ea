"""The initiator's half of hole punching: direct links from this NATed peer to others.

While this peer is relayed, the first time it dials a peer (a gRPC channel or a data-plane
connection) :class:`DirectRoutes` tries, in the background, to punch a connection to it
(``Punch`` through the other peer's relayed address, then a simultaneous open from a fresh
port, :mod:`punch`). The first dial goes through the relay as before, so a punch never
delays a call.

- The other peer is dialled directly (public, or an older peer): it answers
  ``FAILED_PRECONDITION`` (``UNIMPLEMENTED``); no punch for it for :data:`BYPASS_TTL`.
- The punch fails: the peer stays on the relay; tried again after :data:`FAILED_BACKOFF`.
- The punch works: the peer gets a *direct link*, two local forwarders on 127.0.0.1 (one
  for its gRPC port, one for its data plane). grpc.aio cannot adopt a socket, so the daemon's
  channel to the peer connects to the gRPC forwarder (:meth:`grpc_target`; the pool's
  channel through the relay is retired, calls in flight finish on it), and data-plane
  connections to the data forwarder (:meth:`data_target`). Each connection a forwarder
  takes is carried by a punched TCP connection of its own (the trial's first, then a new
  punch each) joined byte for byte: gRPC's HTTP/2, TLS in private runs and the signed
  messages pass through unchanged, and are checked as on any connection. A connection
  whose punch fails goes through the relay instead; two failures in a row end the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.ranges import split_host
from swarmavg.dht.tasks import TaskSet
from swarmavg.peer.nat.dialback import relay_stub
from swarmavg.peer.nat.punch import (
    SESSION_BYTES,
    Endpoint,
    PunchError,
    PunchPort,
    check_session,
    parse_endpoint,
)
from swarmavg.peer.nat.responder import CONNECT_WINDOW, SESSION_TIMEOUT
from swarmavg.peer.nat.splice import splice
from swarmavg.proto import common_pb2, relay_pb2

log = logging.getLogger(__name__)

ATTEMPTS = 3
"""Punches tried for one connection (each from a fresh port) before it takes the relay."""
CALL_TIMEOUT = 5.0
START_MS = 200
"""The start delay asked for: long enough for the answer to cross two relays."""
BYPASS_TTL = 600.0
FAILED_BACKOFF = 120.0
SPARE_TTL = 10.0
"""Seconds the trial's punched connection waits for the channel that is meant to take it."""
RETIRE_GRACE = 30.0
"""Seconds calls in flight on a retired (relayed) channel get to finish."""

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class NotRelayed(Exception):
    """The other peer is dialled directly (or cannot punch): no punch for it."""


@dataclass
class DirectLink:
    """The direct route to one relayed peer, keyed by its announced gRPC address."""

    address: str
    state: str = "trying"  # "trying", "direct", "failed"
    remote_host: str = ""
    """The peer's public IP, as the punch reached it."""
    data_port: int = 0
    """The peer's relayed data-plane port (its answer says)."""
    servers: list[asyncio.Server] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    spare: Stream | None = None
    spare_since: float = 0.0
    failures: int = 0
    retry_at: float = 0.0
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a trial ended (direct or failed; tests and status wait on it)."""


class DirectRoutes:
    """See the module docstring.

    Args:
        pool: the daemon's pool (its TLS setup; the Punch calls use a pool of their own,
            never routed, so they always go through the other peer's relay).
        relay: this peer's relay splice endpoint while relayed, else None (no punching).
        sign: signs a ``PunchRequest``'s header (the daemon's DHT signer).
        retire: the daemon pool's :meth:`~ChannelPool.retire` (a channel now routed).
        forget_data: drops idle data-plane connections to ``(host, port)``.
    """

    def __init__(
        self,
        pool: ChannelPool,
        relay: Callable[[], Endpoint | None],
        sign: Callable[[relay_pb2.PunchRequest], common_pb2.RequestHeader],
        retire: Callable[[str], None] = lambda address: None,
        forget_data: Callable[[str, int], None] = lambda host, port: None,
    ) -> None:
        self.relay = relay
        self.sign = sign
        self.retire = retire
        self.forget_data = forget_data
        self._channels = ChannelPool(tls=pool.tls)
        self.links: dict[str, DirectLink] = {}
        self._bypass: dict[str, float] = {}
        self._tasks = TaskSet()
        self._closed = False
        self.succeeded = 0
        self.failed = 0
        self.fallbacks = 0
        """Connections a direct link took that went through the relay after all."""
        self.direct_connections = 0

    # ---- routing (called by the channel pool and the data connector) ----

    def grpc_target(self, address: str) -> str:
        """Where a new channel to ``address`` connects: its direct link's forwarder, or
        ``address`` itself (through its relay, or a public peer)."""
        link = self._link(address)
        if link is None or link.state != "direct":
            return address
        return f"127.0.0.1:{link.ports[0]}"

    def data_target(self, address: str | None, host: str, port: int) -> tuple[str, int]:
        """Where a new data-plane connection to ``host:port`` (the peer at gRPC
        ``address``) connects."""
        if address is None:
            return host, port
        link = self._link(address)
        if link is None or link.state != "direct" or port != link.data_port:
            return host, port
        return "127.0.0.1", link.ports[1]

    def _link(self, address: str) -> DirectLink | None:
        if self._closed or self.relay() is None:
            return None
        loop = asyncio.get_running_loop()
        if self._bypass.get(address, 0.0) > loop.time():
            return None
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = DirectLink(address)
            self._tasks.spawn(self._trial(link), name="punch-trial")
        elif link.state == "failed" and loop.time() >= link.retry_at:
            link.state = "trying"
            self._tasks.spawn(self._trial(link), name="punch-trial")
        return link

    # ---- punching ----

    async def _trial(self, link: DirectLink) -> None:
        """Punch once for the link's gRPC port; on success open its forwarders."""
        link.settled.clear()
        try:
            await self._try(link)
        finally:
            link.settled.set()

    async def _try(self, link: DirectLink) -> None:
        loop = asyncio.get_running_loop()
        try:
            stream = await self.punch(link, 0)
        except NotRelayed:
            self.links.pop(link.address, None)
            self._bypass[link.address] = loop.time() + BYPASS_TTL
            return
        except PunchError as exc:
            self.failed += 1
            link.state = "failed"
            link.retry_at = loop.time() + FAILED_BACKOFF
            log.info("no direct connection to %s (%s): staying on the relay", link.address, exc)
            return
        self.succeeded += 1
        try:
            for index in (0, 1):
                server = await asyncio.start_server(self._forwarder(link, index), "127.0.0.1", 0)
                link.servers.append(server)
                link.ports.append(server.sockets[0].getsockname()[1])
        except OSError as exc:
            stream[1].close()
            self._close_link(link)
            link.state = "failed"
            link.retry_at = loop.time() + FAILED_BACKOFF
            log.warning("cannot open a local forwarder for %s: %s", link.address, exc)
            return
        link.spare, link.spare_since = stream, loop.time()
        link.state = "direct"
        log.info(
            "direct to %s (%s) after punching: its traffic no longer crosses the relay",
            link.remote_host,
            link.address,
        )
        self.retire(link.address)
        if link.data_port:
            self.forget_data(split_host(link.address), link.data_port)

    async def punch(self, link: DirectLink, index: int) -> Stream:
        """One punched connection to the link's peer for its port ``index``, its session
        checked.

        Raises:
            NotRelayed: the peer is dialled directly (no punch needed or possible).
            PunchError: :data:`ATTEMPTS` punches failed.
        """
        loop = asyncio.get_running_loop()
        errors: list[str] = []
        for _ in range(ATTEMPTS):
            relay = self.relay()
            if relay is None:
                raise PunchError("this peer holds no reservation now")
            port = PunchPort(socket.AF_INET)
            try:
                observed = await port.observe(relay)
                session = os.urandom(SESSION_BYTES)
                request = relay_pb2.PunchRequest(
                    session=session, index=index, address=str(observed), start_in_ms=START_MS
                )
                request.header.CopyFrom(self.sign(request))
                asked = loop.time()
                stub = relay_stub(self._channels.channel(link.address))
                answer = await stub.Punch(request, timeout=CALL_TIMEOUT)
                # The responder starts start_in_ms after it answered; the answer took
                # about half the round trip to arrive.
                start_at = loop.time() + answer.start_in_ms / 1000 - (loop.time() - asked) / 2
                remote = parse_endpoint(answer.address)
                sock = await port.open(remote, start_at, start_at + CONNECT_WINDOW)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.UNIMPLEMENTED,
                ):
                    raise NotRelayed(exc.details() or exc.code().name) from None
                errors.append(f"{exc.code().name} {exc.details() or ''}".strip())
                continue
            except (PunchError, ValueError) as exc:
                errors.append(str(exc))
                continue
            finally:
                port.close()
            reader, writer = await asyncio.open_connection(sock=sock)
            try:
                await check_session(
                    reader, writer, session, initiator=True, timeout=SESSION_TIMEOUT
                )
            except PunchError as exc:
                writer.close()
                errors.append(str(exc))
                continue
            except BaseException:  # cancelled: the socket is ours to close
                writer.close()
                raise
            link.remote_host = remote.host
            link.data_port = answer.data_port
            return reader, writer
        raise PunchError("; ".join(errors))

    def _forwarder(
        self, link: DirectLink, index: int
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]:
        def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._tasks.spawn(self._forward(link, index, (reader, writer)), name="punch-forward")

        return accept

    async def _forward(self, link: DirectLink, index: int, local: Stream) -> None:
        """Carry one local connection (the daemon's channel or data-plane connection) to the
        peer: over the spare punched connection, a new punch, or the relay."""
        try:
            other = await self._carrier(link, index)
        except BaseException:
            local[1].close()
            raise
        if other is None:
            local[1].close()
            return
        await splice(local, other)

    async def _carrier(self, link: DirectLink, index: int) -> Stream | None:
        loop = asyncio.get_running_loop()
        other: Stream | None = None
        if index == 0 and link.spare is not None:
            other, link.spare = link.spare, None
            if loop.time() - link.spare_since > SPARE_TTL:
                other[1].close()
                other = None
        if other is None:
            try:
                other = await self.punch(link, index)
                link.failures = 0
            except (PunchError, NotRelayed) as exc:
                link.failures += 1
                self.fallbacks += 1
                log.debug("punch to %s failed (%s): through the relay", link.address, exc)
                if link.failures >= 2:
                    self._demote(link)
                return await self._through_relay(link, index)
        self.direct_connections += 1
        return other

    async def _through_relay(self, link: DirectLink, index: int) -> Stream | None:
        host = split_host(link.address)
        port = int(link.address.rpartition(":")[2]) if index == 0 else link.data_port
        try:
            return await asyncio.wait_for(asyncio.open_connection(host, port), CALL_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            log.debug("relay path to %s:%d: %s", host, port, exc)
            return None

    def _demote(self, link: DirectLink) -> None:
        """Two punches in a row failed: new connections take the relay again."""
        link.state = "failed"
        link.retry_at = asyncio.get_running_loop().time() + FAILED_BACKOFF
        self.retire(link.address)
        if link.data_port:
            self.forget_data(split_host(link.address), link.data_port)
        log.info("punches to %s fail now: back on the relay", link.address)

    def _close_link(self, link: DirectLink) -> None:
        for server in link.servers:
            server.close()
        link.servers.clear()
        link.ports.clear()
        if link.spare is not None:
            link.spare[1].close()
            link.spare = None

    def direct_peers(self) -> list[str]:
        """The peers reached directly now, as ``IP (relayed address)``."""
        return [
            f"{link.remote_host} ({link.address})"
            for link in self.links.values()
            if link.state == "direct"
        ]

    async def close(self) -> None:
        self._closed = True
        for link in self.links.values():
            self._close_link(link)
        await self._tasks.close()
        with contextlib.suppress(Exception):
            await self._channels.close()
