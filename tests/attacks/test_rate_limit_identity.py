"""A rate limit keyed by an id that a request only claims throttles that id.

The attack (outsider): the Averaging service's ``JoinGroup`` and ``DownloadState`` took a
token from the bucket of ``header.peer_id`` before the request's signature was checked. A
public key is public, so unsigned requests that name a victim emptied the victim's bucket,
and the victim's own signed ``JoinGroup`` then got ``RESOURCE_EXHAUSTED``.

Against a real averaging peer (leader) on 127.0.0.1 with a small per-peer budget: control
runs first (the victim is served; an attacker flooding under its own verified identity is
limited), then the forged flood, then the honest outcome: the forged requests are refused
as unauthenticated and the victim's signed requests are still served.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.stubs import DOWNLOAD_STATE, JOIN_GROUP
from swarmavg.dht import Identity
from swarmavg.dht.auth import RequestSigner
from swarmavg.dht.ratelimit import RateLimiter, RateLimits
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import RUN_ID, Peer, averager_swarm, fast_config

pytestmark = pytest.mark.timeout(120)

BURST = 5
FLOOD = 4 * BURST  # requests per flood: bounded
OK = grpc.StatusCode.OK
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


async def outcome(call: AsyncIterator[Any]) -> grpc.StatusCode:
    """OK when the service answered with at least one message, else the error's code."""
    try:
        async for _ in call:
            return OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    return OK


class Caller:
    """Raw Averaging calls to ``leader`` over an outsider's own channel."""

    def __init__(self, leader: Peer) -> None:
        self.leader = leader
        self.channel = grpc.aio.insecure_channel(leader.address)

    def join_request(self, signer: RequestSigner | None, claimed: Identity) -> Any:
        key = matchmaking_key(RUN_ID, "k", self.leader.averager.group_bits)
        request = averaging_pb2.JoinRequest(
            key=key, schema_hash=b"s" * 32, declared_start=time.time() + 1
        )
        return self._header(request, signer, claimed, JOIN_GROUP)

    def state_request(self, signer: RequestSigner | None, claimed: Identity) -> Any:
        return self._header(
            averaging_pb2.StateRequest(want_manifest=True), signer, claimed, DOWNLOAD_STATE
        )

    def _header(
        self, request: Any, signer: RequestSigner | None, claimed: Identity, method: str
    ) -> Any:
        if signer is not None:
            return signer.signed(request, self.leader.peer_id, method)
        # forged: the claimed peer's public header, with no signature
        request.header.CopyFrom(claimed.make_header(RUN_ID, "127.0.0.1:1"))
        request.header.receiver_id = self.leader.peer_id
        request.header.method = method
        return request

    async def call(self, request: Any) -> grpc.StatusCode:
        if isinstance(request, averaging_pb2.JoinRequest):
            method = self.channel.unary_stream(
                JOIN_GROUP,
                request_serializer=averaging_pb2.JoinRequest.SerializeToString,
                response_deserializer=averaging_pb2.JoinResponse.FromString,
            )
        else:
            method = self.channel.unary_stream(
                DOWNLOAD_STATE,
                request_serializer=averaging_pb2.StateRequest.SerializeToString,
                response_deserializer=averaging_pb2.StateResponse.FromString,
            )
        return await outcome(method(request, timeout=30))

    async def close(self) -> None:
        await self.channel.close()


async def test_requests_that_only_name_a_peer_do_not_spend_its_rate_limit() -> None:
    async with averager_swarm(2, fast_config()) as swarm:
        leader, victim_peer = swarm.peers
        # the leader's per-peer budget, small so that a flood is short (the attribute the
        # servicer takes each request's per-peer token from)
        leader.averager._servicer.rate_limiter = RateLimiter(
            RateLimits(per_source_rate=0.01, per_source_burst=BURST)
        )
        victim = RequestSigner(victim_peer.node.identity, RUN_ID, lambda: victim_peer.address)
        victim_identity = victim_peer.node.identity
        attacker_identity = Identity.generate()
        attacker = RequestSigner(attacker_identity, RUN_ID, lambda: "127.0.0.1:1")
        caller = Caller(leader)
        try:
            # control: the victim is served; the attacker's own signed flood is limited
            assert await caller.call(caller.join_request(victim, victim_identity)) == OK
            codes = [
                await caller.call(caller.join_request(attacker, attacker_identity))
                for _ in range(FLOOD)
            ]
            assert codes[:BURST] == [OK] * BURST
            assert codes[BURST:] == [EXHAUSTED] * (FLOOD - BURST)

            # the attack: unsigned requests that claim the victim's id
            for i in range(FLOOD):
                forged = (
                    caller.join_request(None, victim_identity)
                    if i % 2
                    else caller.state_request(None, victim_identity)
                )
                # refused as what it is, never charged to the victim's budget
                assert await caller.call(forged) == grpc.StatusCode.UNAUTHENTICATED

            # honest outcome: the victim's own signed requests are still served
            assert await caller.call(caller.join_request(victim, victim_identity)) == OK
            assert await caller.call(caller.state_request(victim, victim_identity)) == OK
        finally:
            await caller.close()
