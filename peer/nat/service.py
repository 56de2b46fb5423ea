"""The ``Relay`` gRPC service of a daemon: dial-backs for others, probes of its own,
reservations when it relays, and hole punches when it is relayed itself (docs/peer.md,
"Behind NAT")."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from swarmavg.dht.auth import AuthenticationError, Authenticator, message_digest
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.identity import HeaderError
from swarmavg.dht.ranges import grpc_peer_host
from swarmavg.peer.nat.dialback import (
    DialBackRefused,
    DialBackRules,
    HeaderFor,
    TokenBook,
    dial_back,
)
from swarmavg.peer.nat.relay import RelayRefused, RelayServer
from swarmavg.peer.nat.reservation import RESERVE_METHOD
from swarmavg.peer.nat.responder import PUNCH_METHOD, PunchRefused, PunchResponder
from swarmavg.proto import relay_pb2, relay_pb2_grpc

log = logging.getLogger(__name__)


class RelayService(relay_pb2_grpc.RelayServicer):
    """See the module docstring.

    Args:
        channels: for dial-back probes.
        rules: the dial-back bounds.
        tokens: the tokens of this peer's own dial-backs (``Probe`` answers only these).
        authenticator: checks a reservation's signed header (the DHT's).
        relay: returns the relay when this peer relays now, else None (NATed itself, or
            ``relay = false``).
        relay_id: this peer's id, told to reserving peers.
        punch: answers hole punches (the responder's half, :mod:`responder`).
        header: signs the header of this peer's probes, once it has a signer.
    """

    def __init__(
        self,
        channels: ChannelPool,
        rules: DialBackRules,
        tokens: TokenBook,
        authenticator: Callable[[], Authenticator | None],
        relay: Callable[[], RelayServer | None],
        relay_id: bytes,
        punch: PunchResponder | None = None,
        header: Callable[[], HeaderFor | None] = lambda: None,
    ) -> None:
        self.channels = channels
        self.rules = rules
        self.tokens = tokens
        self._authenticator = authenticator
        self._relay = relay
        self.relay_id = relay_id
        self.punch = punch
        self._header = header
        self.dial_backs = 0

    def add_to_server(self, server: grpc.aio.Server) -> None:
        relay_pb2_grpc.add_RelayServicer_to_server(self, server)  # type: ignore[no-untyped-call]

    async def DialBack(
        self, request: relay_pb2.DialBackRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> relay_pb2.DialBackResponse:
        observed = grpc_peer_host(context.peer())
        self.dial_backs += 1
        try:
            return await dial_back(
                self.rules, self.channels, observed, request.port, request.token, self._header()
            )
        except DialBackRefused as exc:
            await context.abort(exc.status, str(exc))
            raise  # abort raises; this keeps the type checker's flow honest

    async def Probe(
        self, request: relay_pb2.ProbeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> relay_pb2.ProbeResponse:
        if not self.tokens.knows(request.token):
            await context.abort(grpc.StatusCode.NOT_FOUND, "not a dial-back this peer asked for")
        return relay_pb2.ProbeResponse(token=request.token)

    async def Reserve(
        self, request: relay_pb2.ReserveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[relay_pb2.RelayEvent]:
        relay = self._relay()
        authenticator = self._authenticator()
        if relay is None or authenticator is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this peer does not relay")
            return
        try:
            peer_id = authenticator.check(request.header, RESERVE_METHOD, message_digest(request))
        except AuthenticationError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            return
        except HeaderError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return
        try:
            reservation = await relay.reserve(peer_id, request.ports)
        except RelayRefused as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return
        try:
            yield relay_pb2.RelayEvent(
                reserved=relay_pb2.Reserved(
                    relay_id=self.relay_id,
                    relay_host=relay.public_host,
                    ports=reservation.ports,
                    splice_port=relay.splice_port,
                )
            )
            while True:
                incoming = await reservation.events.get()
                yield relay_pb2.RelayEvent(incoming=incoming)
        finally:
            relay.detach(reservation)

    async def Punch(
        self, request: relay_pb2.PunchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> relay_pb2.PunchResponse:
        authenticator = self._authenticator()
        if authenticator is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not started")
            raise AssertionError  # abort raises
        try:
            peer_id = authenticator.check(request.header, PUNCH_METHOD, message_digest(request))
        except AuthenticationError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise
        except HeaderError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise
        if self.punch is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this peer does not punch")
            raise AssertionError  # abort raises
        try:
            return await self.punch.answer(self.punch.check(peer_id, request))
        except PunchRefused as exc:
            await context.abort(exc.status, str(exc))
            raise
