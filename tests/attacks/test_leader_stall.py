"""A leader that accepts every follower and never closes does not cost them their call.

The attacker ranks first under the round's key, so every honest peer asks it to lead
first; its ``JoinGroup`` answers ``JOIN_ACCEPTED`` and then holds the stream open. Its
followers used to wait on the stream until their give-up time and fail with
``NoGroupError``, every one of them. Now a follower leaves a leader that has not closed
by the round's close deadline plus a grace, shuns it under the key family, and the
honest peers form one group in the same call (the control: the same swarm without the
attacker forms one group of all).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.result import AveragingResult
from tests.attacks.leader_scenarios import silent_join, stage
from tests.averaging.averager_swarm import RUN_ID, averager_swarm, name_where_first
from tests.averaging.matchmaking.test_bounded_leaders import hostile_server, inputs

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 24.0
"""Each honest call's timeout: matchmaking gives up after half of it (12 s)."""


@pytest.mark.parametrize("attack", [False, True], ids=["control", "silent-leader"])
async def test_a_leader_that_never_closes_does_not_hold_its_followers(attack: bool) -> None:
    async with averager_swarm(4) as swarm:
        attacker, *honest = swarm.peers
        bits = honest[0].averager.group_bits
        name = name_where_first(attacker.peer_id, [p.peer_id for p in honest], bits, "s")
        # A first round of the family among the honest peers: the attack round is then a
        # steady-state one, whose leaders close by matchmaking_time (a family's first
        # round may wait for the run's averagers up to the whole matchmaking budget).
        warm = await asyncio.gather(
            *(p.averager.average(inputs(), "s", group_size=3, timeout=TIMEOUT) for p in honest)
        )
        assert len({r.group_id for r in warm}) == 1
        key = matchmaking_key(RUN_ID, name, bits)
        accepted: list[bytes] = []

        async with hostile_server(silent_join(attacker, accepted)) as address:
            await stage(attack, attacker, address, key)
            started = time.monotonic()
            results = await asyncio.gather(
                *(p.averager.average(inputs(), name, timeout=TIMEOUT) for p in honest),
                return_exceptions=True,
            )
            took = time.monotonic() - started
        ok = [r for r in results if isinstance(r, AveragingResult)]
        assert len(ok) == len(honest), (results, took)
        assert {r.group_size for r in ok} == {len(honest)}
        assert len({r.group_id for r in ok}) == 1
        np.testing.assert_array_equal(ok[0].tensors[0], inputs()[0])
        if attack:
            assert set(accepted) >= {p.peer_id for p in honest}, "not every peer followed it"
            family = matchmaking_key(RUN_ID, "s", bits)
            for peer in honest:
                assert attacker.peer_id in peer.averager.matchmaker.shunned_in(family)
