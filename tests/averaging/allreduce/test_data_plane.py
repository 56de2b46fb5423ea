"""The framed-TCP data plane: hostile bytes, fallback to gRPC, reuse, and the averager path.

The all-reduce matrices (exact means, codecs, faults, hostile senders) run over both
transports through the ``allreduce_transport`` fixture; these tests cover what only the
data plane has: its framing, its connection handling and its advertisement.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.data_connector import DataConnector, DataStreamError
from swarmavg.averaging.allreduce.data_server import DataPlaneServer
from swarmavg.averaging.allreduce.framing import MAGIC, MAX_BODY, parse_status, status_body
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.group import GroupInfo, Member
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from swarmavg.dht.ranges import split_host
from swarmavg.peer.nat.splice import splice
from tests.averaging.allreduce_peers import (
    FAST,
    LocalPeer,
    close_peers,
    make_group,
    run_group,
    start_peers,
)
from tests.averaging.averager_swarm import averager_swarm, fast_config
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)

HEAD = struct.Struct("<IB")
QUICK = AllReduceConfig(
    min_stall=1.0, stall_factor=8.0, registration_wait=0.5, chunk_bytes=4096
)  # a silent connection is closed after registration_wait


def _frame(kind: int, body: bytes = b"") -> bytes:
    return HEAD.pack(len(body), kind) + body


async def _closed_by_server(
    port: int, data: bytes, within: float = 10.0, source: str = "127.0.0.1"
) -> bool:
    """Send ``data`` on a fresh connection from ``source``; whether the server closes it
    within ``within``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
        return True
    except ConnectionResetError:  # closed with our bytes unread: a reset
        return True
    except TimeoutError:
        return False
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _round_is_exact(
    peers: list[LocalPeer],
    channels: ChannelPool,
    seed: int = 0,
    data_ports: list[int] | None = None,
) -> None:
    """One round among ``peers`` gives every member the exact weighted mean, complete and
    bit-identical; ``data_ports`` overrides the data ports the group advertises."""
    rng = np.random.default_rng(seed)
    inputs = [[rng.standard_normal(5000).astype(np.float32)] for _ in peers]
    weights = [1.0 + i for i in range(len(peers))]
    group = make_group(peers, inputs[0])
    if data_ports is not None:
        members = tuple(
            Member(m.peer_id, m.address, m.mode, m.bandwidth, data_port=port)
            for m, port in zip(group.members, data_ports, strict=True)
        )
        group = GroupInfo(group.group_id, members, group.schema_hash, group.codec)
    results = await run_group(peers, group, inputs, weights, channels, timeout=20)
    mean = weighted_mean([x[0] for x in inputs], weights)
    for r in results:
        assert isinstance(r, AveragingResult), r
        assert not r.partial
        np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
        assert r.tensors[0].tobytes() == results[0].tensors[0].tobytes()  # type: ignore[union-attr]


HOSTILE_BYTES = {
    "wrong-magic": _frame(0, b"swarmavg-reduce/9"),
    "no-hello": _frame(1, b"\x08\x01"),
    "oversized-frame": HEAD.pack(MAX_BODY + 1, 1),
    "unknown-kind": _frame(0, MAGIC) + _frame(9, b"x"),
    "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "silence": b"",
    "status-from-client": _frame(0, MAGIC) + _frame(3, b"\x00"),
}


@pytest.mark.parametrize("case", list(HOSTILE_BYTES))
async def test_hostile_bytes_close_the_connection_and_hurt_nothing(
    grpc_servers: GrpcServerPool, channels: ChannelPool, case: str
) -> None:
    peers = await start_peers(grpc_servers, 3, QUICK, data_plane=True)
    try:
        assert await _closed_by_server(peers[0].data_port, HOSTILE_BYTES[case])
        await _round_is_exact(peers, channels)  # the daemon still serves honest rounds
    finally:
        await close_peers(peers)


async def test_a_malformed_request_in_a_stream_is_refused_with_a_status(
    grpc_servers: GrpcServerPool,
) -> None:
    peers = await start_peers(grpc_servers, 2, QUICK, data_plane=True)
    connector = DataConnector()
    try:
        call = await connector.open("127.0.0.1", peers[0].data_port, 5.0)
        assert call is not None
        await call.write(b"\xff\xff\xff")  # not a ReduceRequest
        with pytest.raises(DataStreamError) as raised:
            async with asyncio.timeout(10):
                await call.read()
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        call.cancel()
    finally:
        connector.close()
        await close_peers(peers)


async def test_unreachable_data_port_falls_back_to_grpc_and_is_remembered(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    peers = await start_peers(grpc_servers, 3, FAST, data_plane=False)
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    try:
        for seed in range(2):
            await _round_is_exact(peers, channels, seed, data_ports=[dead_port] * 3)
        for p in peers:
            assert p.service.data_connector is not None
            assert p.service.data_connector.opened == 0
        assert len(channels) == 3  # every stream went over gRPC
    finally:
        await close_peers(peers)


async def test_close_ends_idle_and_busy_connections(grpc_servers: GrpcServerPool) -> None:
    peers = await start_peers(grpc_servers, 2, FAST, data_plane=True)
    connector = DataConnector()
    try:
        call = await connector.open("127.0.0.1", peers[0].data_port, 5.0)
        assert call is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", peers[0].data_port)
        writer.write(_frame(0, MAGIC))
        async with asyncio.timeout(10):
            await peers[0].service.close()  # must not wait for idle clients
            with contextlib.suppress(ConnectionResetError):  # closed by a reset is closed too
                assert await reader.read(1) == b""
        with pytest.raises(DataStreamError):
            async with asyncio.timeout(10):
                await call.read()
        call.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    finally:
        connector.close()
        await close_peers(peers)


async def test_connections_beyond_the_limit_are_refused(grpc_servers: GrpcServerPool) -> None:
    peers = await start_peers(grpc_servers, 1, FAST, data_plane=False)
    server = DataPlaneServer(peers[0].service, max_connections=1)
    port = await server.start("127.0.0.1")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_frame(0, MAGIC))
        await writer.drain()
        # The first connection is served (answered, then it idles, open); the second is
        # cut at once.
        async with asyncio.timeout(5.0):
            assert await reader.readexactly(len(_frame(0, MAGIC))) == _frame(0, MAGIC)
        assert await _closed_by_server(port, _frame(0, MAGIC), within=5.0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await reader.read(1)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    finally:
        await server.close()
        await close_peers(peers)


async def test_one_host_cannot_take_every_connection(grpc_servers: GrpcServerPool) -> None:
    peers = await start_peers(grpc_servers, 1, FAST, data_plane=False)
    server = DataPlaneServer(peers[0].service, max_connections=10, max_connections_per_host=1)
    port = await server.start("127.0.0.1")
    try:
        for _ in range(2):  # the slot is given back when the first connection closes
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_frame(0, MAGIC))
            await writer.drain()
            # A second connection from the same host is refused; another host is served.
            assert await _closed_by_server(port, _frame(0, MAGIC), within=5.0)
            assert not await _closed_by_server(port, _frame(0, MAGIC), 0.5, "127.0.0.2")
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            # Both served connections are closed by their clients: their tasks end.
            async with asyncio.timeout(5.0):
                await asyncio.gather(*server._tasks)
            assert not server._per_host
    finally:
        await server.close()
        await close_peers(peers)


async def test_a_full_data_plane_refuses_with_a_status_and_senders_use_grpc(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    """A reducer whose data plane is at its connection limit answers RESOURCE_EXHAUSTED
    before processing anything; senders then stream that part over gRPC: nothing partial."""
    peers = await start_peers(grpc_servers, 3, FAST, data_plane=False)
    full = DataPlaneServer(peers[0].service, max_connections=0)
    full_port = await full.start("127.0.0.1")
    try:
        await _round_is_exact(peers, channels, 5, data_ports=[full_port, 0, 0])
        for p in peers[1:]:  # they tried the data plane once, then remembered the refusal
            assert p.service.data_connector is not None
            # The refusal answered their HELLO: no stream was opened, nothing was sent.
            assert p.service.data_connector.opened == 0
            assert await p.service.data_connector.open("127.0.0.1", full_port, 1.0) is None
    finally:
        await full.close()
        await close_peers(peers)


def test_status_frames_round_trip_and_reject_junk() -> None:
    code, details = parse_status(memoryview(status_body(grpc.StatusCode.NOT_FOUND, "gone")))
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "gone")
    assert parse_status(memoryview(b""))[0] is grpc.StatusCode.INTERNAL
    assert parse_status(memoryview(b"\xee"))[0] is grpc.StatusCode.INTERNAL
    assert parse_status(memoryview(b"\x00" + b"x" * 5000))[0] is grpc.StatusCode.INTERNAL
    assert split_host("10.0.0.1:80") == "10.0.0.1"
    assert split_host("[::1]:80") == "::1"


async def test_averagers_advertise_and_use_the_data_plane_mixed_with_grpc_only() -> None:
    """Matchmaking carries each member's data port; a member without one is reached (and
    reaches the others) over gRPC, and all end bit-identical."""
    async with averager_swarm(2) as swarm:
        await swarm.add(fast_config(allreduce=AllReduceConfig(min_stall=10.0, data_plane=False)))
        rng = np.random.default_rng(3)
        inputs = [[rng.standard_normal(70_000).astype(np.float32)] for _ in range(3)]
        results = await asyncio.gather(
            *(
                p.averager.average(inputs[i], "dp", group_size=3, timeout=20)
                for i, p in enumerate(swarm.peers)
            )
        )
        mean = weighted_mean([x[0] for x in inputs], [1.0, 1.0, 1.0])
        for r in results:
            assert r.group_size == 3
            assert not r.partial
            np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
            assert r.tensors[0].tobytes() == results[0].tensors[0].tobytes()
        services = [p.averager._require()[1] for p in swarm.peers]
        assert [s.data_port > 0 for s in services] == [True, True, False]
        # Each data-plane member opened one connection: to the other data-plane member.
        assert [s.data_connector.opened if s.data_connector else None for s in services] == [
            1,
            1,
            None,
        ]


async def test_a_route_change_takes_effect_on_the_next_stream() -> None:
    """An idle connection is reused only on the route it was opened on: once a peer's data
    plane is routed elsewhere (a direct link after hole punching), the next round's stream
    takes the new route instead of the connection the previous round left idle."""
    async with averager_swarm(2) as swarm:
        rng = np.random.default_rng(5)
        services = [p.averager._require()[1] for p in swarm.peers]

        async def one_round(key: str) -> None:
            inputs = [[rng.standard_normal(70_000).astype(np.float32)] for _ in range(2)]
            results = await asyncio.gather(
                *(
                    p.averager.average(inputs[i], key, group_size=2, timeout=20)
                    for i, p in enumerate(swarm.peers)
                )
            )
            mean = weighted_mean([x[0] for x in inputs], [1.0, 1.0])
            for r in results:
                np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)

        await one_round("before")
        connector = services[0].data_connector
        assert connector is not None
        assert connector.opened == 1
        # A forwarder to peer 1's data plane that counts what it carries.
        target_port = services[1].data_port
        forwarded: list[int] = []
        joins: set[asyncio.Task[int]] = set()

        def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async def join() -> int:
                other = await asyncio.open_connection("127.0.0.1", target_port)
                forwarded.append(1)
                return await splice((reader, writer), other)

            joins.add(asyncio.ensure_future(join()))

        forwarder = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = forwarder.sockets[0].getsockname()[1]
        routed: list[tuple[str | None, str, int]] = []

        def route(peer: str | None, host: str, data_port: int) -> tuple[str, int]:
            routed.append((peer, host, data_port))
            return ("127.0.0.1", port) if data_port == target_port else (host, data_port)

        connector.route = route
        try:
            await one_round("after")
            assert forwarded == [1]  # the new route, not the idle connection of round one
            assert connector.opened == 2
            assert routed[0][0] is not None  # the runner names the peer's gRPC address
        finally:
            forwarder.close()
            for task in joins:
                task.cancel()
            await asyncio.gather(*joins, return_exceptions=True)
