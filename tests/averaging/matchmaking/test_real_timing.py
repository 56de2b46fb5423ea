"""One swarm under real timing: peers that start apart and call at their own pace form
one group in every round (the default configuration: no group size given).

The harness (``timing_harness``) draws every start offset, compute time and DHT delay
from a seed, so a schedule that splits the swarm can be replayed. Before the family
rosters, such schedules split 4-6 peers into 2 + 3 or stranded one with ``NoGroupError``
in most seeds, in the first round (the first caller closed with whoever had called) and
in later ones (each half of a split expected only its own members).
"""

from __future__ import annotations

import pytest

from tests.averaging.averager_swarm import averager_swarm, fast_config
from tests.averaging.timing_harness import Timing, run_unsynchronised

# The window bounds how far apart calls may start and still meet (``matchmaking_time``).
WINDOW = fast_config(matchmaking_time=4.0)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.timeout(240)
async def test_unsynchronised_peers_form_one_group_every_round(seed: int) -> None:
    n = 5
    async with averager_swarm(n, WINDOW) as swarm:
        timing = Timing(seed=seed, start_spread=1.5, compute=0.8, dht_delay=0.05)
        # 12 rounds: the first, where calls start apart, and enough later ones (each with
        # fresh compute times) for the split of a later round to show; two seeds.
        outcome = await run_unsynchronised(swarm, timing, rounds=12)
    assert outcome.problems(n) == []


@pytest.mark.timeout(240)
async def test_first_round_waits_for_the_runs_averagers() -> None:
    # Peers whose first calls lie seconds apart, within the window: the first caller
    # knows the others from their presence entries and waits for them.
    n = 4
    async with averager_swarm(n, WINDOW) as swarm:
        timing = Timing(seed=7, start_spread=2.5, compute=0.0, dht_delay=0.02)
        outcome = await run_unsynchronised(swarm, timing, rounds=2)
    assert outcome.problems(n) == []
