"""A member that declares the earliest start the window accepts does not lead every round.

Leadership once went to the earliest declared start, a value the declarer writes itself:
a real averager whose declarations claim ``start = now - 590`` led every round of the
swarm (and, as leader, could stall or fill it: ``test_leader_stall.py``,
``test_leader_sybil_fill.py``). Now a hash of the round key and the peer id ranks the
declarers: the same attacker leads exactly the rounds whose key ranks it first, about one
in n, while every round still forms one group of all.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.matchmaking.declarations import leader_order
from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.result import AveragingResult
from tests.attacks.leader_scenarios import claim_early_starts
from tests.averaging.averager_swarm import RUN_ID, Peer, averager_swarm, name_where_first

pytestmark = pytest.mark.timeout(120)


def first_ranked(peers: list[Peer], name: str) -> Peer:
    def order(peer: Peer) -> tuple[bytes, bytes]:
        return leader_order(matchmaking_key(RUN_ID, name, peer.averager.group_bits), peer.peer_id)

    return min(peers, key=order)


def closes(peer: Peer) -> int:
    return sum(peer.averager.matchmaker.closes.values())


def leader_order_spread(ids: list[bytes], keys: int) -> list[int]:
    """How many of ``keys`` round keys each of ``ids`` ranks first under."""
    led = dict.fromkeys(ids, 0)
    for k in range(keys):
        led[min(ids, key=lambda p: leader_order(f"run.step-{k}.0b", p))] += 1
    return [led[p] for p in ids]


def test_each_identity_leads_about_its_share_of_round_keys() -> None:
    ids = [bytes([j]) * 20 for j in range(10)]
    spread = leader_order_spread(ids, 2000)
    # 200 expected each; a binomial's 5 standard deviations (about 67) either side.
    assert all(130 <= n <= 270 for n in spread), spread


async def test_an_early_start_claim_leads_only_the_rounds_its_rank_gives_it() -> None:
    async with averager_swarm(5) as swarm:
        attacker, *honest = swarm.peers
        claim_early_starts(attacker)
        bits = attacker.averager.group_bits
        # One round key that ranks the attacker first, three that rank an honest peer
        # first: the attacker's share here is one round in four, not every round.
        mine = name_where_first(attacker.peer_id, [p.peer_id for p in honest], bits, "r")
        names = [mine]
        for peer in honest[:3]:
            others = [p.peer_id for p in swarm.peers if p is not peer]
            names.append(name_where_first(peer.peer_id, others, bits, "r"))
        rng = random.Random(7)
        led = 0
        for name in names:
            before = {p.peer_id: closes(p) for p in swarm.peers}
            # Calls at seeded random offsets, as trainers that finish their steps apart.
            offsets = [rng.uniform(0.0, 0.5) for _ in swarm.peers]

            async def call(i: int, peer: Peer, offset: float, name: str = name) -> Any:
                await asyncio.sleep(offset)
                return await peer.averager.average(
                    [np.full(8, i, np.float32)], name, group_size=5, timeout=30
                )

            results = await asyncio.gather(
                *(call(i, p, o) for i, (p, o) in enumerate(zip(swarm.peers, offsets, strict=True))),
                return_exceptions=True,
            )
            ok = [r for r in results if isinstance(r, AveragingResult)]
            assert len(ok) == 5, results
            assert len({r.group_id for r in ok}) == 1  # one group of all, every round
            leaders = [p for p in swarm.peers if closes(p) > before[p.peer_id]]
            assert leaders == [first_ranked(swarm.peers, name)], name
            led += leaders[0] is attacker
        assert led == 1  # its share, where the earliest start led all four
