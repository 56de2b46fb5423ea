"""Maintenance in a stable swarm stays cheap; a neighbourhood in doubt is looked up in full.

Issue 21: a full lookup of our own id in every 30 s maintenance round cost each node about
k RPCs (and served as many), which was most of a 1000-node swarm's CPU and brought nothing
new while nobody joined.
"""

from __future__ import annotations

import pytest

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
