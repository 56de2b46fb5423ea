"""The Averaging service's JoinGroup and DownloadState entry points pass a per-source rate
limit (dht/ratelimit.py) before any component works for a request (issue 16)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from swarmavg.averaging.service import AveragingServicer, add_to_server
from swarmavg.dht import Identity
from swarmavg.dht.ratelimit import RateLimits
from swarmavg.proto import averaging_pb2

pytestmark = pytest.mark.timeout(60)


async def _first_status(call: AsyncIterator[object]) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def test_a_flood_of_joins_and_downloads_gets_resource_exhausted() -> None:
    # no components: an admitted request is answered UNAVAILABLE ("averager is not running"),
    # a refused one RESOURCE_EXHAUSTED before that
    servicer = AveragingServicer(lambda: None, RateLimits(per_source_rate=0.5, per_source_burst=5))
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        flooder, other = Identity.generate(), Identity.generate()
        join = channel.unary_stream(
            "/swarmavg.v1.Averaging/JoinGroup",
            request_serializer=averaging_pb2.JoinRequest.SerializeToString,
            response_deserializer=averaging_pb2.JoinResponse.FromString,
        )
        download = channel.unary_stream(
            "/swarmavg.v1.Averaging/DownloadState",
            request_serializer=averaging_pb2.StateRequest.SerializeToString,
            response_deserializer=averaging_pb2.StateResponse.FromString,
        )
        codes = []
        for i in range(20):
            header = flooder.make_header("test", "127.0.0.1:1")
            if i % 2:
                request = averaging_pb2.JoinRequest(header=header, key="test.k.0b")
                codes.append(await _first_status(join(request, timeout=5)))
            else:
                state = averaging_pb2.StateRequest(header=header, want_manifest=True)
                codes.append(await _first_status(download(state, timeout=5)))
        assert codes[:5] == [grpc.StatusCode.UNAVAILABLE] * 5
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 10
        assert servicer.rate_limiter.refused == codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        request = averaging_pb2.JoinRequest(header=other.make_header("test"), key="test.k.0b")
        assert await _first_status(join(request, timeout=5)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await channel.close()
        await server.stop(None)
