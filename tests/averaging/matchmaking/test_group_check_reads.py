"""A follower's failed reads of the declarations do not make it refuse its group.

A follower checks the leader's member list against the declarations it reads; one that
has not seen a member yet reads again. At 256 peers the DHT was so busy that these reads
missed their deadlines, and after 3 failed reads whole groups' followers refused their
group (its leader's declaration had been stored 40 s before), failed their round and
left the others with partial results. Here one follower never sees the leader's
declaration before it joins (it reaches the leader through a redirect), and its first
3 reads after joining hang past their deadlines (a DHT too busy to answer, seen through
a narrow seam around the real node); the 4th read shows the leader, and the group of 3
averages exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from swarmavg.averaging import Averager
from swarmavg.averaging.matchmaking.declarations import decode_declaration, leader_order
from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.matchmaking.matchmaker import MatchmakerConfig, MatchmakingEvent
from swarmavg.dht import ChannelPool, DHTConfig, DHTNode
from swarmavg.dht.records import ValueWithExpiration
from tests.averaging.averager_swarm import RUN_ID, fast_config

STALLED_READS = 3


def ordered_name(ids: list[bytes]) -> str:
    """A round name under whose key the peers rank in the order of ``ids``."""
    for i in range(100_000):
        key = matchmaking_key(RUN_ID, f"k{i}", "")
        ranks = [leader_order(key, peer_id) for peer_id in ids]
        if ranks == sorted(ranks):
            return f"k{i}"
    raise AssertionError("no such name in 100,000 tries")


class LeaderHiddenThenSlow:
    """The real DHT node, except for its reads: while its peer is not following anyone
    they omit ``hidden``'s declaration; once it follows, the next reads hang (until the
    caller's deadline cancels them), and the ones after go straight through."""

    def __init__(self, node: DHTNode, following: Callable[[], bool]) -> None:
        self._node = node
        self._following = following
        self.hidden = b""
        self.stalled = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    async def get(self, key: str, latest: bool = False, quorum: int | None = None) -> Any:
        if self._following():
            if self.stalled < STALLED_READS:
                self.stalled += 1
                await asyncio.Event().wait()  # cancelled by the caller's deadline
            return await self._node.get(key, latest=latest, quorum=quorum)
        record = await self._node.get(key, latest=latest, quorum=quorum)
        if record is None or not isinstance(record.value, dict):
            return record
        kept = {}
        for subkey, value in record.value.items():
            declaration = decode_declaration(subkey, value.value)
            if declaration is None or declaration.peer_id != self.hidden:
                kept[subkey] = value
        return ValueWithExpiration(kept, record.expiration)


@pytest.mark.timeout(90)
async def test_a_follower_whose_reads_fail_still_takes_its_group() -> None:
    started: list[tuple[grpc.aio.Server, Averager, DHTNode, ChannelPool]] = []
    events: list[list[MatchmakingEvent]] = [[], [], []]
    changed = asyncio.Event()
    try:
        dhts: list[Any] = []
        for i in range(3):
            channels = ChannelPool()
            initial = [started[0][2].address or ""] if started else []
            node = DHTNode(DHTConfig(run_id=RUN_ID, initial_peers=initial), channels=channels)
            server = grpc.aio.server()
            node.add_to_server(server)

            def observe(event: MatchmakingEvent, key: str, other: bytes, i: int = i) -> None:
                events[i].append(event)
                changed.set()

            dht: Any = node
            if i == 2:  # the follower
                dht = LeaderHiddenThenSlow(
                    node, lambda: MatchmakingEvent.JOINED_LEADER in events[2]
                )
            config = fast_config(
                matchmaking_time=20.0,
                matchmaker=MatchmakerConfig(poll_interval=0.3, retry_after=0.3, dht_timeout=0.5),
            )
            averager = Averager(dht, config, channels, observer=observe)
            averager.add_to_server(server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await node.start(f"127.0.0.1:{port}")
            await averager.start()
            started.append((server, averager, node, channels))
            dhts.append(dht)
        dhts[2].hidden = started[0][2].peer_id

        async def wait_for(i: int, event: MatchmakingEvent) -> None:
            async with asyncio.timeout(30):
                while event not in events[i]:
                    changed.clear()
                    await changed.wait()

        # Leadership goes by rank under the round's key: a name under which the leader
        # ranks first, the middle peer second and the follower last.
        ids = [node.peer_id for _, _, node, _ in started]
        name = ordered_name(ids)

        def average(i: int) -> asyncio.Future[Any]:
            return asyncio.ensure_future(
                started[i][1].average(
                    [np.full(4, float(i), np.float32)],
                    name,
                    group_size=3,
                    min_group_size=3,
                    timeout=40,
                )
            )

        # The leader declares first; the middle peer follows it; the follower, blind to
        # the leader, asks the middle peer and is redirected to the leader.
        rounds = [average(0)]
        await wait_for(0, MatchmakingEvent.DECLARED)
        rounds.append(average(1))
        await wait_for(1, MatchmakingEvent.JOINED_LEADER)
        rounds.append(average(2))
        results = await asyncio.gather(*rounds)
        assert dhts[2].stalled == STALLED_READS  # every read of the check but the last hung
        for res in results:
            assert res.group_size == 3
            assert not res.partial
            np.testing.assert_array_equal(res.tensors[0], np.full(4, 1.0, np.float32))
    finally:
        for server, averager, node, channels in started:
            await server.stop(None)
            await averager.shutdown(grace=0.0)
            await node.shutdown()
            await channels.close()
