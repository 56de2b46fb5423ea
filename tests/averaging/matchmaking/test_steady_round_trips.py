"""A steady state's round has no DHT operation on its path.

From a family's second round on, when its roster (the peers of the last round there)
fits one group, every peer stores its declaration beside its search, a follower's signed
``JoinGroup`` request repeats its declaration, the leader closes when the roster is in,
and the formed group's signed answer carries the members' signed requests: matchmaking
is the ``JoinGroup`` round trip. Shown here by making every DHT store and read of the
second round hang (a seam around the real nodes): the round still forms one group of
everyone, exact, and no follower read the declarations (the group's answer carried what
its check needs). Before, the store came first, the leader took a follower only once a
read showed its declaration, and a follower checked the group against its reads: no group
formed while the DHT hung.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.result import AveragingResult
from tests.averaging.averager_swarm import Peer, averager_swarm, fast_config, ranked

pytestmark = pytest.mark.timeout(90)

DHT_CALLS = ("get", "store", "store_and_get")


def hang_dht(peer: Peer, hung: list[tuple[bytes, str]], touched: asyncio.Event) -> None:
    """Every later DHT store and read of ``peer`` hangs until cancelled (its deadline);
    each is noted in ``hung`` as (peer id, operation), and ``touched`` is set."""
    never = asyncio.Event()

    def hanging(name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            hung.append((peer.peer_id, name))
            touched.set()
            await never.wait()

        return call

    for name in DHT_CALLS:
        setattr(peer.node, name, hanging(name))


def restore_dht(peer: Peer) -> None:
    for name in DHT_CALLS:
        peer.node.__dict__.pop(name, None)  # the class's methods are back


async def test_a_steady_round_forms_its_group_while_the_dht_hangs() -> None:
    async with averager_swarm(3, fast_config(matchmaking_time=5.0)) as swarm:
        hung: list[tuple[bytes, str]] = []
        touched = asyncio.Event()

        async def leader_stores(leader: Peer) -> None:
            # Its round is open from the moment it stores its declaration (beside its
            # search, in a steady round): a follower that asked earlier would read.
            async with asyncio.timeout(20):
                while not any(p == leader.peer_id and name != "get" for p, name in hung):
                    touched.clear()
                    await touched.wait()

        async def round_of_everyone(key: str, steady: bool) -> list[AveragingResult]:
            order = ranked(swarm.peers, key)

            def call(i: int) -> asyncio.Task[AveragingResult]:
                vector = [np.full(8, float(i), np.float32)]
                return asyncio.ensure_future(order[i].averager.average(vector, key, timeout=20))

            leading = call(0)
            if steady:  # the leader first: its round is open when the followers' requests come
                ready = asyncio.ensure_future(leader_stores(order[0]))
                try:
                    await asyncio.wait({leading, ready}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ready.cancel()
            return list(await asyncio.gather(leading, *(call(i) for i in range(1, len(order)))))

        await round_of_everyone("step-0", steady=False)  # the family's first: makes the roster
        for peer in swarm.peers:
            hang_dht(peer, hung, touched)
        try:
            results = await round_of_everyone("step-1", steady=True)
        finally:
            for peer in swarm.peers:
                restore_dht(peer)
        assert hung, "no DHT operation was made: the seam proves nothing"
        assert len({r.group_id for r in results}) == 1
        assert {r.group_size for r in results} == {3}
        for r in results:
            assert not r.partial
            np.testing.assert_allclose(r.tensors[0], np.full(8, 1.0, np.float32))
        followers = [r for r in results if r.timings["matchmaking.led"] == 0.0]
        assert len(followers) == 2
        assert [r.timings["matchmaking.reads"] for r in followers] == [0.0, 0.0]
