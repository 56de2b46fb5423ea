"""Maintenance in a stable swarm stays cheap; a neighbourhood in doubt is looked up in full.

A full lookup of our own id in every 30 s maintenance round cost each node about
k RPCs (and served as many), which was most of a 1000-node swarm's CPU and brought nothing
new while nobody joined.
"""

from __future__ import annotations

import pytest

from swarmavg.dht.node import rejoin_probability
from tests.dht.swarm import swarm

pytestmark = pytest.mark.timeout(60)


async def test_stable_swarm_round_costs_only_the_rejoin() -> None:
    async with swarm(16) as s:  # k = 20: every node can hold every other one
        node = s.nodes[-1]
        await node.maintain_once()  # settle: the join's last answers are in
        before = node.protocol.rpcs_sent
        await node.maintain_once()
        assert node.protocol.rpcs_sent - before == 2  # ping + find at the initial peer


async def test_unknown_neighbour_from_the_rejoin_triggers_a_full_lookup() -> None:
    async with swarm(16) as s:
        node = s.nodes[-1]
        await node.maintain_once()
        forgotten = [c for c in node.routing if c.address not in node.config.initial_peers][:3]
        for contact in forgotten:
            assert node.routing.remove(contact.peer_id)
        before = node.protocol.rpcs_sent
        await node.maintain_once()
        assert node.protocol.rpcs_sent - before > 2
        for contact in forgotten:
            assert contact.peer_id in node.routing  # relearned from its own answer


def test_the_rejoin_chance_keeps_the_swarms_rejoins_per_round_constant() -> None:
    assert rejoin_probability(1, 32) == 1.0
    assert rejoin_probability(0, 32) == 1.0  # a node that knows nobody rejoins
    assert rejoin_probability(32, 32) == 1.0
    assert rejoin_probability(64, 32) == 0.5
    assert rejoin_probability(10_000, 32) * 10_000 == pytest.approx(32)


async def _served_by_the_seed_in_one_round(rejoins_per_round: int) -> tuple[int, int]:
    """(requests the common initial peer served, nodes that ran maintenance) in one round
    of a 48-node swarm that all joined through it, as a public run does."""
    async with swarm(1, rejoins_per_round=rejoins_per_round) as s:
        seed = s.nodes[0]
        assert seed.address is not None
        others = await s.add(47, initial_peers=[seed.address])
        for node in others:
            await node.maintain_once()  # settle: the join's last answers are in
        before = seed.protocol.rpcs_received
        for node in others:
            await node.maintain_once()
        return seed.protocol.rpcs_received - before, len(others)


async def test_an_initial_peer_serves_a_bounded_number_of_rejoins_per_round() -> None:
    """Every node rejoined through the common initial peer in
    every round, 2 requests per node per round on one node. Now the swarm sends it about
    ``rejoins_per_round`` rejoins per round; a swarm no larger than that still sends all."""
    everyone, nodes = await _served_by_the_seed_in_one_round(rejoins_per_round=10_000)
    assert everyone >= 2 * nodes  # each node's ping and Find (the previous behaviour)
    bounded, _ = await _served_by_the_seed_in_one_round(rejoins_per_round=4)
    # About 4 rejoins (2 requests each) plus the lookups they may start; 47 would be 94.
    assert bounded <= 32
