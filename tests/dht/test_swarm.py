"""A 50-node swarm in one process: store/get, dictionaries, churn, client mode, lookups."""

from __future__ import annotations

import time

import pytest

from swarmavg.dht import DHTNode, Identity
from swarmavg.dht.ids import id_to_int, key_id
from tests.dht.swarm import swarm

pytestmark = pytest.mark.timeout(90)

N = 50
K = 8  # smaller than the default 20 so that 50 nodes need real multi-hop routing


async def test_store_and_get_through_random_nodes() -> None:
    async with swarm(N, k=K) as s:
        now = time.time()
        for i in range(60):
            writer, reader = s.rng.sample(s.nodes, 2)
            assert await writer.store(f"key-{i}", {"i": i, "blob": b"x" * i}, now + 60)
            found = await reader.get(f"key-{i}")
            assert found is not None
            assert found.value == {"i": i, "blob": b"x" * i}
            assert found.expiration == pytest.approx(now + 60)
        assert await s.nodes[0].get("never-stored") is None
        hops = [h for node in s.nodes for h in node.lookup_hops]
        assert hops
        assert max(hops) >= 1


async def test_later_expiration_wins_across_the_swarm() -> None:
    async with swarm(N, k=K) as s:
        now = time.time()
        a, b, c, reader = s.rng.sample(s.nodes, 4)
        assert await a.store("k", "first", now + 30)
        assert await b.store("k", "second", now + 60)
        assert not await c.store("k", "stale", now + 10)  # every holder has a later one
        found = await reader.get("k", latest=True)
        assert found is not None
        assert found.value == "second"
        assert not await a.store("gone", 1, now - 1)
        assert await reader.get("gone") is None


async def test_dictionary_values_merge_subkeys_from_many_writers() -> None:
    async with swarm(N, k=K) as s:
        now = time.time()
        writers = s.rng.sample(s.nodes, 12)
        for i, writer in enumerate(writers):
            assert await writer.store(
                "group", {"rank": i}, now + 60, subkey=writer.identity.peer_id_hex
            )
        # a later store of one subkey replaces only that subkey
        assert await writers[0].store(
            "group", {"rank": 99}, now + 90, subkey=writers[0].identity.peer_id_hex
        )
        reader = s.rng.choice(s.nodes)
        found = await reader.get("group", latest=True)
        assert found is not None
        assert set(found.value) == {w.identity.peer_id_hex for w in writers}
        assert found.value[writers[0].identity.peer_id_hex].value == {"rank": 99}
        assert found.value[writers[1].identity.peer_id_hex].value == {"rank": 1}
        assert found.expiration == pytest.approx(now + 90)


async def test_a_read_with_a_quorum_stops_at_the_nearest_holders() -> None:
    """``get(key, latest=True, quorum=q)``: a dictionary every writer stored on the k
    nearest nodes, read back whole from the first q holders (the nearest are asked
    first), with fewer requests than asking all k nearest."""
    async with swarm(N, k=K) as s:
        now = time.time()
        writers = s.rng.sample(s.nodes, 10)
        for i, writer in enumerate(writers):
            assert await writer.store(
                "group", {"rank": i}, now + 60, subkey=writer.identity.peer_id_hex
            )
        expected = {w.identity.peer_id_hex for w in writers}
        for reader in s.rng.sample([n for n in s.nodes if n not in writers], 5):
            before = reader.protocol.rpcs_sent
            everything = await reader.get("group", latest=True)
            asked_all = reader.protocol.rpcs_sent - before
            before = reader.protocol.rpcs_sent
            nearest = await reader.get("group", latest=True, quorum=3)
            asked_few = reader.protocol.rpcs_sent - before
            assert everything is not None
            assert nearest is not None
            assert set(everything.value) == expected
            assert set(nearest.value) == expected
            assert asked_few < asked_all
        with pytest.raises(ValueError, match="quorum"):
            await reader.get("group", quorum=0)


async def test_a_store_on_fewer_replicas_reaches_the_nearest_with_fewer_requests() -> None:
    """``store(..., replicas=r)``: the record lands on the r nodes nearest to the key (a
    read of the nearest holders finds it) with fewer requests than the k replicas."""
    async with swarm(N, k=K) as s:
        now = time.time()
        writer, reader = s.rng.sample(s.nodes, 2)
        before = writer.protocol.rpcs_sent
        assert await writer.store("wide", 1, now + 60)
        to_all = writer.protocol.rpcs_sent - before
        before = writer.protocol.rpcs_sent
        assert await writer.store("narrow", 2, now + 60, replicas=3)
        to_few = writer.protocol.rpcs_sent - before
        assert to_few < to_all
        target = id_to_int(key_id(b"narrow"))
        by_distance = sorted(s.nodes, key=lambda n: id_to_int(n.peer_id) ^ target)
        nearest = {n.peer_id for n in by_distance[:3]}
        holders = {n.peer_id for n in s.nodes if n.storage.get(key_id(b"narrow"), time.time())}
        # Every one of the 3 nearest holds it. A node asked on the way whose own table
        # knows fewer than 3 nodes nearer than itself keeps a copy too (it answers the Find
        # before it learns better): 2-4 stores in 160 carried one such copy, which once
        # failed this test in CI as ==.
        assert nearest <= holders
        assert len(holders) < K
        found = await reader.get("narrow", latest=True, quorum=2)
        assert found is not None
        assert found.value == 2
        with pytest.raises(ValueError, match="replicas"):
            await writer.store("none", 3, now + 60, replicas=0)


async def test_find_nearest_matches_brute_force() -> None:
    async with swarm(N, k=K) as s:
        ids = [n.peer_id for n in s.nodes]
        for _ in range(10):
            asker = s.rng.choice(s.nodes)
            target = s.rng.randbytes(20)
            t = id_to_int(target)
            found = [c.peer_id for c in await asker.find_nearest(target, K)]
            brute = sorted((p for p in ids if p != asker.peer_id), key=lambda p: id_to_int(p) ^ t)
            assert found == brute[:K]
        estimate = s.nodes[0].size_estimate()
        assert N / 4 <= estimate <= N * 4


async def test_many_keys_share_one_traversal() -> None:
    async with swarm(N, k=K) as s:
        now = time.time()
        writer, reader = s.rng.sample(s.nodes, 2)
        keys = [f"batch-{i}" for i in range(30)]
        assert all(
            await writer.store_many([(key, i, now + 60, None) for i, key in enumerate(keys)])
        )
        before = reader.protocol.rpcs_sent
        found = await reader.get_many(keys)
        batched = reader.protocol.rpcs_sent - before
        assert [f.value if f else None for f in found] == list(range(30))
        other = s.rng.choice([n for n in s.nodes if n not in (writer, reader)])
        before = other.protocol.rpcs_sent
        for i, key in enumerate(keys):
            single = await other.get(key)
            assert single is not None
            assert single.value == i
        separate = other.protocol.rpcs_sent - before
        assert batched < separate


async def test_churn_records_survive_and_nodes_come_back() -> None:
    async with swarm(N, k=K) as s:
        now = time.time()
        for i in range(30):
            assert await s.rng.choice(s.nodes).store(f"churn-{i}", i, now + 120)
        leaving = s.rng.sample(s.nodes[1:], 15)  # 30% of the swarm
        identities = [node.identity for node in leaving]
        for node in leaving:
            await s.stop(node)
        for node in s.nodes:  # one maintenance round re-replicates onto live nodes
            await node.maintain_once(republish_all=True)
        for i in range(30):
            found = await s.rng.choice(s.nodes).get(f"churn-{i}")
            assert found is not None, f"churn-{i} lost"
            assert found.value == i
        # the stopped nodes come back (same identities, new ports) and see the records
        returned: list[DHTNode] = []
        for identity in identities:
            returned += await s.add(1, identity=identity)
        assert {n.peer_id for n in returned} == {i.peer_id for i in identities}
        for i in range(30):
            found = await s.rng.choice(returned).get(f"churn-{i}")
            assert found is not None
            assert found.value == i


async def test_client_mode_uses_the_dht_without_entering_tables() -> None:
    async with swarm(20, k=K) as s:
        client = await DHTNode.create(
            s.config(client_mode=True, initial_peers=[s.nodes[3].address])
        )
        try:
            assert client.address is None
            now = time.time()
            assert await client.store("from-client", [1, 2, 3], now + 60)
            found = await s.nodes[7].get("from-client")
            assert found is not None
            assert found.value == [1, 2, 3]
            assert await s.nodes[9].store("for-client", "hi", now + 60)
            got = await client.get("for-client")
            assert got is not None
            assert got.value == "hi"
            assert client.num_known_peers() > 0
            for node in s.nodes:
                assert client.peer_id not in node.routing
                assert node.storage.get(client.peer_id) == []
        finally:
            await client.shutdown()


async def test_owner_records_are_written_only_by_their_owner() -> None:
    async with swarm(20, k=K) as s:
        owner, other, reader = s.rng.sample(s.nodes, 3)
        now = time.time()
        key = "state" + f"[owner:{owner.identity.peer_id_hex}]"
        assert await owner.store(key, {"v": 1}, now + 60)
        with pytest.raises(ValueError, match="owned by"):
            await other.store(key, {"v": 2}, now + 90)
        sub = f"me[owner:{owner.identity.peer_id_hex}]"
        assert await owner.store("progress", 5, now + 60, subkey=sub)
        with pytest.raises(ValueError, match="owned by"):
            await other.store("progress", 6, now + 90, subkey=sub)
        found = await reader.get(key, latest=True)
        assert found is not None
        assert found.value == {"v": 1}
        assert Identity.generate().peer_id != owner.peer_id


async def test_store_and_get_stores_and_reads_the_dictionary_in_one_lookup() -> None:
    async with swarm(N, k=K) as s:
        now = time.time()
        writers = s.rng.sample(s.nodes, 6)
        for i, writer in enumerate(writers[:5]):
            assert await writer.store("decl", i, now + 60, subkey=writer.identity.peer_id_hex)
        last = writers[5]
        stored, found = await last.store_and_get(
            "decl", 5, now + 60, subkey=last.identity.peer_id_hex
        )
        assert stored
        assert found is not None
        # everyone's entry, ours included: the read went with the store
        assert {k: v.value for k, v in found.value.items()} == {
            w.identity.peer_id_hex: i for i, w in enumerate(writers)
        }
        # and the store itself landed: a plain reader elsewhere sees it
        again = await s.rng.choice(s.nodes).get("decl", latest=True)
        assert again is not None
        assert again.value[last.identity.peer_id_hex].value == 5


async def test_store_and_get_of_an_expired_record_stores_nothing_and_reads_the_rest() -> None:
    async with swarm(N, k=K) as s:
        now = time.time()
        a, b = s.rng.sample(s.nodes, 2)
        assert await a.store("d", "a", now + 60, subkey="a")
        stored, found = await b.store_and_get("d", "b", now - 1, subkey="b")
        assert not stored
        assert found is not None
        assert {k: v.value for k, v in found.value.items()} == {"a": "a"}
