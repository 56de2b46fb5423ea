"""A captured signed message cannot be replayed: a ``Reduce`` opening, on both
transports, not twice inside the window, not after it, not into another group, not to
another reducer; a JoinRequest not a second time.

Authentication comes before the round lookup, so the captured opening names a group that
no peer runs: its first use passes authentication and then finds no round (NOT_FOUND).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.wire import reduce_digest
from swarmavg.averaging.matchmaking.config import MatchmakingEvent
from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.stubs import JOIN_GROUP, REDUCE, join_group_method
from swarmavg.dht import ChannelPool
from swarmavg.proto import averaging_pb2
from tests.averaging.allreduce_peers import FAST, LocalPeer, close_peers, make_group, start_peers
from tests.averaging.averager_swarm import RUN_ID, averager_swarm, fast_config, ranked
from tests.averaging.matchmaking.test_matchmaking import declarations, declare
from tests.averaging.test_message_auth import Outsider
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)

QUICK = dataclasses.replace(FAST, registration_wait=0.2)


def opening(sender: LocalPeer, receiver: LocalPeer, group_id: bytes) -> averaging_pb2.ReduceRequest:
    """``sender``'s signed first message of its stream of part 0 to ``receiver``."""
    first = averaging_pb2.ReduceRequest(group_id=group_id, part_index=0, weight=1.0)
    digest = reduce_digest(group_id, 0, 1.0, 0)
    first.header.CopyFrom(sender.signer.sign(receiver.identity.peer_id, REDUCE, digest))
    return first


async def outcome(
    channels: ChannelPool, peer: LocalPeer, message: averaging_pb2.ReduceRequest
) -> tuple[grpc.StatusCode | None, str]:
    outsider = Outsider([message])
    await outsider.open(channels, peer.address, peer.data_port)
    try:
        return await outsider.first_outcome(), outsider.details
    finally:
        await outsider.close()


async def test_a_captured_reduce_opening_cannot_be_replayed(
    grpc_servers: GrpcServerPool, channels: ChannelPool, allreduce_transport: str
) -> None:
    peers = await start_peers(grpc_servers, 3, QUICK)
    try:
        group = make_group(peers, [np.zeros(64, np.float32)])
        sender, reducer, other = peers[2], peers[0], peers[1]
        captured = opening(sender, reducer, group.group_id)
        code, _ = await outcome(channels, reducer, captured)
        assert code == grpc.StatusCode.NOT_FOUND  # authenticated; no such round here

        code, details = await outcome(channels, reducer, captured)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "replay" in details

        elsewhere = averaging_pb2.ReduceRequest()
        elsewhere.CopyFrom(captured)
        elsewhere.group_id = os.urandom(16)  # another group: the signature covers the group
        code, details = await outcome(channels, reducer, elsewhere)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "signature" in details

        code, details = await outcome(channels, other, opening(sender, reducer, group.group_id))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "another receiver" in details

        late = opening(sender, reducer, group.group_id)
        window = reducer.service.authenticator.window
        reducer.service.authenticator.clock = lambda: time.time() + window + 1
        code, details = await outcome(channels, reducer, late)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "timestamp" in details
    finally:
        await close_peers(peers)


async def test_a_captured_join_request_cannot_be_replayed() -> None:
    """A follower's signed JoinRequest, replayed by an outsider while the follower waits
    (it would supersede the follower's stream): refused, and the follower stays in."""
    async with averager_swarm(3, fast_config(matchmaking_time=8.0)) as swarm:
        leader, follower, outsider = ranked(swarm.peers, "k")
        key = matchmaking_key(RUN_ID, "k", leader.averager.group_bits)
        round_ = asyncio.ensure_future(
            leader.averager.average([np.zeros(3, np.float32)], "k", group_size=3, timeout=20)
        )
        await swarm.wait_for(lambda: any(e[0] is MatchmakingEvent.DECLARED for e in leader.events))
        schema = (await declarations(leader, key))[leader.peer_id].schema_hash
        start = time.time() + 1
        await declare(follower, key, schema, start)  # a leader takes only what was signed
        captured = averaging_pb2.JoinRequest(key=key, schema_hash=schema, declared_start=start)
        follower.node.signer.signed(captured, leader.peer_id, JOIN_GROUP)
        genuine = join_group_method(follower.channels.channel(leader.address))(captured, timeout=10)
        replayed = join_group_method(outsider.channels.channel(leader.address))(
            captured, timeout=10
        )
        try:
            assert (await genuine.read()).code == averaging_pb2.JOIN_ACCEPTED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await replayed.read()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "replay" in str(info.value.details())
            left = MatchmakingEvent.FOLLOWER_LEFT
            assert not any(e[0] is left and e[2] == follower.peer_id for e in leader.events)
        finally:
            genuine.cancel()
            replayed.cancel()
            round_.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await round_
