"""The read a declaration's store makes (``store_and_get``) standing for the round's first
read of the declarations: when it may (a steady swarm's last declarer) and when it may not
(first rounds, a group size the swarm fills). Real DHT nodes and gRPC, one process."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.matchmaking.matchmaker import MatchmakingEvent
from swarmavg.averaging.result import AveragingResult
from tests.averaging.averager_swarm import AveragerSwarm, Peer, averager_swarm, ranked

pytestmark = pytest.mark.timeout(90)


def inputs(i: int) -> list[np.ndarray]:
    return [np.full(16, float(i), dtype=np.float32)]


def count_reads(peer: Peer) -> list[str]:
    """The keys ``peer`` reads from now on (its node's ``get``)."""
    reads: list[str] = []
    plain = peer.node.get

    async def counting(key: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(key)
        return await plain(key, *args, **kwargs)

    peer.node.get = counting  # type: ignore[method-assign]
    return reads


async def last_declarer_round(
    swarm: AveragerSwarm, key: str, **kwargs: Any
) -> tuple[list[AveragingResult], list[str]]:
    """Every peer averages under ``key``; the last one calls once the others declared.
    Returns the results and the keys the last peer read.

    The last caller is the one that ranks last under ``key``: a newcomer that ranks first
    leads, and a leader reads the declarations again for the askers it expects."""
    *early, last = ranked(swarm.peers, key)

    def declared(peer: Peer) -> bool:
        return any(e is MatchmakingEvent.DECLARED and key in k for e, k, _ in peer.events)

    first = [
        asyncio.ensure_future(p.averager.average(inputs(i), key, timeout=60.0, **kwargs))
        for i, p in enumerate(early)
    ]
    await swarm.wait_for(lambda: all(declared(p) for p in early))
    reads = count_reads(last)
    try:
        mine = await last.averager.average(inputs(len(early)), key, timeout=60.0, **kwargs)
        results = [*await asyncio.gather(*first), mine]
    finally:
        del last.node.get  # the instance attribute goes; the class's method is back
    return results, [k for k in reads if key in k]


def one_group_of_everyone(swarm: AveragerSwarm, results: list[AveragingResult]) -> None:
    assert {r.group_id for r in results} == {results[0].group_id}
    assert sorted(results[0].peers) == sorted(p.peer_id.hex() for p in swarm.peers)
    expected = np.mean([inputs(i)[0] for i in range(len(swarm.peers))], axis=0)
    for r in results:
        assert not r.partial
        np.testing.assert_allclose(r.tensors[0], expected)


async def test_the_last_declarer_of_a_steady_swarm_joins_on_its_stores_read() -> None:
    async with averager_swarm(3) as swarm:
        results, reads = await last_declarer_round(swarm, "step-0")
        one_group_of_everyone(swarm, results)
        assert reads, "a first round reads after its store"
        results, reads = await last_declarer_round(swarm, "step-1")
        one_group_of_everyone(swarm, results)
        assert reads == [], "its store's read saw everyone: no second lookup"


async def test_a_group_size_the_swarm_fills_keeps_one_group() -> None:
    """With the group size given as the swarm's count, one declaration missed by the
    store's read could split the swarm: that read never stands, and a first round reads
    again. A steady round asks the roster's leader beside its store (nobody computes a
    split from a partial read there) and is one group of everyone as well."""
    async with averager_swarm(3) as swarm:
        for step in range(2):
            results, reads = await last_declarer_round(swarm, f"full-{step}", group_size=3)
            one_group_of_everyone(swarm, results)
            if step == 0:
                assert reads


async def test_a_member_of_the_last_round_missing_from_the_stores_read_makes_it_read() -> None:
    """A previous member that has not declared yet (here: it is not averaging at all) is
    missing from the store's read, which then does not stand. The last declarer asked the
    roster's leader beside its store (a steady state: its request carries its signed
    declaration, the group's answer carries the others'), so it needs no read unless that
    join fails; the two others average together either way."""
    async with averager_swarm(3) as swarm:
        results, _ = await last_declarer_round(swarm, "gap-0")
        one_group_of_everyone(swarm, results)
        absent = swarm.peers[0]
        swarm.peers.remove(absent)
        try:
            results, _ = await last_declarer_round(swarm, "gap-1", min_group_size=2)
        finally:
            swarm.peers.insert(0, absent)
        assert {r.group_id for r in results} == {results[0].group_id}
        assert len(results[0].peers) == 2
