"""The relay a public peer offers NATed peers (off with ``[peer] relay = false``).

A reservation gets one TCP port on the relay per port the NATed peer serves (its gRPC port
and its data plane): dialers connect there as to any peer, so the relayed address is an
ordinary ``HOST:PORT`` that every part of swarmavg dials unchanged. For each dialer the relay
tells the NATed peer over its reservation stream (an outbound connection the NAT lets back
in) "connection X on port i"; the peer connects out to the relay's splice port, sends X, and
the relay joins the two connections byte for byte (:mod:`splice`). The splice port also tells
a peer that sends :data:`OBSERVE_MAGIC` the address it sees that connection come from (a
NATed peer's mapping, for hole punching). What passes is the peers' own traffic. In a
private run it is TLS bound to the peers' ids, which the relay can neither read nor alter.
In a public run the relay reads everything, like any attacker on the path; what it alters
is noticed where the ends check it: requests and DHT answers are signed, every message of a
``Reduce`` stream after its signed handshake carries a MAC under a key only the two ends
hold, and state chunks are checked against the donor's signed root (docs/security.md,
"Relays alter public-run streams"). It can drop or delay anything it carries.

Bounded by :class:`~swarmavg.peer.nat.limits.RelayLimits`: reservations, connections per
dialer range and per reserved peer, bytes per second per dialer range and in all. A dialer
whose connection the NATed peer does not take within ``accept_timeout`` is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from swarmavg.dht.tasks import TaskSet
from swarmavg.peer.nat.limits import RelayBudget, RelayLimits, source_of
from swarmavg.peer.nat.splice import splice
from swarmavg.proto import relay_pb2

log = logging.getLogger(__name__)

CONNECTION_ID_BYTES = 16
OBSERVE_MAGIC = b"swarmavg-observe"
"""Sent instead of a connection id on the splice port: the relay answers ``IP:PORT\\n``, the
address it sees the connection come from, and closes (hole punching learns its mapping)."""
MAX_RELAYED_PORTS = 2
ACCEPT_TIMEOUT = 10.0
"""Seconds a dialer waits for the NATed peer's back-connection."""
EVENT_BACKLOG = 256
"""Incoming-connection events queued per reservation; beyond that, dialers are closed."""
LINGER = 15.0
"""Seconds a reservation's ports stay open after its stream ended, for the same peer to
reserve again and keep its address (a gRPC server ends every connection after its maximum
age, 30 min; a NATed peer re-reserves at once)."""


class RelayRefused(Exception):
    """A reservation the relay will not take (full, off, or a bad request); the message says
    why (answered ``RESOURCE_EXHAUSTED`` or ``FAILED_PRECONDITION``)."""


@dataclass
class ActiveReservation:
    """One NATed peer's reservation: its relayed ports and the events for its stream."""

    peer_id: bytes
    ports: list[int] = field(default_factory=list)
    servers: list[asyncio.Server] = field(default_factory=list)
    events: asyncio.Queue[relay_pb2.Incoming] = field(
        default_factory=lambda: asyncio.Queue(EVENT_BACKLOG)
    )
    linger: asyncio.Task[None] | None = None
    """Set while no stream holds the reservation: closes it after :data:`LINGER`."""


class RelayServer:
    """The relay side; see the module docstring.

    Args:
        bind_host: where relayed and splice ports listen (the daemon's listen host).
        public_host: the host dialers use (the daemon's announced host).
        limits: the bounds.
    """

    def __init__(self, bind_host: str, public_host: str, limits: RelayLimits) -> None:
        self.bind_host = bind_host
        self.public_host = public_host
        self.limits = limits
        self.budget = RelayBudget(limits)
        self.splice_port = 0
        self.reservations: dict[bytes, ActiveReservation] = {}
        self._splice_server: asyncio.Server | None = None
        self._pending: dict[
            bytes, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        ] = {}
        self._tasks = TaskSet()  # splices in progress
        self.relayed_connections = 0

    async def start(self) -> None:
        """Open the splice port (once)."""
        if self._splice_server is None:
            self._splice_server = await asyncio.start_server(
                self._on_back_connection, self.bind_host, 0
            )
            self.splice_port = self._splice_server.sockets[0].getsockname()[1]

    async def reserve(self, peer_id: bytes, nports: int) -> ActiveReservation:
        """Open ``nports`` relayed ports for ``peer_id`` (a peer's new reservation replaces
        its old one).

        Raises:
            RelayRefused: too many reservations, or a bad port count.
        """
        if not 1 <= nports <= MAX_RELAYED_PORTS:
            raise RelayRefused(f"a reservation has 1..{MAX_RELAYED_PORTS} ports, not {nports}")
        old = self.reservations.get(peer_id)
        if old is not None and old.linger is not None and len(old.ports) == nports:
            # The same peer again, its previous stream just ended: same ports, same address;
            # dialers queued meanwhile are taken by the new stream.
            old.linger.cancel()
            old.linger = None
            return old
        if old is not None:
            await self.release(old)
        if len(self.reservations) >= self.limits.max_reservations:
            raise RelayRefused(f"the relay holds {self.limits.max_reservations} reservations")
        await self.start()
        reservation = ActiveReservation(peer_id)
        self.reservations[peer_id] = reservation
        try:
            for index in range(nports):
                server = await asyncio.start_server(
                    self._dialer_handler(reservation, index), self.bind_host, 0
                )
                reservation.servers.append(server)
                reservation.ports.append(server.sockets[0].getsockname()[1])
        except OSError as exc:
            await self.release(reservation)
            raise RelayRefused(f"cannot open a relayed port: {exc.strerror}") from None
        log.info(
            "relaying for %s on ports %s", peer_id.hex()[:12], ",".join(map(str, reservation.ports))
        )
        return reservation

    def detach(self, reservation: ActiveReservation) -> None:
        """The reservation's stream ended: keep its ports for :data:`LINGER` seconds."""
        if self.reservations.get(reservation.peer_id) is not reservation:
            return
        if reservation.linger is None:
            reservation.linger = self._tasks.spawn(
                self._release_later(reservation), name="relay-linger"
            )

    async def _release_later(self, reservation: ActiveReservation) -> None:
        await asyncio.sleep(LINGER)
        reservation.linger = None
        await self.release(reservation)

    async def release(self, reservation: ActiveReservation) -> None:
        """Close a reservation's ports (its relayed connections end with their dialers)."""
        if self.reservations.get(reservation.peer_id) is reservation:
            del self.reservations[reservation.peer_id]
        if reservation.linger is not None and reservation.linger is not asyncio.current_task():
            reservation.linger.cancel()
        reservation.linger = None
        for server in reservation.servers:
            server.close()
        reservation.servers.clear()

    async def close(self) -> None:
        for reservation in list(self.reservations.values()):
            await self.release(reservation)
        if self._splice_server is not None:
            self._splice_server.close()
        await self._tasks.close()

    def _dialer_handler(
        self, reservation: ActiveReservation, index: int
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]:
        """The accept callback of relayed port ``index``: each dialer gets an owned task."""

        def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._tasks.spawn(self._relay(reservation, index, reader, writer), name="relay-splice")

        return accept

    async def _relay(
        self,
        reservation: ActiveReservation,
        index: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else ""
        source = source_of(host)
        refusal = self.budget.open(source, reservation.peer_id)
        if refusal is not None:
            log.debug("relay refused a connection from %s: %s", host, refusal)
            writer.close()
            return
        connection_id = os.urandom(CONNECTION_ID_BYTES)
        back: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        back = asyncio.get_running_loop().create_future()
        self._pending[connection_id] = back
        try:
            event = relay_pb2.Incoming(
                connection_id=connection_id, index=index, dialer=f"{host}:{peer[1] if peer else 0}"
            )
            try:
                reservation.events.put_nowait(event)
            except asyncio.QueueFull:
                return
            try:
                async with asyncio.timeout(ACCEPT_TIMEOUT):
                    other = await back
            except TimeoutError:
                log.debug(
                    "peer %s did not take a relayed connection", reservation.peer_id.hex()[:12]
                )
                return
            self.relayed_connections += 1
            await splice((reader, writer), other, lambda n: self.budget.charge(source, n))
        finally:
            self._pending.pop(connection_id, None)
            self.budget.close(source, reservation.peer_id)
            writer.close()

    async def _on_back_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A NATed peer takes a connection: the first 16 bytes name which."""
        try:
            async with asyncio.timeout(ACCEPT_TIMEOUT):
                connection_id = await reader.readexactly(CONNECTION_ID_BYTES)
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            writer.close()
            return
        if connection_id == OBSERVE_MAGIC:
            # A punching peer learns the public address its NAT maps a port to (punch.py).
            peer = writer.get_extra_info("peername")
            if peer:
                host, port = str(peer[0]), int(peer[1])
                writer.write(f"{host}:{port}\n".encode())
                with contextlib.suppress(OSError, ConnectionError):
                    await writer.drain()
            writer.close()
            return
        back = self._pending.pop(connection_id, None)
        if back is None or back.done():
            writer.close()  # unknown or late: nothing to join it to
            return
        back.set_result((reader, writer))

    def status(self) -> dict[str, int]:
        """Counters for ``swarmavg status``."""
        return {
            "reservations": len(self.reservations),
            "connections": self.budget.connections,
            "relayed_connections": self.relayed_connections,
            "relayed_bytes": self.budget.relayed_bytes,
            "refused": self.budget.refused,
        }
