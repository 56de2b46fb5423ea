"""How many Find requests a store or a read sends, and how many at once (dht/traversal.py).

Matchmaking stores one declaration and reads one key per peer and round, so every request
a lookup sends without need is paid by every peer of every round. Real nodes in one process
on loopback; the counts come from each node's own ``rpcs_sent``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from swarmavg.dht import DHTNode
from swarmavg.dht.ids import id_to_int, key_id
from tests.dht.swarm import Swarm, swarm

pytestmark = pytest.mark.timeout(90)

SMALL = 8  # fewer nodes than a bucket holds (k = 20): every table can know everyone
REPLICAS = 5


async def know_everyone(s: Swarm) -> None:
    """Make every routing table complete (a lookup of each node's own id fills it)."""
    for node in s.nodes:
        await node.find_nearest(node.peer_id)
    assert all(len(node.routing) == len(s.nodes) - 1 for node in s.nodes)


def nearest_to(s: Swarm, key: str, count: int) -> list[DHTNode]:
    target = id_to_int(key_id(key.encode()))
    return sorted(s.nodes, key=lambda n: id_to_int(n.peer_id) ^ target)[:count]


def key_where(s: Swarm, writer: DHTNode, among: bool) -> str:
    """A key whose ``REPLICAS`` nearest nodes include ``writer`` (or do not)."""
    for i in range(10_000):
        key = f"key-{i}"
        if (writer in nearest_to(s, key, REPLICAS)) is among:
            return key
    raise AssertionError("no such key among 10,000")


def holders(s: Swarm, key: str) -> set[bytes]:
    kid = key_id(key.encode())
    return {n.peer_id for n in s.nodes if n.storage.get(kid, time.time())}


def most_at_once(node: DHTNode) -> Callable[[], int]:
    """Count the Find requests ``node`` has in flight; return a reader of the maximum."""
    plain = node.protocol.call_find
    state = {"now": 0, "most": 0}

    async def counting(*args: Any, **kwargs: Any) -> Any:
        state["now"] += 1
        state["most"] = max(state["most"], state["now"])
        try:
            return await plain(*args, **kwargs)
        finally:
            state["now"] -= 1

    node.protocol.call_find = counting  # type: ignore[method-assign]
    return lambda: state["most"]


async def test_a_store_that_keeps_a_replica_itself_asks_one_node_fewer() -> None:
    """The writer among the key's nearest nodes keeps a replica and asks ``replicas - 1``
    others; a writer outside them asks ``replicas``. Either way the record lands on
    exactly the nearest nodes."""
    async with swarm(SMALL, seed=3) as s:
        await know_everyone(s)
        writer = s.nodes[0]
        for among, expected in ((True, REPLICAS - 1), (False, REPLICAS)):
            key = key_where(s, writer, among)
            before = writer.protocol.rpcs_sent
            assert await writer.store(key, 1, time.time() + 60, replicas=REPLICAS)
            assert writer.protocol.rpcs_sent - before == expected, among
            assert holders(s, key) == {n.peer_id for n in nearest_to(s, key, REPLICAS)}


async def test_a_client_mode_writer_keeps_no_replica_and_asks_them_all() -> None:
    async with swarm(SMALL, seed=4) as s:
        (client,) = await s.add(1, client_mode=True)
        servers = [n for n in s.nodes if n is not client]
        for node in servers:
            await node.find_nearest(node.peer_id)
        await client.find_nearest(client.peer_id)
        key = "from-a-client"
        before = client.protocol.rpcs_sent
        assert await client.store(key, 1, time.time() + 60, replicas=REPLICAS)
        assert client.protocol.rpcs_sent - before == REPLICAS
        target = id_to_int(key_id(key.encode()))
        nearest = sorted(servers, key=lambda n: id_to_int(n.peer_id) ^ target)[:REPLICAS]
        assert holders(s, key) == {n.peer_id for n in nearest}


async def test_a_read_with_a_quorum_asks_only_the_quorum_when_the_nearest_hold_the_key() -> None:
    """Once holders answer, a read asks no more nodes than its quorum still needs: with
    the key on the 5 nearest, every read of quorum 3 sends exactly 3 requests."""
    async with swarm(SMALL, seed=5) as s:
        await know_everyone(s)
        now = time.time()
        for i, writer in enumerate(s.nodes[:4]):
            assert await writer.store(
                "decl", i, now + 60, subkey=writer.identity.peer_id_hex, replicas=REPLICAS
            )
        for reader in s.nodes:
            before = reader.protocol.rpcs_sent
            found = await reader.get("decl", latest=True, quorum=3)
            assert reader.protocol.rpcs_sent - before == 3
            assert found is not None
            assert set(found.value) == {w.identity.peer_id_hex for w in s.nodes[:4]}


async def test_a_read_whose_nearest_lack_the_key_asks_further() -> None:
    """The quorum cap applies among holders only: nodes that answer without the key make
    room for further requests, so a read still gathers its quorum from farther nodes."""
    async with swarm(SMALL, seed=6) as s:
        await know_everyone(s)
        key = "far"
        far = nearest_to(s, key, SMALL)[-3:]  # only the three farthest nodes hold it
        now = time.time()
        record = far[0]._make_record((key, 7, now + 60, None), now)
        for node in far:
            node.storage.put(record, now)
        reader = nearest_to(s, key, 1)[0]
        found = await reader.get(key, latest=True, quorum=3)
        assert found is not None
        assert found.value == 7
        assert reader.protocol.rpcs_sent > 3


async def test_a_store_in_a_small_swarm_asks_every_replica_at_once() -> None:
    """Fewer nodes than a bucket: the store's requests all leave before any answer (one
    round trip); in a larger swarm at most ``alpha`` are in flight, as the paper has it."""
    async with swarm(SMALL, seed=7) as s:
        await know_everyone(s)
        writer = s.nodes[0]
        key = key_where(s, writer, among=False)
        most = most_at_once(writer)
        assert await writer.store(key, 1, time.time() + 60, replicas=REPLICAS)
        assert most() == REPLICAS
    async with swarm(SMALL, seed=7, k=4) as s:  # tables of more than k contacts
        await s.nodes[0].find_nearest(s.nodes[0].peer_id)
        writer = s.nodes[0]
        assert len(writer.routing) >= 4
        most = most_at_once(writer)
        assert await writer.store("wide", 1, time.time() + 60, replicas=4)
        assert most() <= writer.config.alpha
