"""A leader that declares after its follower calls it: the follower joins at once.

Leadership goes by a hash rank, so the peer that finishes the previous round first often
ranks after one that comes later. It reads the declarations, finds only itself, and
leads alone; without the leader's call it would meet the leader only at a later read of
the declarations. Here every read of the follower after its first is held (a DHT that
answers its reads late, seen through a narrow seam around the real node), so only the
call can bring it to the leader: it joins while its read is held, and the group forms
once the read (which the follower needs to check the group's members) is let through.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.matchmaking.matchmaker import MatchmakerConfig, MatchmakingEvent
from swarmavg.dht import DHTNode
from tests.averaging.averager_swarm import averager_swarm, fast_config, name_where_first

# The leader's close window is long: it closes when the follower is in, not by a deadline.
CONFIG = fast_config(
    matchmaking_time=20.0,
    matchmaker=MatchmakerConfig(poll_interval=0.3, retry_after=0.3, expect_run_members=False),
)


class ReadsHeldAfterTheFirst:
    """The real DHT node, except that each read after the first waits for ``release``."""

    def __init__(self, node: DHTNode) -> None:
        self._node = node
        self.reads = 0
        self.second = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        if self.reads > 1:
            self.second.set()
            await self.release.wait()
        return await self._node.get(*args, **kwargs)


@pytest.mark.timeout(120)
async def test_a_follower_that_declared_first_joins_its_leader_when_called() -> None:
    async with averager_swarm(2, CONFIG) as swarm:
        leader, follower = swarm.peers
        name = name_where_first(leader.peer_id, [follower.peer_id])
        matchmaker = follower.averager._require()[0]
        held = ReadsHeldAfterTheFirst(matchmaker.dht)  # type: ignore[arg-type]
        matchmaker.dht = held  # type: ignore[assignment]

        def joined(peer: Any, event: MatchmakingEvent, other: bytes) -> bool:
            return any(e == event and p == other for e, _, p in peer.events)

        calls = [
            asyncio.ensure_future(
                follower.averager.average([np.ones(4, np.float32)], name, timeout=60)
            )
        ]
        try:
            # The follower has read the declarations once (only its own) and leads alone.
            async with asyncio.timeout(30):
                await held.second.wait()
            calls.append(
                asyncio.ensure_future(
                    leader.averager.average([np.full(4, 3.0, np.float32)], name, timeout=60)
                )
            )
            # Its next read is held: only the leader's call brings it there.
            await swarm.wait_for(
                lambda: joined(leader, MatchmakingEvent.FOLLOWER_ACCEPTED, follower.peer_id),
                timeout=30,
            )
            assert held.reads == 2  # the first, and the held one
        finally:
            held.release.set()
            results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            assert not isinstance(result, BaseException), result
            assert result.group_size == 2
            np.testing.assert_array_equal(result.tensors[0], np.full(4, 2.0, np.float32))
