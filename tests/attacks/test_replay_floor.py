"""The replay cache must not let one sender lock everyone else out.

The attack (outsider): the authenticator accepts timestamps up to ``auth_window`` (120 s)
ahead of its clock and remembers every accepted (sender, nonce) until the cache is full;
on the reviewed code an entry evicted while still fresh set one floor for all senders. One
Ping stamped +119 s, then enough Pings to push it out of the cache, and the node refused every
signed message of every peer for about two minutes ("the timestamp predates this peer's
replay horizon"). And nonces were remembered before the rate limit ran, so a flood that was
refused still filled the cache.

Each test runs the attack against real nodes on 127.0.0.1, over gRPC, with a control run
first, and checks the honest outcome: the honest peers' messages (an established peer's and
a newcomer's) are still accepted, a captured message still cannot be replayed, and a sender
over its rate limit occupies no entry of the cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from swarmavg.dht import DHTConfig, DHTNode, Identity
from swarmavg.dht.auth import message_digest, sign_request
from swarmavg.dht.identity import address_signature_payload
from swarmavg.dht.protocol import DHTRPCError
from swarmavg.dht.ratelimit import RateLimits
from swarmavg.proto import dht_pb2

pytestmark = pytest.mark.timeout(240)

RUN = "test"
PING = "/swarmavg.v1.DHT/Ping"
CACHE = 1000  # replay-cache entries (the default is 200,000: the review cut it to 3,000)
OK = grpc.StatusCode.OK


async def raw_ping(
    channel: grpc.aio.Channel, sender: Identity, receiver_id: bytes, at: float | None = None
) -> grpc.StatusCode:
    """A client-mode Ping signed by ``sender``, stamped ``at`` (now by default)."""
    request = dht_pb2.PingRequest()
    header = sign_request(sender, RUN, "", receiver_id, PING, message_digest(request), now=at)
    request.header.CopyFrom(header)
    try:
        await channel.unary_unary(PING)(request.SerializeToString(), timeout=30)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return OK


async def flood(channel: grpc.aio.Channel, senders: list[Identity], receiver_id: bytes) -> None:
    """One fresh Ping per entry of ``senders`` (bounded), 50 in flight at a time."""
    for start in range(0, len(senders), 50):
        batch = senders[start : start + 50]
        await asyncio.gather(*(raw_ping(channel, s, receiver_id) for s in batch))


def captured_ping(node: DHTNode, receiver: DHTNode) -> dht_pb2.PingRequest:
    """A genuine signed Ping of ``node`` to ``receiver``, as an eavesdropper would keep it."""
    assert node.address is not None
    request = dht_pb2.PingRequest(
        address_signature=node.identity.sign(
            address_signature_payload(RUN, node.peer_id, node.address)
        )
    )
    return node.signer.signed(request, receiver.peer_id, PING)


async def honest_ping(node: DHTNode, target: DHTNode) -> None:
    assert target.address is not None
    try:
        await node.protocol.call_ping(target.address, expected_id=target.peer_id)
    except DHTRPCError as e:
        pytest.fail(f"the honest peer's ping was refused: {e.reason}")


@pytest.fixture
async def pair() -> AsyncIterator[tuple[DHTNode, DHTNode, grpc.aio.Channel]]:
    """A target with a small replay cache, an honest peer that knows it, an outsider's
    channel to it."""
    target = await DHTNode.create(DHTConfig(run_id=RUN, auth_max_nonces=CACHE))
    assert target.address is not None
    honest = await DHTNode.create(DHTConfig(run_id=RUN, initial_peers=[target.address]))
    channel = grpc.aio.insecure_channel(target.address)
    try:
        yield target, honest, channel
    finally:
        await channel.close()
        await honest.shutdown()
        await target.shutdown()


@pytest.mark.parametrize("flooders", ["one identity", "one identity per message"])
async def test_a_far_future_stamp_and_a_flood_do_not_lock_out_honest_peers(
    pair: tuple[DHTNode, DHTNode, grpc.aio.Channel], flooders: str
) -> None:
    target, honest, channel = pair
    # control: the honest peer is served, and so is a newcomer
    await honest_ping(honest, target)
    assert await raw_ping(channel, Identity.generate(), target.peer_id) == OK
    captured = captured_ping(honest, target)
    answer = await channel.unary_unary(PING)(captured.SerializeToString(), timeout=30)
    assert dht_pb2.PingResponse.FromString(answer).header.peer_id == target.peer_id

    # the attack: one message stamped 119 s ahead (inside the window, so accepted) ...
    ahead = Identity.generate()
    assert await raw_ping(channel, ahead, target.peer_id, at=time.time() + 119) == OK
    # ... then enough fresh messages to push it out of the cache
    count = CACHE + 200
    if flooders == "one identity":
        one = Identity.generate()
        senders = [one] * count
    else:
        senders = [Identity.generate() for _ in range(count)]
    await flood(channel, senders, target.peer_id)
    assert len(target.authenticator) <= CACHE

    # honest outcome: the established peer and a newcomer are served ...
    await honest_ping(honest, target)
    assert await raw_ping(channel, Identity.generate(), target.peer_id) == OK
    # ... and the captured message is still refused (dropping entries let no replay through)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await channel.unary_unary(PING)(captured.SerializeToString(), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_sender_over_its_rate_limit_fills_no_replay_cache_entry() -> None:
    target = await DHTNode.create(
        DHTConfig(
            run_id=RUN,
            auth_max_nonces=CACHE,
            rate_limits=RateLimits(per_source_rate=0.5, per_source_burst=20),
        )
    )
    assert target.address is not None
    honest = await DHTNode.create(DHTConfig(run_id=RUN, initial_peers=[target.address]))
    channel = grpc.aio.insecure_channel(target.address)
    try:
        await honest_ping(honest, target)  # control
        held = len(target.authenticator)
        flooder = Identity.generate()
        codes: list[Any] = []
        for _ in range(4):
            codes += await asyncio.gather(
                *(raw_ping(channel, flooder, target.peer_id) for _batch in range(50))
            )
        admitted = codes.count(OK)
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 200 - admitted >= 150
        # only the admitted requests hold a nonce: the refused ones were never remembered
        assert len(target.authenticator) <= held + admitted
        await honest_ping(honest, target)
    finally:
        await channel.close()
        await honest.shutdown()
        await target.shutdown()
