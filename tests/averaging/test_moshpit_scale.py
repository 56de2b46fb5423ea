"""A Moshpit grid of 64 real peers (8 x 8): the exact global mean after two rounds.

Every peer is a DHT node, an Averager with its own gRPC server and data plane, all in one
process (tests/averaging/averager_swarm.py). benchmarks/scale.py runs the same at 256 peers
in groups of 16, in several processes.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.matchmaking.matchmaker import MatchmakerConfig
from tests.averaging.averager_swarm import averager_swarm, fast_config

GROUP = 8
PEERS = GROUP * GROUP
ELEMENTS = 64


def contribution(p: int) -> np.ndarray:
    """``p + (i mod 7)``: every partial mean of the grid is exact in float32."""
    return (p + np.arange(ELEMENTS) % 7).astype(np.float32)


@pytest.mark.slow  # 64 peers on one event loop: it loads the machine
@pytest.mark.timeout(240)
async def test_grid_of_64_in_groups_of_8_gives_every_peer_the_exact_global_mean() -> None:
    async with averager_swarm(0) as swarm:
        for p in range(PEERS):
            config = fast_config(
                group_bits=format(p // GROUP, "03b"),
                # 64 peers share one loop on two busy cores: generous windows, so that a
                # slow read is not taken for an absent peer (this test is about the grid)
                matchmaking_time=60.0,
                matchmaker=MatchmakerConfig(poll_interval=1.0, dht_timeout=10.0, join_timeout=10.0),
                allreduce=AllReduceConfig(min_stall=30.0),
            )
            await swarm.add(config)
        values = [contribution(p) for p in range(PEERS)]
        groups_of_round = []
        for r in range(2):
            results = await asyncio.gather(
                *(
                    peer.averager.average(
                        [values[p]], f"r{r}", group_size=GROUP, min_group_size=GROUP, timeout=150
                    )
                    for p, peer in enumerate(swarm.peers)
                )
            )
            assert {res.group_size for res in results} == {GROUP}
            assert not any(res.partial for res in results)
            groups_of_round.append([set(res.peers) for res in results])
            values = [res.tensors[0] for res in results]
            if r == 0:  # the control: one round mixes only within a row of the grid
                assert len({v.tobytes() for v in values}) == GROUP
        for first, second in zip(*groups_of_round, strict=True):
            assert len(first & second) == 1  # only itself: round 1 took one peer per row
        expected = ((PEERS - 1) / 2 + np.arange(ELEMENTS) % 7).astype(np.float32)
        for v in values:
            np.testing.assert_array_equal(v, expected)
