"""A captured signed ``Reduce`` opening cannot be replayed (issue 16), on both transports:
not twice inside the window, not after it, not into another group, not to another reducer.

Authentication comes before the round lookup, so the captured opening names a group that
no peer runs: its first use passes authentication and then finds no round (NOT_FOUND).
"""

from __future__ import annotations

import dataclasses
import os
import time

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.wire import reduce_digest
from swarmavg.averaging.stubs import REDUCE
from swarmavg.dht import ChannelPool
from swarmavg.proto import averaging_pb2
from tests.averaging.allreduce_peers import FAST, LocalPeer, close_peers, make_group, start_peers
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
