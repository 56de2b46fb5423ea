"""The responder's half of a hole punch: a relayed peer asked ``Punch`` by another one.

The request comes through this peer's relay (its relayed gRPC port) and is signed by the
initiator. The responder checks it (:meth:`PunchResponder.check`), learns its own punch
port's public address from its relay, answers it with the start delay, and at the start
connects to the initiator's observed address (:class:`~swarmavg.peer.nat.punch.PunchPort`).
A connection whose first bytes are the request's session is joined to the local port the
request names (gRPC or the data plane), exactly as the relay's back-connections are: what
arrives on it is then checked like any other connection's traffic.

Bounded: at most ``max_in_flight`` punches at once and ``per_peer_rate`` per second per
initiator (burst ``per_peer_burst``); every socket has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from swarmavg.dht.ratelimit import TokenBucket
from swarmavg.dht.tasks import TaskSet
from swarmavg.peer.nat.punch import (
    MAX_START_MS,
    SESSION_BYTES,
    Endpoint,
    PunchError,
    PunchPort,
    check_session,
    parse_endpoint,
)
from swarmavg.peer.nat.splice import splice
from swarmavg.proto import relay_pb2

log = logging.getLogger(__name__)

PUNCH_METHOD = "/swarmavg.v1.Relay/Punch"
CONNECT_WINDOW = 3.0
"""Seconds after the start that each side keeps trying to connect."""
SESSION_TIMEOUT = 3.0
MAX_PORT_INDEX = 1


@dataclass(frozen=True)
class PunchLimits:
    """How many punches a peer answers; see the module docstring."""

    max_in_flight: int = 16
    per_peer_rate: float = 2.0
    per_peer_burst: float = 8.0
    max_peers: int = 4096


class PunchRefused(Exception):
    """A punch this peer will not try; answered with ``status`` (and the message)."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class PunchPlan:
    """A checked request: where to connect, when, and which local port it leads to."""

    remote: Endpoint
    start_in_ms: int
    local: tuple[str, int]
    session: bytes


class PunchResponder:
    """See the module docstring.

    Args:
        relay: this peer's relay splice endpoint while it holds a reservation, else None
            (a public peer needs no punch: it is dialled directly).
        local: ``(host, port)`` of local port ``index`` (0 gRPC, 1 the data plane), or None.
        data_port: this peer's relayed data-plane port (told to the initiator).
    """

    def __init__(
        self,
        relay: Callable[[], Endpoint | None],
        local: Callable[[int], tuple[str, int] | None],
        data_port: Callable[[], int],
        limits: PunchLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.relay = relay
        self.local = local
        self.data_port = data_port
        self.limits = limits or PunchLimits()
        self.clock = clock
        self._peers: OrderedDict[bytes, TokenBucket] = OrderedDict()
        self._tasks = TaskSet()
        self.in_flight = 0
        self.succeeded = 0
        self.failed = 0
        self.refused = 0

    def check(self, peer_id: bytes, request: relay_pb2.PunchRequest) -> PunchPlan:
        """The plan for an authenticated request, or why not.

        Raises:
            PunchRefused: a bad request (``INVALID_ARGUMENT``), this peer is not relayed
                (``FAILED_PRECONDITION``), or over the limits (``RESOURCE_EXHAUSTED``).
        """
        try:
            plan = self._plan(request)
        except PunchRefused:
            self.refused += 1
            raise
        if self.in_flight >= self.limits.max_in_flight:
            self.refused += 1
            raise PunchRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limits.max_in_flight} punches in flight; ask later",
            )
        now = self.clock()
        bucket = self._peers.get(peer_id)
        if bucket is None:
            bucket = TokenBucket(self.limits.per_peer_rate, self.limits.per_peer_burst, now)
            self._peers[peer_id] = bucket
            while len(self._peers) > self.limits.max_peers:
                self._peers.popitem(last=False)
        self._peers.move_to_end(peer_id)
        if not bucket.take(now):
            self.refused += 1
            raise PunchRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many punches; ask later")
        return plan

    def _plan(self, request: relay_pb2.PunchRequest) -> PunchPlan:
        if len(request.session) != SESSION_BYTES:
            raise PunchRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"the session must have {SESSION_BYTES} bytes"
            )
        if request.index > MAX_PORT_INDEX:
            raise PunchRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"port index {request.index} is not 0 or 1"
            )
        if request.start_in_ms > MAX_START_MS:
            raise PunchRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"start_in_ms {request.start_in_ms} is over {MAX_START_MS}",
            )
        try:
            remote = parse_endpoint(request.address)
        except ValueError as exc:
            raise PunchRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if self.relay() is None:
            raise PunchRefused(
                grpc.StatusCode.FAILED_PRECONDITION, "this peer is dialled directly: no punch"
            )
        local = self.local(request.index)
        if local is None:
            raise PunchRefused(
                grpc.StatusCode.FAILED_PRECONDITION, f"this peer serves no port {request.index}"
            )
        return PunchPlan(remote, request.start_in_ms, local, bytes(request.session))

    async def answer(self, plan: PunchPlan) -> relay_pb2.PunchResponse:
        """Learn this side's address, answer, and connect at the start (in the background).

        Raises:
            PunchRefused: the relay could not tell this port's address (``UNAVAILABLE``),
                or the initiator's address is out of this peer's reach (loopback from
                a peer that is not on loopback itself: ``INVALID_ARGUMENT``).
        """
        relay = self.relay()
        if relay is None:
            raise PunchRefused(grpc.StatusCode.FAILED_PRECONDITION, "no relay now")
        port = PunchPort()
        self.in_flight += 1
        try:
            observed = await port.observe(relay)
            if _is_loopback(plan.remote) and not _is_loopback(observed):
                raise PunchRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{plan.remote} is a loopback address and this peer is not on loopback",
                )
        except PunchError as exc:
            port.close()
            self.in_flight -= 1
            raise PunchRefused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except BaseException:
            port.close()
            self.in_flight -= 1
            raise
        start_at = asyncio.get_running_loop().time() + plan.start_in_ms / 1000
        self._tasks.spawn(self._serve(port, plan, start_at), name="punch-respond")
        return relay_pb2.PunchResponse(
            address=str(observed), start_in_ms=plan.start_in_ms, data_port=self.data_port()
        )

    async def _serve(self, port: PunchPort, plan: PunchPlan, start_at: float) -> None:
        try:
            try:
                sock = await port.open(plan.remote, start_at, start_at + CONNECT_WINDOW)
            finally:
                port.close()
            reader, writer = await asyncio.open_connection(sock=sock)
            try:
                await check_session(
                    reader, writer, plan.session, initiator=False, timeout=SESSION_TIMEOUT
                )
                local = await asyncio.wait_for(asyncio.open_connection(*plan.local), 5.0)
            except BaseException:  # cancelled too: the socket is this task's to close
                writer.close()
                raise
        except (PunchError, OSError, TimeoutError) as exc:
            self.failed += 1
            log.debug("punch with %s failed: %s", plan.remote, exc)
            return
        finally:
            self.in_flight -= 1
        self.succeeded += 1
        log.debug("punched a direct connection with %s", plan.remote)
        await splice((reader, writer), local)

    async def close(self) -> None:
        await self._tasks.close()


def _is_loopback(endpoint: Endpoint) -> bool:
    return endpoint.host.startswith("127.") or endpoint.host == "::1"
