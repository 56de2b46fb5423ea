"""Hole punching's rules on loopback, with real sockets and real gRPC (docs/peer.md "Hole
punching"): two relayed peers punch a direct connection through a real relay and carry gRPC
and data-plane bytes on it without the relay; forged, altered or out-of-range coordination
messages are refused; a punch nobody answers fails within its deadline; a stranger at the
punched address fails the session check; a punch refused later falls back to the relay."""

from __future__ import annotations

import asyncio
import os
import socket

import grpc
import pytest

from swarmavg.dht.auth import Authenticator, RequestSigner, message_digest
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.identity import Identity
from swarmavg.peer.nat.agent import spread
from swarmavg.peer.nat.dialback import DialBackLimits, DialBackRules, TokenBook
from swarmavg.peer.nat.direct import DirectRoutes
from swarmavg.peer.nat.punch import (
    Endpoint,
    PunchError,
    PunchPort,
    check_session,
    parse_endpoint,
)
from swarmavg.peer.nat.reservation import ReservationKeeper
from swarmavg.peer.nat.responder import PUNCH_METHOD, PunchLimits, PunchResponder
from swarmavg.peer.nat.service import RelayService
from swarmavg.proto import common_pb2, relay_pb2, relay_pb2_grpc
from tests.peer.nat.test_relay_loopback import RUN, Relay, echo_server, roundtrip, signer_for

pytestmark = pytest.mark.timeout(60)


def punch_signer(identity: Identity):  # type: ignore[no-untyped-def]
    signer = RequestSigner(identity, RUN, lambda: "")

    def sign(request: relay_pb2.PunchRequest) -> common_pb2.RequestHeader:
        return signer.sign(b"", PUNCH_METHOD, message_digest(request))

    return sign


class RelayedPeer:
    """A NATed daemon's parts on loopback: a gRPC server with the Relay service (its
    responder), a reservation at ``relay`` for its gRPC port and an echo "data plane", and
    its direct routes (the initiator)."""

    def __init__(self, relay: Relay, limits: PunchLimits | None = None) -> None:
        self.identity = Identity.generate()
        self.relay = relay
        self.channels = ChannelPool()
        self.keeper: ReservationKeeper | None = None
        self.responder = PunchResponder(
            self.own_relay, self.local, self.data_port, limits or PunchLimits()
        )
        self.server = grpc.aio.server()
        authenticator = Authenticator(self.identity, RUN)  # one replay cache, as a daemon's
        RelayService(
            self.channels,
            DialBackRules(DialBackLimits()),
            TokenBook(),
            lambda: authenticator,
            lambda: None,
            self.identity.peer_id,
            self.responder,
        ).add_to_server(self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.routes = DirectRoutes(self.channels, self.own_relay, punch_signer(self.identity))

    def own_relay(self) -> Endpoint | None:
        if self.keeper is None or self.keeper.current is None:
            return None
        return Endpoint("127.0.0.1", self.keeper.current.splice_port)

    def local(self, index: int) -> tuple[str, int] | None:
        assert self.keeper is not None
        return self.keeper.local[index] if index < len(self.keeper.local) else None

    def data_port(self) -> int:
        assert self.keeper is not None
        assert self.keeper.current is not None
        return self.keeper.current.data_port

    async def start(self) -> RelayedPeer:
        await self.server.start()
        self.echo, echo_port = await echo_server()
        self.keeper = ReservationKeeper(
            self.channels,
            signer_for(self.identity),
            [("127.0.0.1", self.port), ("127.0.0.1", echo_port)],
            lambda: [self.relay.address],
        )
        self.relayed = await self.keeper.start(timeout=10)
        return self

    async def stop(self) -> None:
        await self.routes.close()
        await self.responder.close()
        if self.keeper is not None:
            await self.keeper.close()
        self.echo.close()
        await self.server.stop(None)
        await self.channels.close()


async def test_two_relayed_peers_punch_and_carry_grpc_and_data_without_the_relay() -> None:
    relay = await Relay().start()
    a, b = await RelayedPeer(relay).start(), await RelayedPeer(relay).start()
    try:
        address = b.relayed.address
        assert a.routes.grpc_target(address) == address  # the first dial: through the relay
        link = a.routes.links[address]
        await asyncio.wait_for(link.settled.wait(), 20)
        assert link.state == "direct", a.routes.failed
        assert link.data_port == b.relayed.data_port
        assert a.routes.direct_peers() == [f"127.0.0.1 ({address})"]
        before = relay.relay.budget.relayed_bytes

        # gRPC through the forwarder reaches B's own server: B answers a Probe it did not ask.
        target = a.routes.grpc_target(address)
        assert target.startswith("127.0.0.1:")
        assert target != address
        channel = grpc.aio.insecure_channel(target)
        with pytest.raises(grpc.aio.AioRpcError) as probe:
            await relay_pb2_grpc.RelayStub(channel).Probe(
                relay_pb2.ProbeRequest(token=os.urandom(16)), timeout=10
            )
        assert probe.value.code() is grpc.StatusCode.NOT_FOUND
        await channel.close()

        # The data plane's forwarder: a new punch for port 1, bytes both ways, no relay.
        host, port = a.routes.data_target(address, "127.0.0.1", b.relayed.data_port)
        assert (host, port) != ("127.0.0.1", b.relayed.data_port)
        payload = os.urandom(2 << 20)
        assert await roundtrip(f"{host}:{port}", payload) == payload
        assert relay.relay.budget.relayed_bytes - before < 64 << 10  # punches' RPCs only
        assert b.responder.succeeded >= 2
        assert a.routes.fallbacks == 0
    finally:
        await a.stop()
        await b.stop()
        await relay.stop()


async def test_a_punch_refused_later_falls_back_to_the_relay() -> None:
    relay = await Relay().start()
    a = await RelayedPeer(relay).start()
    b = await RelayedPeer(relay, PunchLimits(per_peer_rate=1e-6, per_peer_burst=1)).start()
    try:
        address = b.relayed.address
        a.routes.grpc_target(address)
        link = a.routes.links[address]
        await asyncio.wait_for(link.settled.wait(), 20)
        assert link.state == "direct"  # the trial took B's one punch for A
        host, port = a.routes.data_target(address, "127.0.0.1", b.relayed.data_port)
        before = relay.relay.budget.relayed_bytes
        payload = os.urandom(1 << 20)
        assert await roundtrip(f"{host}:{port}", payload) == payload  # through the relay
        assert a.routes.fallbacks == 1
        assert relay.relay.budget.relayed_bytes - before >= 2 * len(payload)
        assert b.responder.refused >= 1
    finally:
        await a.stop()
        await b.stop()
        await relay.stop()


async def test_a_public_peer_is_not_punched() -> None:
    relay = await Relay().start()
    a = await RelayedPeer(relay).start()
    try:
        # The relay itself is dialled directly: it answers FAILED_PRECONDITION (it does not
        # punch), so A does not try again and dials it as it is.
        assert a.routes.grpc_target(relay.address) == relay.address
        link = a.routes.links[relay.address]
        await asyncio.wait_for(link.settled.wait(), 20)
        assert relay.address not in a.routes.links
        assert a.routes.grpc_target(relay.address) == relay.address
        assert relay.address not in a.routes.links  # bypassed, not tried again
        assert a.routes.succeeded == a.routes.failed == 0
    finally:
        await a.stop()
        await relay.stop()


async def punch_call(
    peer: RelayedPeer, request: relay_pb2.PunchRequest, sign: bool = True
) -> relay_pb2.PunchResponse:
    if sign:
        request.header.CopyFrom(punch_signer(Identity.generate())(request))
    channel = grpc.aio.insecure_channel(peer.relayed.address)
    try:
        response: relay_pb2.PunchResponse = await relay_pb2_grpc.RelayStub(channel).Punch(
            request, timeout=10
        )
        return response
    finally:
        await channel.close()


def good_request() -> relay_pb2.PunchRequest:
    return relay_pb2.PunchRequest(
        session=os.urandom(16), index=1, address="127.0.0.1:9", start_in_ms=0
    )


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("session", b"short", grpc.StatusCode.INVALID_ARGUMENT),
        ("index", 2, grpc.StatusCode.INVALID_ARGUMENT),
        ("start_in_ms", 60_000, grpc.StatusCode.INVALID_ARGUMENT),
        ("address", "example.org:80", grpc.StatusCode.INVALID_ARGUMENT),
        ("address", "0.0.0.0:80", grpc.StatusCode.INVALID_ARGUMENT),
        ("address", "127.0.0.1:0", grpc.StatusCode.INVALID_ARGUMENT),
        ("address", "224.0.0.1:80", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_bad_coordination_messages_are_refused(
    field: str, value: object, code: object
) -> None:
    relay = await Relay().start()
    b = await RelayedPeer(relay).start()
    try:
        request = good_request()
        setattr(request, field, value)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await punch_call(b, request)
        assert refused.value.code() is code
        assert b.responder.in_flight == 0
    finally:
        await b.stop()
        await relay.stop()


async def test_forged_altered_or_replayed_punches_are_refused() -> None:
    relay = await Relay().start()
    b = await RelayedPeer(relay).start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as unsigned:
            await punch_call(b, good_request(), sign=False)
        assert unsigned.value.code() in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        altered = good_request()
        altered.header.CopyFrom(punch_signer(Identity.generate())(altered))
        altered.address = "127.0.0.1:10"  # aimed elsewhere after signing
        with pytest.raises(grpc.aio.AioRpcError) as forged:
            await punch_call(b, altered, sign=False)
        assert forged.value.code() is grpc.StatusCode.UNAUTHENTICATED
        first = good_request()
        await punch_call(b, first)  # answered (nobody at port 9: it fails in the background)
        with pytest.raises(grpc.aio.AioRpcError) as replayed:
            await punch_call(b, first, sign=False)
        assert replayed.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        await b.stop()
        await relay.stop()


async def test_a_punch_nobody_answers_fails_by_its_deadline() -> None:
    nobody = socket.socket()
    nobody.bind(("127.0.0.1", 0))  # bound, never listening, never connecting: refuses
    remote = Endpoint("127.0.0.1", nobody.getsockname()[1])
    port = PunchPort()
    loop = asyncio.get_running_loop()
    try:
        start = loop.time()
        with pytest.raises(PunchError):
            await port.open(remote, start, start + 0.5)
        assert loop.time() - start < 5  # the deadline holds (generous: a loaded machine)
    finally:
        port.close()
        nobody.close()


async def test_a_stranger_at_the_punched_address_fails_the_session_check() -> None:
    stranger, stranger_port = await echo_server()  # answers with what it got: not the echo
    port = PunchPort()
    loop = asyncio.get_running_loop()
    try:
        now = loop.time()
        sock = await port.open(Endpoint("127.0.0.1", stranger_port), now, now + 5)
        reader, writer = await asyncio.open_connection(sock=sock)
        # An echo server returns the session as sent, which a responder would too; one that
        # sends anything else is refused, and so is one that stays silent.
        writer.write(b"x" * 16)
        await writer.drain()
        with pytest.raises(PunchError):
            await check_session(reader, writer, os.urandom(16), initiator=True, timeout=2)
        writer.close()
    finally:
        port.close()
        stranger.close()
    taken: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda r, w: taken.append(w), "127.0.0.1", 0)
    port = PunchPort()
    try:
        now = loop.time()
        remote = Endpoint("127.0.0.1", silent.sockets[0].getsockname()[1])
        reader, writer = await asyncio.open_connection(sock=await port.open(remote, now, now + 5))
        with pytest.raises(PunchError):
            await check_session(reader, writer, os.urandom(16), initiator=True, timeout=0.5)
        writer.close()
    finally:
        port.close()
        silent.close()
        for accepted in taken:
            accepted.close()
            await accepted.wait_closed()


def test_endpoints_are_ip_literals_with_a_port() -> None:
    assert parse_endpoint("10.0.0.1:5") == Endpoint("10.0.0.1", 5)
    assert parse_endpoint("[::1]:7") == Endpoint("::1", 7)
    for bad in ("10.0.0.1", "host:5", "10.0.0.1:70000", ":5", "10.0.0.1:x", "[::]:5"):
        with pytest.raises(ValueError, match=r"IP|port|connect"):
            parse_endpoint(bad)


def test_reservations_spread_over_the_initial_peers() -> None:
    relays = [f"203.0.113.{i}:31337" for i in range(4)]
    firsts = [spread(Identity.generate().peer_id, relays)[0] for _ in range(400)]
    # Each relay is some peers' first choice (today: every peer took the first initial one).
    counts = [firsts.count(relay) for relay in relays]
    assert min(counts) >= 50, counts
    peer = Identity.generate().peer_id
    assert spread(peer, relays) == spread(peer, list(reversed(relays)))  # order-independent
    assert sorted(spread(peer, relays + relays[:1])) == sorted(relays)
