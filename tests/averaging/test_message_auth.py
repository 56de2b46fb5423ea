"""JoinGroup, Reduce (gRPC and data plane) and DownloadState prove their sender.

An outsider copies a real peer's header (its public key is public) and speaks in its name:
unsigned, or signed with its own key. Real peers over real gRPC and the real data plane;
each attack would succeed on code that only checks that the key hashes to the id.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.chunking import bytes_per_element
from swarmavg.averaging.allreduce.data_connector import DataConnector, DataStreamError
from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.partition import PartPlan, chunk_elements_for
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.group import GroupInfo
from swarmavg.averaging.matchmaking.config import MatchmakingEvent
from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.stubs import download_state_method, join_group_method
from swarmavg.compression import CodecInfo, get_codec
from swarmavg.dht import ChannelPool, Identity
from swarmavg.proto import averaging_pb2, common_pb2
from tests.averaging import allreduce_peers
from tests.averaging.allreduce_peers import close_peers, make_group, run_group, start_peers
from tests.averaging.averager_swarm import (
    RUN_ID,
    AveragerSwarm,
    Peer,
    averager_swarm,
    fast_config,
    ranked,
)
from tests.averaging.matchmaking.test_matchmaking import declarations
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)

CODEC = get_codec("none")
SIGNATURES = ["none", "own"]


def forge(
    header: common_pb2.RequestHeader, message: Any, method: str, receiver: bytes, digest: bytes
) -> None:
    """Sign ``message``'s copied ``header`` with an outsider's own key, over exactly what
    the copied peer would have signed (``digest``, ``receiver``, ``method``)."""
    from swarmavg.dht.auth import sign_request

    signed = sign_request(
        Identity.generate(), header.run_id, header.address, receiver, method, digest
    )
    signed.peer_id, signed.public_key = header.peer_id, header.public_key
    message.header.CopyFrom(signed)


def digest_of(message: Any) -> bytes:
    from swarmavg.dht.auth import message_digest

    return message_digest(message)


def assert_unauthenticated(error: grpc.aio.AioRpcError | DataStreamError) -> None:
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error.details()
    assert error.details()


# ---------------------------------------------------------------- JoinGroup


@pytest.mark.parametrize("signature", SIGNATURES)
async def test_a_displaced_join_is_refused_and_the_real_member_stays(signature: str) -> None:
    """An outsider sends a JoinRequest as a real declarer that already follows the leader
    (a newer request would supersede its stream and push it out of the group)."""
    config = fast_config(matchmaking_time=8.0)
    async with averager_swarm(4, config) as swarm:
        leader, follower, late, outsider = ranked(swarm.peers, "k")
        key = matchmaking_key(RUN_ID, "k", leader.averager.group_bits)
        values = [np.full(3, float(i), np.float32) for i in range(3)]

        def average(peer: Peer, i: int) -> asyncio.Future[AveragingResult]:
            return asyncio.ensure_future(
                peer.averager.average([values[i]], "k", group_size=3, min_group_size=3, timeout=20)
            )

        def joined(peer: Peer) -> bool:
            return any(e[0] is MatchmakingEvent.JOINED_LEADER for e in peer.events)

        rounds = [average(leader, 0)]
        await swarm.wait_for(lambda: any(e[0] is MatchmakingEvent.DECLARED for e in leader.events))
        rounds.append(average(follower, 1))
        await swarm.wait_for(lambda: joined(follower))
        declared = (await declarations(leader, key))[follower.peer_id]
        request = averaging_pb2.JoinRequest(
            key=key,
            schema_hash=declared.schema_hash,
            mode=int(declared.mode),
            bandwidth=declared.bandwidth,
            declared_start=declared.start,
        )
        request.header.CopyFrom(follower.node.identity.make_header(RUN_ID, follower.address))
        if signature == "own":
            forge(
                request.header,
                request,
                "/swarmavg.v1.Averaging/JoinGroup",
                leader.peer_id,
                digest_of(request),
            )
        call = join_group_method(outsider.channels.channel(leader.address))(request, timeout=10)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert_unauthenticated(info.value)
        finally:
            call.cancel()
        rounds.append(average(late, 2))
        results = await asyncio.gather(*rounds)
        members = sorted(p.peer_id.hex() for p in (leader, follower, late))
        for result in results:
            assert sorted(result.peers) == members
            assert result.group_id == results[0].group_id
            np.testing.assert_allclose(result.tensors[0], np.full(3, 1.0, np.float32))
        assert not any(e[0] is MatchmakingEvent.LEFT_LEADER for e in follower.events)
        left = MatchmakingEvent.FOLLOWER_LEFT
        assert not any(e[0] is left and e[2] == follower.peer_id for e in leader.events)


# ---------------------------------------------------------------- Reduce


class Outsider:
    """Opens a ``Reduce`` stream to one reducer and writes hand-made messages."""

    def __init__(self, messages: list[averaging_pb2.ReduceRequest]) -> None:
        self.messages = messages
        self._call: Any = None
        self._writer: asyncio.Task[None] | None = None
        self._connector: DataConnector | None = None
        self.details = ""

    async def open(self, channels: ChannelPool, address: str, data_port: int) -> None:
        if data_port:
            self._connector = DataConnector()
            self._call = await self._connector.open("127.0.0.1", data_port, 5.0)
            assert self._call is not None
            data = [m.SerializeToString() for m in self.messages]
        else:
            self._call = channels.channel(address).stream_stream(
                "/swarmavg.v1.Averaging/Reduce",
                request_serializer=averaging_pb2.ReduceRequest.SerializeToString,
                response_deserializer=averaging_pb2.ReduceResponse.FromString,
            )(timeout=20)
            data = list(self.messages)

        async def write() -> None:
            for item in data:
                await self._call.write(item)

        self._writer = asyncio.get_running_loop().create_task(write())

    async def first_outcome(self) -> grpc.StatusCode | None:
        """The stream's status when the reducer ends it before any reply; ``None`` when a
        reply came (the reducer accepted the stream and averaged its chunks)."""
        try:
            async with asyncio.timeout(15):
                reply = await self._call.read()
        except (DataStreamError, grpc.aio.AioRpcError) as e:
            self.details = str(e.details())
            return e.code()  # type: ignore[no-any-return]
        if reply is grpc.aio.EOF:
            self.details = str(await self._call.details())
            return await self._call.code()  # type: ignore[no-any-return]
        return None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(
                asyncio.CancelledError, grpc.RpcError, asyncio.InvalidStateError, DataStreamError
            ):
                await self._writer
        if self._call is not None:
            self._call.cancel()
        if self._connector is not None:
            self._connector.close()


def part_messages(
    group: GroupInfo,
    header: common_pb2.RequestHeader,
    part: int,
    values: np.ndarray,
    weight: float,
) -> list[averaging_pb2.ReduceRequest]:
    """Every message of a sender's stream of ``part`` carrying ``values`` (the whole
    flattened vector), under ``header``."""
    per_element = bytes_per_element(CODEC, np.dtype(np.float32))
    plan = PartPlan.build(
        part_sizes(group.members, values.size),
        chunk_elements_for(per_element, allreduce_peers.FAST.chunk_bytes),
    )
    base = plan.bounds[part][0]
    messages = []
    for c in range(plan.num_chunks(part)):
        lo, hi = plan.chunk_bounds(part, c)
        chunk = CODEC.encode(np.ascontiguousarray(values[base + lo : base + hi]), CodecInfo())
        messages.append(averaging_pb2.ReduceRequest(chunk=chunk, chunk_index=c))
    first = messages[0]
    first.header.CopyFrom(header)
    first.group_id = group.group_id
    first.part_index = part
    first.weight = weight
    return messages


def reduce_digest_of(first: averaging_pb2.ReduceRequest) -> bytes:
    from swarmavg.averaging.allreduce.wire import reduce_digest

    return reduce_digest(first.group_id, first.part_index, first.weight, first.chunk_index)


@pytest.mark.parametrize("signature", SIGNATURES)
async def test_a_hijacked_reduce_slot_is_refused_and_the_real_member_counts(
    grpc_servers: GrpcServerPool, channels: ChannelPool, allreduce_transport: str, signature: str
) -> None:
    """The outsider opens a stream to every other reducer as member 2 before member 2 does,
    with forged values: refused, and member 2's own contribution is what counts."""
    peers = await start_peers(grpc_servers, 3)
    try:
        rng = np.random.default_rng(3)
        inputs = [[rng.standard_normal(6000).astype(np.float32)] for _ in peers]
        weights = [1.0, 2.0, 1.0]
        mean = weighted_mean([x[0] for x in inputs], weights)
        group = make_group(peers, inputs[0])
        victim = peers[2]
        copied = victim.identity.make_header(allreduce_peers.RUN_ID, victim.address)
        others = asyncio.ensure_future(run_group(peers, group, inputs, weights, channels, skip=[2]))
        outsiders = []
        for p in (0, 1):
            messages = part_messages(group, copied, p, np.full(6000, 1e3, np.float32), 100.0)
            if signature == "own":
                first = messages[0]
                first.ClearField("header")
                forge(
                    copied,
                    first,
                    "/swarmavg.v1.Averaging/Reduce",
                    peers[p].identity.peer_id,
                    reduce_digest_of(first),
                )
            outsider = Outsider(messages)
            await outsider.open(channels, peers[p].address, peers[p].data_port)
            outsiders.append(outsider)
        try:
            outcomes = [await o.first_outcome() for o in outsiders]
        finally:
            for o in outsiders:
                await o.close()
        assert outcomes == [grpc.StatusCode.UNAUTHENTICATED] * 2
        mine = await run_group(peers, group, inputs, weights, channels, skip=[0, 1])
        results = [*(await others)[:2], mine[2]]
        for r in results:
            assert isinstance(r, AveragingResult), r
            assert r.failed_parts == ()
            assert not r.partial
            np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
    finally:
        await close_peers(peers)


# ---------------------------------------------------------------- DownloadState


@pytest.mark.parametrize("signature", SIGNATURES)
async def test_download_state_with_a_copied_header_is_refused(signature: str) -> None:
    swarm = AveragerSwarm()
    try:
        donor = await swarm.add(fast_config())
        joiner = await swarm.add(fast_config())
        outsider = await swarm.add(fast_config())
        await donor.averager.publish_state([np.arange(10, dtype=np.float32)], b"m", version=1.0)
        manifest = donor.averager.state_sharer.store.current
        assert manifest is not None
        request = averaging_pb2.StateRequest(root=manifest.root, want_manifest=True)
        request.header.CopyFrom(joiner.node.identity.make_header(RUN_ID, joiner.address))
        if signature == "own":
            forge(
                request.header,
                request,
                "/swarmavg.v1.Averaging/DownloadState",
                donor.peer_id,
                digest_of(request),
            )
        call = download_state_method(outsider.channels.channel(donor.address))(request, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert_unauthenticated(info.value)
        # The honest joiner still loads it.
        metadata, tensors = await joiner.averager.load_state(timeout=20)
        assert metadata == b"m"
        np.testing.assert_array_equal(tensors[0], np.arange(10, dtype=np.float32))
    finally:
        await swarm.close()
