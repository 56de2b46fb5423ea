"""Quotas and rate limits per source, over real gRPC with in-process nodes.

Each attack comes from one identity sending hand-made requests; an honest source must still
get its records stored and its requests answered. The module imports only names that predate
the quotas, so that the same tests show the attacks succeeding on older code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from swarmavg.averaging.group import Mode
from swarmavg.averaging.matchmaking.declarations import Declaration, declaration_subkey
from swarmavg.averaging.protocol_keys import protocol_key_classes
from swarmavg.dht import DHTConfig, DHTLimits, DHTNode, Identity
from swarmavg.dht.auth import RequestSigner
from swarmavg.dht.ids import key_id
from swarmavg.dht.records import pack, pack_subkey, signing_payload
from swarmavg.dht.storage import FULL, STORED
from swarmavg.proto import dht_pb2

pytestmark = pytest.mark.timeout(120)

RUN = "test"
MATCHMAKING_KEY = f"{RUN}.step.0b"


class Sender:
    """One identity sending raw DHT requests to one node (client mode: no address)."""

    def __init__(self, node: DHTNode) -> None:
        assert node.address is not None
        self.identity = Identity.generate()
        self.signer = RequestSigner(self.identity, RUN, lambda: "")
        self.receiver = node.peer_id
        self.channel = grpc.aio.insecure_channel(node.address)

    async def call(self, method: str, message: dht_pb2.PingRequest | dht_pb2.StoreRequest) -> bytes:
        self.signer.signed(message, self.receiver, f"/swarmavg.v1.DHT/{method}")
        data: bytes = await self.channel.unary_unary(f"/swarmavg.v1.DHT/{method}")(
            message.SerializeToString(), timeout=10
        )
        return data

    async def store(self, records: list[dht_pb2.Record]) -> list[int]:
        data = await self.call("Store", dht_pb2.StoreRequest(records=records))
        return list(dht_pb2.StoreResponse.FromString(data).statuses)

    async def close(self) -> None:
        await self.channel.close()


def declaration(owner: Identity, ttl: float = 60.0) -> dht_pb2.Record:
    """A valid, owner-signed matchmaking declaration under ``MATCHMAKING_KEY``."""
    now = time.time()
    value = Declaration(
        peer_id=owner.peer_id,
        address="127.0.0.1:1",
        start=now,
        deadline=now + 1,
        give_up=now + ttl,
        mode=Mode.NODE,
        bandwidth=100.0,
        schema_hash=bytes(32),
        group_size=16,
    ).encode()
    key, subkey, packed = (
        MATCHMAKING_KEY.encode(),
        pack_subkey(declaration_subkey(owner.peer_id)),
        pack(value),
    )
    expiration, issued = now + ttl, now
    signature = owner.sign(signing_payload(RUN, key, subkey, packed, expiration, issued))
    return dht_pb2.Record(
        key=key,
        subkey=subkey,
        value=packed,
        expiration=expiration,
        public_key=owner.public_key,
        signature=signature,
        issued=issued,
    )


@pytest.fixture
async def node() -> AsyncIterator[DHTNode]:
    node = await DHTNode.create(
        DHTConfig(
            run_id=RUN,
            key_classes=protocol_key_classes(RUN),
            limits=DHTLimits(max_stored_bytes=2 * 1024 * 1024),
        )
    )
    try:
        yield node
    finally:
        await node.shutdown()


async def honest_client(node: DHTNode) -> DHTNode:
    """A client-mode node that stores only on ``node`` (and never on itself)."""
    assert node.address is not None
    return await DHTNode.create(
        DHTConfig(run_id=RUN, client_mode=True, initial_peers=[node.address])
    )


async def test_subkey_flooding_leaves_room_for_honest_declarations(node: DHTNode) -> None:
    """One identity stores 4096 declarations (each signed by a throwaway owner) under one
    matchmaking key, which would fill the key's 4096 subkeys; an honest one still stores."""
    assert node.address is not None
    flooder = Sender(node)
    honest = await honest_client(node)
    try:
        owners = [Identity.generate() for _ in range(node.config.limits.max_subkeys_per_key)]
        statuses: list[int] = []
        for start in range(0, len(owners), 256):
            statuses += await flooder.store([declaration(o) for o in owners[start : start + 256]])
        assert FULL in statuses  # the flooder hit its quota of subkeys under this key
        held = len(node.storage.get(key_id(MATCHMAKING_KEY.encode())))
        assert held <= node.config.storage_quotas.max_subkeys_per_source
        stored = await honest.store(
            MATCHMAKING_KEY,
            Declaration(
                peer_id=honest.peer_id,
                address="127.0.0.1:2",
                start=time.time(),
                deadline=time.time() + 1,
                give_up=time.time() + 60,
                mode=Mode.NODE,
                bandwidth=1.0,
                schema_hash=bytes(32),
                group_size=16,
            ).encode(),
            time.time() + 60,
            subkey=declaration_subkey(honest.peer_id),
        )
        assert stored
        subkeys = {r.subkey for r in node.storage.get(key_id(MATCHMAKING_KEY.encode()))}
        assert pack_subkey(declaration_subkey(honest.peer_id)) in subkeys
    finally:
        await honest.shutdown()
        await flooder.close()


async def test_one_source_cannot_fill_the_node(node: DHTNode) -> None:
    """A source storing 48 KiB values until refused stops at its share (an eighth of the
    node's 2 MiB); other sources still store."""
    assert node.address is not None
    flooder = Sender(node)
    honest = await honest_client(node)
    try:
        payload = "x" * (48 * 1024)
        for i in range(64):  # 3 MiB in all: more than the whole node holds
            record = dht_pb2.Record(
                key=f"junk-{i}".encode(), value=pack(payload), expiration=time.time() + 600
            )
            (status,) = await flooder.store([record])
            if status == FULL:
                break
        assert status == FULL
        assert node.storage.bytes_used < node.config.limits.max_stored_bytes // 2
        for i in range(4):  # another source still stores
            assert await honest.store(f"honest-{i}", payload, time.time() + 600)
        assert node.storage.get(key_id(b"honest-3"))
    finally:
        await honest.shutdown()
        await flooder.close()


async def test_a_seven_day_ttl_under_a_protocol_key_is_refused(node: DHTNode) -> None:
    assert node.address is not None
    sender = Sender(node)
    try:
        week = declaration(Identity.generate(), ttl=7 * 24 * 3600.0 - 60)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await sender.store([week])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "live at most" in (info.value.details() or "")
        assert node.storage.get(key_id(MATCHMAKING_KEY.encode())) == []
        # within the cap the same kind of record stores
        assert await sender.store([declaration(Identity.generate(), ttl=1800.0)]) == [STORED]
    finally:
        await sender.close()


async def test_a_request_flood_gets_resource_exhausted_and_others_are_served() -> None:
    from swarmavg.dht.ratelimit import RateLimits  # new with the limits

    node = await DHTNode.create(
        DHTConfig(run_id=RUN, rate_limits=RateLimits(per_source_rate=0.5, per_source_burst=20))
    )
    assert node.address is not None
    flooder, other = Sender(node), Sender(node)
    try:
        results = await asyncio.gather(
            *(flooder.call("Ping", dht_pb2.PingRequest()) for _ in range(60)),
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(refused) >= 30
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert "too many requests from peer" in (refused[0].details() or "")
        assert node.protocol.rate_limiter.refused == len(refused)
        # another source is unaffected
        answer = dht_pb2.PingResponse.FromString(await other.call("Ping", dht_pb2.PingRequest()))
        assert answer.header.peer_id == node.peer_id
    finally:
        await flooder.close()
        await other.close()
        await node.shutdown()
