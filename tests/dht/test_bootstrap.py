"""Bootstrap: a clear error when nobody answers, retries, new DHTs, and swarms that re-merge."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from swarmavg.dht import BootstrapError, DHTConfig, DHTNode, Identity
from swarmavg.dht.protocol import DHTRPCError
from tests.dht.swarm import swarm

pytestmark = pytest.mark.timeout(60)


def dead_address() -> str:
    """A loopback port that nobody listens on (bound by the OS, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


async def test_no_initial_peers_starts_a_new_dht() -> None:
    node = await DHTNode.create(DHTConfig(run_id="t"))
    try:
        assert node.num_known_peers() == 0
        assert await node.store("k", 1, time.time() + 10)
        found = await node.get("k")
        assert found is not None
        assert found.value == 1
    finally:
        await node.shutdown()


async def test_bootstrap_error_lists_every_address() -> None:
    dead = [dead_address(), dead_address(), "127.0.0.1:1"]
    config = DHTConfig(
        run_id="t",
        initial_peers=dead,
        bootstrap_timeout=1.0,
        bootstrap_backoff=0.1,
        request_timeout=0.5,
    )
    with pytest.raises(BootstrapError) as info:
        await DHTNode.create(config)
    assert info.value.attempts >= 2  # it retried before giving up
    assert set(info.value.failures) == set(dead)
    message = str(info.value)
    for address in dead:
        assert address in message
    assert "nothing listens there (connection refused)" in message  # not gRPC's wording


async def test_bootstrap_reports_wrong_run_without_naming_it() -> None:
    """The answer says that the run differs, never which run the node serves: the run id is
    a public run's only gate, and a prober must not learn it from an error."""
    other = await DHTNode.create(DHTConfig(run_id="secret-run"))
    try:
        assert other.address is not None
        config = DHTConfig(run_id="probe", initial_peers=[other.address], bootstrap_timeout=0.3)
        with pytest.raises(BootstrapError, match="run id differs") as info:
            await DHTNode.create(config)
        assert "secret-run" not in str(info.value)
    finally:
        await other.shutdown()


async def test_one_live_initial_peer_is_enough() -> None:
    live = await DHTNode.create(DHTConfig(run_id="t"))
    try:
        assert live.address is not None
        config = DHTConfig(run_id="t", initial_peers=[dead_address(), live.address])
        node = await DHTNode.create(config)
        try:
            assert live.peer_id in node.routing
            assert node.peer_id in live.routing
        finally:
            await node.shutdown()
    finally:
        await live.shutdown()


async def test_own_address_as_only_initial_peer_is_a_new_dht() -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    node = DHTNode(DHTConfig(run_id="t", initial_peers=[address]))
    node.add_to_server(server)
    await server.start()
    try:
        await node.start(address)
        assert node.num_known_peers() == 0
    finally:
        await node.shutdown()
        await server.stop(None)


@pytest.mark.parametrize(
    ("old_group", "rejoins_per_round"),
    [(8, 32), (24, 2)],
    ids=["everyone-rejoins", "a-few-rejoin-per-round"],
)
async def test_swarm_split_by_a_restarted_bootstrap_node_merges_again(
    old_group: int, rejoins_per_round: int
) -> None:
    """learning-at-home/hivemind#624: everyone joins through one bootstrap node; it
    restarts empty and newcomers join it. Without care that makes two DHTs. Here the first
    group re-pings its initial peer in maintenance, the groups learn of each other and
    records flow both ways. In a swarm larger than ``rejoins_per_round`` only about that
    many of its nodes rejoin per round: the merge still happens."""
    k = 4
    identity = Identity.generate()
    async with swarm(0, k=k, refresh_interval=3600.0, rejoins_per_round=rejoins_per_round) as s:
        (seed,) = await s.add(1, identity=identity, initial_peers=[])
        assert seed.address is not None
        seed_address = seed.address
        group_a = await s.add(old_group, initial_peers=[seed_address])
        now = time.time()
        for i in range(10):
            assert await group_a[i % old_group].store(f"a-{i}", i, now + 120)
        await s.stop(seed)
        for node in group_a:  # while it is down, group A notices: failed pings drop it
            for _ in range(node.config.stale_after):
                with pytest.raises(DHTRPCError):
                    await node.protocol.call_ping(seed_address, expected_id=identity.peer_id)
            assert identity.peer_id not in node.routing
        # the bootstrap node restarts on the same address, empty, and a second group joins it
        (reborn,) = await s.add(1, identity=identity, initial_peers=[], listen=seed_address)
        assert reborn.num_known_peers() == 0
        group_b = await s.add(8, initial_peers=[seed_address])
        for i in range(10):
            assert await group_b[i % 8].store(f"b-{i}", i, now + 120)
        a_ids = {n.peer_id for n in group_a}
        assert not a_ids & {c.peer_id for n in group_b for c in n.routing}  # split for now

        # maintenance rounds: re-ping initial peers, refresh, republish. Kademlia converges
        # over a few rounds; without the re-ping it never would (the groups know nothing of
        # each other)
        rounds, merged = 0, False
        while not merged and rounds < 10:
            rounds += 1
            for node in s.nodes:
                await node.maintain_once(refresh_all=True, republish_all=True)
            merged = await all_found(s.nodes, [f"{g}-{i}" for g in "ab" for i in range(10)])
        assert merged, f"groups did not merge in {rounds} maintenance rounds"
        for node in group_b:
            assert a_ids & {c.peer_id for c in node.routing}


async def all_found(readers: list[DHTNode], keys: list[str]) -> bool:
    for reader in readers:
        if any(found is None for found in await reader.get_many(keys)):
            return False
    return True
