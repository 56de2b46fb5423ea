"""A leader that claims every honest peer is in a group that closed (leader capture).

The attacker is the peer that ranks first under the round's key (leadership goes by a
hash of the key and the peer id; ``test_leader_rank.py``), so every honest peer asks it
to lead first. Such a leader answered
``JOIN_REJECT_FULL`` with a ``taken`` list naming every honest peer; each honest peer
believed the list, found nobody left to average with and failed at once with
``NoGroupError`` (all three in under a second; the control formed one group of 3). Now
only a peer's own word counts: the one that answers FULL is taken, the others it names
are asked in turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.result import AveragingResult
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import RUN_ID, averager_swarm, ranked
from tests.averaging.matchmaking.test_bounded_leaders import (
    hostile_declaration,
    hostile_server,
    inputs,
    sign,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("attack", "itself"),
    [(False, False), (True, False), (True, True)],
    ids=["control", "false-taken-list", "false-list-with-itself"],
)
async def test_a_leaders_taken_list_does_not_end_the_others_rounds(
    attack: bool, itself: bool
) -> None:
    async with averager_swarm(4) as swarm:
        attacker, *honest = ranked(swarm.peers, "k")  # every honest peer asks it first
        key = matchmaking_key(RUN_ID, "k", honest[0].averager.group_bits)
        asked: list[bytes] = []

        async def join(
            request: averaging_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[averaging_pb2.JoinResponse]:
            asked.append(bytes(request.header.peer_id))
            yield averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_REJECT_FULL,
                leader_id=attacker.peer_id,
                taken=sorted(p.peer_id for p in [*honest, *([attacker] if itself else [])]),
                detail="the group under that key already formed",
            )

        async with hostile_server(join) as address:
            if attack:
                declaration = hostile_declaration(attacker, address, time.time() - 590)
                await sign(attacker, key, declaration)
            else:
                await attacker.stop()  # the control: the same swarm without it
            results = await asyncio.gather(
                *(p.averager.average(inputs(), "k", timeout=15) for p in honest),
                return_exceptions=True,
            )
        if attack:
            assert asked, "the hostile leader was never asked: the test proves nothing"
        ok = [r for r in results if isinstance(r, AveragingResult)]
        assert len(ok) == len(honest), results
        assert {r.group_size for r in ok} == {len(honest)}
        assert len({r.group_id for r in ok}) == 1
