"""A reservation through a real relay on loopback: real gRPC for the reservation stream,
real TCP for the relayed connections; bytes pass unaltered both ways; a relay that dies
moves the reservation to another; a stranger's or an unsigned reservation is refused."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from swarmavg.dht.auth import Authenticator, RequestSigner, message_digest
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.identity import Identity
from swarmavg.peer.nat.dialback import DialBackLimits, DialBackRules, TokenBook
from swarmavg.peer.nat.limits import RelayLimits
from swarmavg.peer.nat.relay import RelayServer
from swarmavg.peer.nat.reservation import RESERVE_METHOD, RelayedAddress, ReservationKeeper
from swarmavg.peer.nat.service import RelayService
from swarmavg.proto import common_pb2, relay_pb2, relay_pb2_grpc

pytestmark = pytest.mark.timeout(60)
RUN = "nat-test"


class Relay:
    """A relay daemon's parts: its gRPC server with the Relay service and the relay."""

    def __init__(self, relaying: bool = True) -> None:
        self.identity = Identity.generate()
        self.channels = ChannelPool()
        self.relay = RelayServer("127.0.0.1", "127.0.0.1", RelayLimits())
        self.service = RelayService(
            self.channels,
            DialBackRules(DialBackLimits()),
            TokenBook(),
            lambda: Authenticator(self.identity, RUN),
            lambda: self.relay if relaying else None,
            self.identity.peer_id,
        )
        self.server = grpc.aio.server()
        self.service.add_to_server(self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    async def start(self) -> Relay:
        await self.server.start()
        await self.relay.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(None)
        await self.relay.close()
        await self.channels.close()


async def echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def signer_for(identity: Identity):  # type: ignore[no-untyped-def]
    signer = RequestSigner(identity, RUN, lambda: "")

    def sign(request: relay_pb2.ReserveRequest) -> common_pb2.RequestHeader:
        return signer.sign(b"", RESERVE_METHOD, message_digest(request))

    return sign


async def roundtrip(address: str, payload: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    writer.write_eof()
    data = await reader.read()
    writer.close()
    return data


async def test_relayed_connection_carries_bytes_and_moves_when_the_relay_dies() -> None:
    first, second = await Relay().start(), await Relay().start()
    echo, echo_port = await echo_server()
    channels = ChannelPool()
    moves: list[RelayedAddress] = []
    moved = asyncio.Event()
    relays = [first.address, second.address]

    def on_move(relayed: RelayedAddress) -> None:
        moves.append(relayed)
        moved.set()

    keeper = ReservationKeeper(
        channels, signer_for(Identity.generate()), [("127.0.0.1", echo_port)],
        lambda: relays, on_move,
    )  # fmt: skip
    try:
        relayed = await keeper.start(timeout=10)
        assert relayed.relay == first.address
        assert relayed.relay_id == first.identity.peer_id
        assert relayed.address.startswith("127.0.0.1:")
        assert relayed.address != first.address
        payload = os.urandom(3 << 20)
        assert await roundtrip(relayed.address, payload) == payload
        assert first.relay.budget.relayed_bytes == 2 * len(payload)
        assert keeper.taken == 1

        await first.stop()  # the relay dies: the stream ends, the keeper moves on
        await asyncio.wait_for(moved.wait(), 20)
        [now] = moves
        assert now.relay == second.address
        assert keeper.moves == 1
        assert await roundtrip(now.address, b"abc") == b"abc"
    finally:
        await keeper.close()
        await channels.close()
        echo.close()
        await second.stop()
        await first.stop()


async def test_unsigned_or_replayed_reservations_are_refused() -> None:
    relay = await Relay().start()
    channels = ChannelPool()
    try:
        stub = relay_pb2_grpc.RelayStub(channels.channel(relay.address))
        call = stub.Reserve(relay_pb2.ReserveRequest(ports=1))
        with pytest.raises(grpc.aio.AioRpcError) as unsigned:
            await call.read()
        assert unsigned.value.code() in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        request = relay_pb2.ReserveRequest(ports=1)
        request.header.CopyFrom(signer_for(Identity.generate())(request))
        request.ports = 2  # altered after signing
        with pytest.raises(grpc.aio.AioRpcError) as altered:
            await stub.Reserve(request).read()
        assert altered.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert not relay.relay.reservations
    finally:
        await channels.close()
        await relay.stop()


async def test_a_peer_that_does_not_relay_refuses_reservations() -> None:
    relay = await Relay(relaying=False).start()  # relay = false on this daemon
    channels = ChannelPool()
    try:
        stub = relay_pb2_grpc.RelayStub(channels.channel(relay.address))
        request = relay_pb2.ReserveRequest(ports=1)
        request.header.CopyFrom(signer_for(Identity.generate())(request))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Reserve(request).read()
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await channels.close()
        await relay.stop()
