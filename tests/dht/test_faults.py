"""Faults injected at the transport: peers that never answer or answer as someone else."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from swarmavg.dht import DHTConfig, DHTNode, Identity
from swarmavg.dht.ids import id_to_int, key_id
from swarmavg.dht.routing import Contact
from tests.dht.swarm import swarm

pytestmark = pytest.mark.timeout(60)


class Fault(enum.Enum):
    SILENT = "never answers (the per-request deadline must fire)"
    IMPOSTOR = "answers with a valid header of another peer"
    GARBAGE = "answers bytes that are no protobuf message"


class FaultyPeer:
    """A gRPC server posing as a DHT node that misbehaves in one way."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.identity = Identity.generate()
        self.calls = 0
        self._never = asyncio.Event()

    async def handle(self, request: bytes, context: Any) -> bytes:
        self.calls += 1
        if self.fault is Fault.SILENT:
            await self._never.wait()
        if self.fault is Fault.IMPOSTOR:
            from swarmavg.proto import dht_pb2

            other = Identity.generate().make_header("test", "")
            return dht_pb2.PingResponse(header=other).SerializeToString()
        return b"\xff\xff\xff\xff"

    def register(self, server: grpc.aio.Server) -> None:
        handlers = {
            m: grpc.unary_unary_rpc_method_handler(self.handle) for m in ("Ping", "Store", "Find")
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("swarmavg.v1.DHT", handlers),)
        )


def near(key: str, peer_id: bytes, bits: int = 8) -> bool:
    """Whether ``key``'s id shares its first ``bits`` bits with ``peer_id``."""
    shift = 160 - bits
    return id_to_int(key_id(key.encode())) >> shift == id_to_int(peer_id) >> shift


@pytest.fixture(params=list(Fault))
async def faulty(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FaultyPeer, str]]:
    peer = FaultyPeer(request.param)
    server = grpc.aio.server()
    peer.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield peer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_lookups_survive_a_misbehaving_peer(faulty: tuple[FaultyPeer, str]) -> None:
    peer, address = faulty
    async with swarm(12, k=4, request_timeout=0.3, stale_after=1) as s:
        bad = Contact(peer.identity.peer_id, address)
        # plant the faulty contact in every table, as if it had behaved well before
        for n in s.nodes:
            n.routing.add_or_update(Contact(bad.peer_id, address))
        # A table whose bucket for the (random) faulty id is full and cannot split keeps it
        # as a replacement only; the nodes nearest to that id have room for it.
        holders = [n for n in s.nodes if bad.peer_id in n.routing]
        assert holders
        node = holders[len(holders) // 2]
        # keys next to the faulty peer's id, so that every lookup wants to ask it
        keys = [k for k in (f"f-{i}" for i in range(20_000)) if near(k, bad.peer_id)][:5]
        now = time.time()
        for i, key in enumerate(keys):
            assert await node.store(key, i, now + 60)
        for i, key in enumerate(keys):
            found = await s.nodes[(i * 3) % 12].get(key)
            assert found is not None
            assert found.value == i
        assert peer.calls > 0  # it was really asked
        assert bad.peer_id not in node.routing  # and dropped after failing


async def test_bootstrap_through_a_misbehaving_peer_fails_clearly(
    faulty: tuple[FaultyPeer, str],
) -> None:
    _, address = faulty
    config = DHTConfig(
        run_id="test", initial_peers=[address], request_timeout=0.3, bootstrap_timeout=0.5
    )
    with pytest.raises(ConnectionError, match=address):
        await DHTNode.create(config)
