"""The NATed side of a relay: keep a reservation at one public relay, take its connections.

:class:`ReservationKeeper` holds one ``Reserve`` stream (the peer's own outbound connection,
which its NAT lets answers through) at the first relay that accepts, among the candidates
it is given (public peers: those that answered a dial-back, then the routing table). For
each ``Incoming`` event it connects out to the relay's splice port, names the connection,
and joins it to the local port the event is for (gRPC or data plane). When the stream ends
(the relay died or dropped it) it reserves at another candidate and reports the new
addresses through ``on_change``, so the daemon announces them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from swarmavg.dht.channels import DEFAULT_OPTIONS, ChannelPool
from swarmavg.dht.ranges import split_host
from swarmavg.dht.tasks import TaskSet
from swarmavg.dht.tls import CHANNEL_OPTIONS
from swarmavg.peer.nat.dialback import relay_stub
from swarmavg.peer.nat.splice import splice
from swarmavg.proto import common_pb2, relay_pb2

log = logging.getLogger(__name__)

RESERVE_METHOD = "/swarmavg.v1.Relay/Reserve"
CONNECT_TIMEOUT = 5.0
RESERVE_TIMEOUT = 8.0
RETRY_DELAY = 1.0
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    # A relay that vanished without a FIN (its link cut) is noticed within 30 s. The relay's
    # server tolerates a ping every 10 s (dht/server_limits.py); 20 s stays clear of it.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
)


def reservation_channel(pool: ChannelPool, address: str) -> grpc.aio.Channel:
    """A channel of its own for one reservation stream: not the pool's, whose idle sweep
    would close a channel that only carries a quiet stream, and with keepalive pings."""
    options = [*DEFAULT_OPTIONS, *KEEPALIVE_OPTIONS]
    if pool.tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(
        address, pool.tls.channel_credentials(), options=[*options, *CHANNEL_OPTIONS]
    )


@dataclass(frozen=True)
class RelayedAddress:
    """Where dialers reach this peer through a relay.

    Attributes:
        relay: the relay's address (``HOST:PORT`` of its gRPC port, as dialled).
        relay_id: the relay's peer id.
        address: the relayed gRPC address (announce this).
        data_port: the relayed data-plane port on the relay's host (0: none).
        splice_port: the relay's splice port (hole punching learns its mapping there).
    """

    relay: str
    relay_id: bytes
    address: str
    data_port: int
    splice_port: int = 0


def _format(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ReservationKeeper:
    """See the module docstring.

    Args:
        channels: the daemon's channel pool (TLS in private runs).
        sign: signs a ``ReserveRequest``'s header (the daemon's DHT signer).
        local: ``(host, port)`` per relayed port, in order: gRPC, then the data plane.
        candidates: relays to try, best first (called again when one fails).
        on_change: told the new relayed address after each move.
    """

    def __init__(
        self,
        channels: ChannelPool,
        sign: Callable[[relay_pb2.ReserveRequest], common_pb2.RequestHeader],
        local: Sequence[tuple[str, int]],
        candidates: Callable[[], Sequence[str]],
        on_change: Callable[[RelayedAddress], None] | None = None,
    ) -> None:
        self.channels = channels
        self.sign = sign
        self.local = list(local)
        self.candidates = candidates
        self.on_change = on_change
        self.current: RelayedAddress | None = None
        self.announced: RelayedAddress | None = None
        """The address the daemon announces (the last one reported)."""
        self.moves = 0
        self.taken = 0
        self._first: asyncio.Future[RelayedAddress] | None = None
        self._tasks = TaskSet()
        self._failed: dict[str, str] = {}

    def set_local(self, index: int, host: str, port: int) -> None:
        """Where relayed port ``index`` leads on this machine (known once it is bound)."""
        while len(self.local) <= index:
            self.local.append(("127.0.0.1", 0))
        self.local[index] = (host, port)

    async def start(self, timeout: float) -> RelayedAddress:
        """Reserve at the first candidate that accepts and keep the reservation from then on.

        Raises:
            TimeoutError: no relay accepted within ``timeout`` (each candidate tried once;
                the keeper keeps trying in the background until :meth:`close`).
        """
        self._first = asyncio.get_running_loop().create_future()
        self._tasks.spawn(self._keep(), name="relay-reservation")
        async with asyncio.timeout(timeout):
            return await asyncio.shield(self._first)

    async def close(self) -> None:
        await self._tasks.close()

    async def _keep(self) -> None:
        while True:
            held = False
            for relay in list(dict.fromkeys(self.candidates())):
                try:
                    await self._hold(relay)
                except grpc.aio.AioRpcError as exc:
                    self._failed[relay] = exc.code().name
                    log.debug("relay %s: %s %s", relay, exc.code().name, exc.details())
                except TimeoutError:
                    self._failed[relay] = "no answer"
                    log.debug("relay %s: no reservation within %.0f s", relay, RESERVE_TIMEOUT)
                if self.current is not None and self.current.relay == relay:
                    log.info("the reservation at relay %s ended; reserving again", relay)
                    self.current = None
                    held = True
                    # From the best candidate again: the same relay, when it is alive, keeps
                    # the ports for a while (relay.LINGER), so the address stays the same.
                    break
            if not held:
                await asyncio.sleep(RETRY_DELAY)

    async def _hold(self, relay: str) -> None:
        """One reservation at ``relay`` for as long as its stream lasts."""
        request = relay_pb2.ReserveRequest(ports=len(self.local))
        request.header.CopyFrom(self.sign(request))
        channel = reservation_channel(self.channels, relay)
        call = relay_stub(channel).Reserve(request)
        try:
            async with asyncio.timeout(RESERVE_TIMEOUT):
                first = await call.read()
            if first is grpc.aio.EOF or not first.HasField("reserved"):
                return
            reserved = first.reserved
            relay_host = split_host(relay)
            ports = list(reserved.ports)
            here = RelayedAddress(
                relay=relay,
                relay_id=bytes(reserved.relay_id),
                address=_format(relay_host, ports[0]),
                data_port=ports[1] if len(ports) > 1 else 0,
                splice_port=reserved.splice_port,
            )
            before = self.announced
            self.current = here
            if self._first is not None and not self._first.done():
                self._first.set_result(here)
                self.announced = here
            elif (
                before is None
                or here.address != before.address
                or here.data_port != before.data_port
            ):
                self.moves += 1
                self.announced = here
                if self.on_change is not None:
                    self.on_change(here)
            log.info("reachable through relay %s as %s", relay, here.address)
            while True:
                event = await call.read()
                if event is grpc.aio.EOF:
                    return
                if event.HasField("incoming"):
                    self._tasks.spawn(
                        self._take(relay_host, reserved.splice_port, event.incoming),
                        name="relay-take",
                    )
        finally:
            call.cancel()
            await channel.close()

    async def _take(self, relay_host: str, splice_port: int, incoming: relay_pb2.Incoming) -> None:
        """Connect out to the relay for one dialer and join it to the local port."""
        if not incoming.index < len(self.local):
            return
        host, port = self.local[incoming.index]
        if port == 0:
            return
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                relay_side = await asyncio.open_connection(relay_host, splice_port)
                relay_side[1].write(bytes(incoming.connection_id))
                await relay_side[1].drain()
                local_side = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as exc:
            log.debug("cannot take relayed connection from %s: %s", incoming.dialer, exc)
            with contextlib.suppress(UnboundLocalError):
                relay_side[1].close()
            return
        self.taken += 1
        await splice(relay_side, local_side)

    def status(self) -> dict[str, object]:
        here = self.current
        return {
            "relay": None if here is None else here.relay,
            "relay_id": None if here is None else here.relay_id.hex(),
            "address": None if here is None else here.address,
            "moves": self.moves,
            "relayed_connections_taken": self.taken,
        }
