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


def assert_one_group_of_two(results: list[Any]) -> None:
    """Both calls came back from one group of 2 with the mean of 1 and 3."""
    for result in results:
        assert not isinstance(result, BaseException), result
        assert result.group_size == 2
        np.testing.assert_array_equal(result.tensors[0], np.full(4, 2.0, np.float32))


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
        assert_one_group_of_two(results)


class ReadBackMissesAndReadsHeld:
    """The real DHT node; once ``hold`` is set, the read that comes with a store sees
    nothing (a store made at the same moment elsewhere is missed) and every read waits
    for ``release``."""

    def __init__(self, node: DHTNode) -> None:
        self._node = node
        self.hold = False
        self.held = 0
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    async def store_and_get(self, *args: Any, **kwargs: Any) -> Any:
        stored, record = await self._node.store_and_get(*args, **kwargs)
        return stored, None if self.hold else record

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        if self.hold:
            self.held += 1
            await self.release.wait()
        return await self._node.get(*args, **kwargs)


# A patience (2 poll intervals and the settle time) past the test's waits: the leader's
# probe of a declarer that has not come (``_lonely_probe``) would also bring it.
PATIENT = fast_config(
    matchmaking_time=20.0,
    matchmaker=MatchmakerConfig(poll_interval=30.0, retry_after=0.3, expect_run_members=False),
)


@pytest.mark.timeout(120)
async def test_a_steady_state_follower_asks_the_rosters_leader_before_reading() -> None:
    async with averager_swarm(2, PATIENT) as swarm:
        leader, follower = swarm.peers
        name = name_where_first(leader.peer_id, [follower.peer_id])  # family "k"
        matchmaker = follower.averager._require()[0]
        dht = ReadBackMissesAndReadsHeld(matchmaker.dht)  # type: ignore[arg-type]
        matchmaker.dht = dht  # type: ignore[assignment]
        # The family's first round: each knows the other afterwards (its roster).
        first = await asyncio.gather(
            *(
                p.averager.average([np.ones(4, np.float32)], "k999999", timeout=60)
                for p in swarm.peers
            )
        )
        assert [r.group_size for r in first] == [2, 2]
        dht.hold = True
        calls = [
            asyncio.ensure_future(
                leader.averager.average([np.full(4, 3.0, np.float32)], name, timeout=60)
            )
        ]
        try:
            await swarm.wait_for(
                lambda: any(
                    e == MatchmakingEvent.DECLARED and k.endswith(f".{name}.0b")
                    for e, k, _ in leader.events
                ),
                timeout=30,
            )
            calls.append(
                asyncio.ensure_future(
                    follower.averager.average([np.ones(4, np.float32)], name, timeout=60)
                )
            )
            # The follower's read-back missed the leader and its reads are held: only
            # the roster's leader, asked before any read, brings it there.
            await swarm.wait_for(
                lambda: any(
                    e == MatchmakingEvent.FOLLOWER_ACCEPTED and k.endswith(f".{name}.0b")
                    for e, k, _ in leader.events
                ),
                timeout=30,
            )
        finally:
            dht.release.set()
            results = await asyncio.gather(*calls, return_exceptions=True)
        assert_one_group_of_two(results)
