"""A member that leaves during matchmaking never blocks the group.

Faults: the peer's server is stopped (every stream it serves is aborted) and its round is
cancelled (its own outbound streams are dropped), the in-process equivalent of a killed
process; the multi-process SIGKILL version lives in benchmarks/matchmaking.py.
"""

from __future__ import annotations

import asyncio
import enum

import numpy as np
import pytest

from swarmavg.averaging.matchmaking.matchmaker import MatchmakingEvent
from swarmavg.averaging.result import AveragingResult
from tests.averaging.averager_swarm import Peer, averager_swarm


class Victim(enum.Enum):
    FOLLOWER = "follower"
    LEADER = "leader"


def accepted_pairs(peers: list[Peer]) -> list[tuple[Peer, bytes]]:
    """(leader, follower id) for every follower accepted so far."""
    return [
        (p, other)
        for p in peers
        for event, _, other in p.events
        if event is MatchmakingEvent.FOLLOWER_ACCEPTED
    ]


@pytest.mark.parametrize("victim", list(Victim))
@pytest.mark.timeout(60)
async def test_member_dying_in_matchmaking_never_blocks_the_group(victim: Victim) -> None:
    async with averager_swarm(4) as swarm:
        peers = list(swarm.peers)
        values = {p.peer_id: float(10 * (i + 1)) for i, p in enumerate(peers)}
        tasks = {
            p.peer_id: asyncio.ensure_future(
                # group_size 5 > 4 peers: the leader waits for its deadline, so the fault
                # lands while the group is still open.
                p.averager.average(
                    [np.full(6, values[p.peer_id], np.float32)],
                    "k",
                    group_size=5,
                    min_group_size=3,
                    timeout=12.0,
                )
            )
            for p in peers
        }
        await swarm.wait_for(lambda: len(accepted_pairs(peers)) > 0)
        leader, follower_id = accepted_pairs(peers)[0]
        dead = (
            leader
            if victim is Victim.LEADER
            else next(p for p in peers if p.peer_id == follower_id)
        )
        await dead.stop()
        survivors = [p for p in peers if p is not dead]
        results = await asyncio.gather(
            *(tasks[p.peer_id] for p in survivors), return_exceptions=True
        )
        tasks[dead.peer_id].cancel()
        await asyncio.gather(tasks[dead.peer_id], return_exceptions=True)
        assert all(isinstance(r, AveragingResult) for r in results), results
        ok = [r for r in results if isinstance(r, AveragingResult)]
        assert {r.group_id for r in ok} == {ok[0].group_id}
        assert sorted(ok[0].peers) == sorted(p.peer_id.hex() for p in survivors)
        expected = np.mean([values[p.peer_id] for p in survivors])
        for r in ok:
            assert not r.partial
            np.testing.assert_array_equal(r.tensors[0], np.full(6, expected, np.float32))
