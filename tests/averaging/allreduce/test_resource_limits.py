"""Bounded resources of the reducer side: cheap streams cannot deny service.

Real gRPC servers and the real data plane on 127.0.0.1; the attacker drives hand-made
``Reduce`` streams. Each test's docstring says what happens without the bound it checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import struct
import tracemalloc

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.admission import host_group
from swarmavg.averaging.allreduce.chunking import bytes_per_element
from swarmavg.averaging.allreduce.data_connector import DataConnector
from swarmavg.averaging.allreduce.faults import Fault, FaultPlan
from swarmavg.averaging.allreduce.framing import MAGIC
from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.partition import PartPlan, chunk_elements_for
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.group import Mode
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.service import add_reduce_to_server
from swarmavg.compression import registry
from swarmavg.dht import ChannelPool, Identity
from swarmavg.dht.auth import Authenticator
from swarmavg.dht.server_limits import ServerLimits, make_server
from swarmavg.proto import averaging_pb2, common_pb2
from tests.averaging.allreduce.test_allreduce_hostile import CODEC, HONEST, Hostile
from tests.averaging.allreduce_peers import FAST, close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(90)

REDUCE = "/swarmavg.v1.Averaging/Reduce"
_OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)  # not shared with the honest peers


def _reduce_call(channel: grpc.aio.Channel, timeout: float) -> grpc.aio.StreamStreamCall:
    return channel.stream_stream(
        REDUCE,
        request_serializer=averaging_pb2.ReduceRequest.SerializeToString,
        response_deserializer=averaging_pb2.ReduceResponse.FromString,
    )(timeout=timeout)


async def test_silent_streams_on_one_connection_do_not_block_honest_reduces(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    """64 streams that never send a message, all on one HTTP/2 connection, held open while
    an honest round runs. Without the bound each would take a waiting slot (64 by default) before
    its first message, so the honest senders got RESOURCE_EXHAUSTED and every part they
    sent failed (``failed_parts`` not empty, and the probe below was refused too)."""
    peers = await start_peers(grpc_servers, HONEST)
    target = peers[0]
    # A channel of its own: one TCP connection that carries only the attack.
    attack = grpc.aio.insecure_channel(target.address, options=[_OWN_CONNECTION])
    silent = [_reduce_call(attack, 30.0) for _ in range(64)]
    try:
        await target.service.inbound.wait_until(lambda n: n >= 64)  # each one is in a handler
        # A stream on the same connection is refused for its header, not for want of a slot.
        probe = _reduce_call(attack, 30.0)
        bad = averaging_pb2.ReduceRequest(header=common_pb2.RequestHeader(run_id="other"))
        await probe.write(bad)
        assert await probe.code() is grpc.StatusCode.UNAUTHENTICATED

        rng = np.random.default_rng(3)
        inputs = [[rng.standard_normal(20_000).astype(np.float32)] for _ in peers]
        weights = [1.0] * HONEST
        group = make_group(peers, inputs[0])
        results = await run_group(peers, group, inputs, weights, channels, timeout=20)
        mean = weighted_mean([x[0] for x in inputs], weights)
        for r in results:
            assert isinstance(r, AveragingResult), r
            assert r.failed_parts == ()
            np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
    finally:
        for call in silent:
            call.cancel()
        await attack.close()
        await close_peers(peers)


async def _send_on_the_data_plane_without_reading(
    port: int, messages: list[averaging_pb2.ReduceRequest], writers: list[asyncio.StreamWriter]
) -> None:
    """One data-plane stream of ``messages`` whose replies are never read; the socket's
    receive buffer kept small, so that the reducer's writes back stall soon."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writers.append(writer)
    writer.write(struct.pack("<IB", len(MAGIC), 0) + MAGIC)
    await reader.readexactly(5 + len(MAGIC))  # the server's HELLO: then the stream
    for message in messages:
        body = message.SerializeToString()
        writer.write(struct.pack("<IB", len(body), 1) + body)
        await writer.drain()


@pytest.mark.parametrize("data_plane", [False, True], ids=["grpc", "data-plane"])
async def test_a_member_that_stops_reading_is_cut_and_pins_nothing(
    grpc_servers: GrpcServerPool, channels: ChannelPool, data_plane: bool
) -> None:
    """A member sends every chunk of every part but never reads a reply. Without the bounds
    the reducer's ``context.write`` had no deadline and its reply queue no bound: the
    stream, the round and every reply stayed in memory after the round (the handler never
    returned), and the member was never dropped. Over the data plane the stream bounds its
    writes itself (the round adds no deadline of its own there)."""
    config = dataclasses.replace(FAST, chunk_bytes=1 << 20, write_timeout=1.0)
    peers = await start_peers(grpc_servers, HONEST + 1, config, data_plane=data_plane)
    calls: list[grpc.aio.StreamStreamCall] = []
    writers: list[asyncio.StreamWriter] = []
    try:
        rng = np.random.default_rng(5)
        # Parts of 8 MiB: far more than HTTP/2 flow control and socket buffers take unread.
        inputs = [[rng.standard_normal(3 * (2 << 20)).astype(np.float32)] for _ in peers]
        weights = [1.0] * (HONEST + 1)
        mean = weighted_mean([x[0] for x in inputs[:HONEST]], weights[:HONEST])
        group = make_group(peers, inputs[0], [Mode.NODE] * HONEST + [Mode.CLIENT])
        hostile = Hostile(group, peers[HONEST].identity, mean)
        per_element = bytes_per_element(CODEC, np.dtype(np.float32))
        hostile.plan = PartPlan.build(
            part_sizes(group.members, mean.size),
            chunk_elements_for(per_element, config.chunk_bytes),
        )
        attack = grpc.aio.insecure_channel(peers[0].address, options=[_OWN_CONNECTION])
        channels_to = [attack] + [
            grpc.aio.insecure_channel(p.address, options=[_OWN_CONNECTION]) for p in peers[1:HONEST]
        ]

        async def send_without_reading(part: int) -> None:
            if data_plane:
                await _send_on_the_data_plane_without_reading(
                    peers[part].data_port, hostile.valid(part), writers
                )
                return
            call = _reduce_call(channels_to[part], 60.0)
            calls.append(call)
            for message in hostile.valid(part):
                await call.write(message)

        senders = [asyncio.ensure_future(send_without_reading(p)) for p in range(HONEST)]
        results = await run_group(
            peers, group, inputs, weights, channels, timeout=30, skip=[HONEST]
        )
        for s in senders:
            s.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                await s
        honest = [r for r in results if r is not None]
        for r in honest:
            assert isinstance(r, AveragingResult), r
            np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
            assert "read no reply" in r.dropped[HONEST] or "does not read" in r.dropped[HONEST]
        # Every reducer's handler for the silent reader has returned: nothing is pinned.
        for p in peers[:HONEST]:
            await asyncio.wait_for(p.service.inbound.wait_until(lambda n: n == 0), 10.0)
        for channel in channels_to:
            await channel.close()
    finally:
        for call in calls:
            call.cancel()
        for writer in writers:
            writer.close()
        await close_peers(peers)


async def test_codec_spelling_flood_keeps_few_codec_instances(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    """Rounds over real gRPC whose leader spells ``topk`` differently each time. Without
    the cap every spelling made one more instance, each with up to 1 GiB of residuals
    (here: 12 instances after 12 rounds); now spellings of one codec share an instance
    and at most ``max_codec_instances`` are kept."""
    peers = await start_peers(grpc_servers, HONEST)
    try:
        rng = np.random.default_rng(11)
        inputs = [[rng.standard_normal(4096).astype(np.float32)] for _ in peers]
        same = ["topk:fraction=0.5", "topk:fraction=0.50", "topk:fraction=5e-1", "topk:fraction=.5"]
        distinct = [f"topk:fraction=0.{i}1" for i in range(1, 9)]
        for spelling in same:
            group = make_group(peers, inputs[0], codec=spelling)
            results = await run_group(peers, group, inputs, [1.0] * HONEST, channels)
            assert all(isinstance(r, AveragingResult) and not r.partial for r in results)
        assert [p.service.codec_instances for p in peers] == [1] * HONEST
        for spelling in distinct:
            group = make_group(peers, inputs[0], codec=spelling)
            results = await run_group(peers, group, inputs, [1.0] * HONEST, channels)
            assert all(isinstance(r, AveragingResult) and not r.partial for r in results)
        limit = FAST.max_codec_instances
        assert [p.service.codec_instances for p in peers] == [limit] * HONEST
    finally:
        await close_peers(peers)


def test_decoder_cache_is_bounded_against_spellings_in_messages() -> None:
    """A message names its codec; every distinct name used to stay cached for ever."""
    for i in range(3 * registry.MAX_DECODERS):
        registry.decoder_for(f"topk:fraction=0.{i + 1:04d}")
    assert registry.cached_decoders() <= registry.MAX_DECODERS


async def test_a_failing_round_task_is_logged_and_in_the_outcome(
    grpc_servers: GrpcServerPool, channels: ChannelPool, caplog: pytest.LogCaptureFixture
) -> None:
    """Member 0's task that returns averaged chunks raises. Unowned, the failure was
    only logged as a nameless background task: its senders waited to the deadline and the
    result said nothing about it; now the cause is logged against the round, the senders
    are told at once, and every member's result shows part 0 as not averaged."""
    peers = await start_peers(grpc_servers, HONEST)
    try:
        rng = np.random.default_rng(13)
        inputs = [[rng.standard_normal(20_000).astype(np.float32)] for _ in peers]
        group = make_group(peers, inputs[0])
        faults = {0: FaultPlan(Fault.REDUCER_RAISES, after_chunks=1)}
        with caplog.at_level(logging.ERROR, logger="swarmavg.averaging.allreduce.round"):
            results = await run_group(
                peers, group, inputs, [1.0] * HONEST, channels, timeout=20, faults=faults
            )
        for r in results:
            assert isinstance(r, AveragingResult), r
            assert r.partial
            assert 0 in r.failed_parts
        first = results[0]
        assert isinstance(first, AveragingResult)
        assert any("InjectedFault" in e for e in first.errors), first.errors
        logged = [
            rec for rec in caplog.records if "returning averaged chunks failed" in rec.message
        ]
        assert logged
        assert group.group_id.hex() in logged[0].message
    finally:
        await close_peers(peers)


async def test_frame_headers_from_many_connections_allocate_within_the_budget(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    """64 data-plane connections from one host (127.0.0.2, the per-host connection cap)
    each send a frame header declaring a 4 MiB body and nothing more. Without the budget each
    header allocated its body at once: 256 MiB traced for a few hundred bytes sent; now
    the bodies are charged to the pending allowance of the host's range first (two
    bodies) and the rest wait unread. An honest round from 127.0.0.1 still runs over the
    data plane meanwhile."""
    peers = await start_peers(grpc_servers, HONEST, data_plane=True)
    target = peers[0]
    writers: list[asyncio.StreamWriter] = []
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        header = struct.pack("<IB", 4 << 20, 1)  # MSG, 4 MiB declared, never sent
        hello = struct.pack("<IB", len(MAGIC), 0) + MAGIC
        for _ in range(64):
            _, writer = await asyncio.open_connection(
                "127.0.0.1", target.data_port, local_addr=("127.0.0.2", 0)
            )
            writer.write(hello + header)
            writers.append(writer)
        budget = target.service.data_plane_budget
        assert budget is not None
        allowance = budget.caps.pending_per_range
        account = ("pending-range", "local 127.0.0.2")
        # Every header has been read: 2 bodies admitted, the other 62 waiting.
        await asyncio.wait_for(
            budget.wait_until(lambda b: b.held_by(account) == 8 << 20 and b.deferred >= 62),
            30.0,
        )
        peak = tracemalloc.get_traced_memory()[1] - baseline
        tracemalloc.stop()
        assert peak < allowance + (8 << 20), peak

        rng = np.random.default_rng(17)
        inputs = [[rng.standard_normal(50_000).astype(np.float32)] for _ in peers]
        group = make_group(peers, inputs[0])
        opened = [p.service.data_connector.opened for p in peers if p.service.data_connector]
        results = await run_group(peers, group, inputs, [1.0] * HONEST, channels)
        for r in results:
            assert isinstance(r, AveragingResult), r
            assert r.failed_parts == ()
        reopened = [p.service.data_connector.opened for p in peers if p.service.data_connector]
        assert sum(reopened) > sum(opened)  # the honest streams used the data plane
    finally:
        tracemalloc.stop()
        for writer in writers:
            writer.close()
        await close_peers(peers)
    # Closed connections give their bytes back.
    assert budget.held == 0


@pytest.mark.parametrize(
    ("host", "group"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("::ffff:198.51.100.4", "198.51.100.4"),
        ("fe80::1%eth0", "fe80::/64"),
        ("not-an-address", "not-an-address"),
    ],
)
def test_hosts_are_grouped_by_ipv6_prefix(host: str, group: str) -> None:
    """One IPv6 host holds a whole /64: its addresses count as one host for every cap."""
    assert host_group(host) == group


def test_unreachable_reducer_table_is_bounded() -> None:
    """Reducer addresses come from leaders; each unreachable one was remembered for ever."""
    connector = DataConnector()
    for i in range(5000):
        connector.refused(f"198.51.{i // 256}.{i % 256}", 4000 + i)
    assert connector.remembered_unreachable == 1024
    connector.close()


async def test_server_limits_cap_streams_per_connection() -> None:
    """A server made by ``make_server`` serves at most ``max_concurrent_streams`` streams
    of one connection at once (the rest wait on the client or are refused); gRPC's own
    default lets a connection open 2^31 - 1, so all 8 would be in handlers."""
    service = AllReduceService(
        Authenticator(Identity.generate(), "test-allreduce"),
        dataclasses.replace(FAST, registration_wait=30.0),
    )
    server = make_server(ServerLimits(max_concurrent_streams=4))
    add_reduce_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    attack = grpc.aio.insecure_channel(address, options=[_OWN_CONNECTION])
    other = grpc.aio.insecure_channel(address, options=[_OWN_CONNECTION])
    calls: list[grpc.aio.StreamStreamCall] = []
    try:
        bad = averaging_pb2.ReduceRequest(header=common_pb2.RequestHeader(run_id="other"))
        # One call first, so the client has the server's SETTINGS before the flood.
        probe = _reduce_call(attack, 30.0)
        await probe.write(bad)
        assert await probe.code() is grpc.StatusCode.UNAUTHENTICATED
        calls = [_reduce_call(attack, 30.0) for _ in range(8)]  # silent: none ends
        await asyncio.wait_for(service.inbound.wait_until(lambda n: n >= 4), 10.0)
        # A stream on another connection is served: the server is not stuck, and by the
        # time it answers, the attack connection's streams have had their chance.
        sentinel = _reduce_call(other, 30.0)
        await sentinel.write(bad)
        assert await sentinel.code() is grpc.StatusCode.UNAUTHENTICATED
        # The sentinel's own handler may still count for a moment after its status went out
        # (it leaves the gauge as it unwinds); the attack's streams never end, so more than
        # 4 of them in handlers would keep the gauge above 4 for good.
        await asyncio.wait_for(service.inbound.wait_until(lambda n: n <= 4), 10.0)
        assert service.inbound.value == 4
    finally:
        for call in calls:
            call.cancel()
        await attack.close()
        await other.close()
        await server.stop(None)
        await service.close()
