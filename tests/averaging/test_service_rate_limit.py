"""The Averaging service's JoinGroup and DownloadState entry points pass rate limits
(dht/ratelimit.py) before any component works for a request: the source range's
before anything else, the sender's once its signature verified, never an id a request only
claims."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from swarmavg.averaging.service import AveragingServicer, add_to_server
from swarmavg.averaging.stubs import DOWNLOAD_STATE, JOIN_GROUP
from swarmavg.dht import Identity
from swarmavg.dht.auth import Authenticator, RequestSigner
from swarmavg.dht.ratelimit import RateLimits
from swarmavg.proto import averaging_pb2

pytestmark = pytest.mark.timeout(60)

RUN = "test"


async def _first_status(call: AsyncIterator[object]) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


class Served:
    """Stands for matchmaking and state sharing: answers every request it is handed."""

    def __init__(self) -> None:
        self.handed = 0

    async def rpc_join_group(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.handed += 1
        yield averaging_pb2.JoinResponse(code=averaging_pb2.JOIN_ACCEPTED)

    async def rpc_download_state(self, request: Any, context: Any) -> None:
        self.handed += 1
        await context.write(averaging_pb2.StateResponse(code=averaging_pb2.STATE_NOT_FOUND))


async def test_a_flood_of_joins_and_downloads_gets_resource_exhausted() -> None:
    receiver = Identity.generate()
    served = Served()
    allreduce = SimpleNamespace(authenticator=Authenticator(receiver, RUN))
    servicer = AveragingServicer(
        lambda: (served, allreduce, served),  # type: ignore[arg-type,return-value]
        RateLimits(per_source_rate=0.5, per_source_burst=5),
    )
    idle = AveragingServicer(lambda: None)
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    idle_server = grpc.aio.server()
    add_to_server(idle, idle_server)
    idle_port = idle_server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await idle_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    idle_channel = grpc.aio.insecure_channel(f"127.0.0.1:{idle_port}")

    def methods(ch: grpc.aio.Channel) -> tuple[Any, Any]:
        join = ch.unary_stream(
            JOIN_GROUP,
            request_serializer=averaging_pb2.JoinRequest.SerializeToString,
            response_deserializer=averaging_pb2.JoinResponse.FromString,
        )
        download = ch.unary_stream(
            DOWNLOAD_STATE,
            request_serializer=averaging_pb2.StateRequest.SerializeToString,
            response_deserializer=averaging_pb2.StateResponse.FromString,
        )
        return join, download

    join, download = methods(channel)

    def signed(identity: Identity, i: int) -> Any:
        signer = RequestSigner(identity, RUN, lambda: "127.0.0.1:1")
        if i % 2:
            request = averaging_pb2.JoinRequest(key="test.k.0b")
            return signer.signed(request, receiver.peer_id, JOIN_GROUP)
        state = averaging_pb2.StateRequest(want_manifest=True)
        return signer.signed(state, receiver.peer_id, DOWNLOAD_STATE)

    async def send(request: Any) -> grpc.StatusCode:
        method = join if isinstance(request, averaging_pb2.JoinRequest) else download
        return await _first_status(method(request, timeout=5))

    try:
        flooder, other = Identity.generate(), Identity.generate()
        codes = [await send(signed(flooder, i)) for i in range(20)]
        assert codes[:5] == [grpc.StatusCode.OK] * 5
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 10
        assert servicer.rate_limiter.refused == codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert served.handed == codes.count(grpc.StatusCode.OK)
        # unsigned requests that only name `other` are refused and cost `other` nothing
        for i in range(20):
            request = signed(other, i)
            request.header.signature = b""
            assert await send(request) == grpc.StatusCode.UNAUTHENTICATED
        assert [await send(signed(other, i)) for i in range(5)] == [grpc.StatusCode.OK] * 5
        # before the averager runs, every call is UNAVAILABLE
        idle_join, _ = methods(idle_channel)
        status = await _first_status(idle_join(signed(other, 1), timeout=5))
        assert status == grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
        await idle_channel.close()
        await server.stop(None)
        await idle_server.stop(None)
