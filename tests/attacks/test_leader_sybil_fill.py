"""One address range cannot fill a group with its identities (sybils).

Identities are free: a leader could form its group of itself, each honest follower and
any number of its own identities, and a stranger could fill an honest leader's group with
its identities and push honest peers out. A group now holds at most
``max_members_per_range(group_size)`` members from one public address range (a /24):
followers refuse a formed group over it (by the addresses its members signed), and a
leader takes no follower over it (by the signed address and the request's source).

Loopback and private addresses are exempt (every test swarm runs on 127.0.0.1), so the
sybils here sign addresses in 100.64.7.0/24: shared (carrier-grade NAT) address space,
which counts as a public range (it is not a private network an outsider cannot reach)
and is routed nowhere on the internet. Signing an address needs no socket there, and it
is what a follower checks and what a leader counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from swarmavg.averaging.group import Mode, schema_hash
from swarmavg.averaging.matchmaking.group_ranges import (
    admits,
    crowded_range,
    max_members_per_range,
)
from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.matchmaking.matchmaker import MatchmakingEvent
from swarmavg.averaging.stubs import JOIN_GROUP, join_group_method
from swarmavg.dht import RequestSigner
from swarmavg.proto import averaging_pb2
from tests.attacks.leader_scenarios import (
    SYBIL_NET,
    sign_sybils,
    stage,
    sybil_address,
    sybil_join,
)
from tests.averaging.averager_swarm import RUN_ID, averager_swarm, name_where_first
from tests.averaging.matchmaking.test_bounded_leaders import (
    assert_honest_group,
    hostile_declaration,
    hostile_server,
    inputs,
    sign,
)

pytestmark = pytest.mark.timeout(120)


def test_the_bound_per_range() -> None:
    assert [max_members_per_range(n) for n in (1, 4, 8, 9, 16, 64)] == [2, 2, 2, 3, 4, 16]
    public = [{"100.64.7.0/24"}] * 3
    assert crowded_range(public, 8) == ("100.64.7.0/24", 3)
    assert crowded_range(public[:2], 8) is None
    assert crowded_range(public, 16) is None  # 4 of 16 may share a range
    # Local addresses are exempt (None), and one member counts once per range.
    assert crowded_range([[None]] * 10, 4) is None
    assert crowded_range([["a/24", "a/24"]] * 2, 4) is None
    assert admits([{"a/24"}, {"a/24"}], {"a/24"}, 8) == "a/24"
    assert admits([{"a/24"}], {"a/24", "b/24"}, 8) is None
    assert admits([{"a/24"}, {"a/24"}], {None}, 8) is None


@pytest.mark.parametrize("attack", [False, True], ids=["control", "sybil-group"])
async def test_followers_refuse_a_group_filled_from_one_range(attack: bool) -> None:
    async with averager_swarm(7) as swarm:
        attacker, *rest = swarm.peers
        honest, sybils = rest[:3], rest[3:]
        bits = honest[0].averager.group_bits
        name = name_where_first(attacker.peer_id, [p.peer_id for p in honest], bits, "f")
        key = matchmaking_key(RUN_ID, name, bits)
        asked: list[bytes] = []
        box: list[str] = []

        async with hostile_server(sybil_join(attacker, box, sybils, asked)) as address:
            box.append(address)
            await stage(attack, attacker, address, key)
            if attack:
                await sign_sybils(sybils, key)
            # The honest leader waits for the run's other averagers (the attacker and the
            # sybils, who never call) until just before it would give up, at about half the
            # timeout: that wait is the test's length, not what it checks.
            results = await asyncio.gather(
                *(
                    p.averager.average(inputs(), name, group_size=8, min_group_size=2, timeout=10)
                    for p in honest
                ),
                return_exceptions=True,
            )
        if attack:
            assert asked, "the hostile leader was never asked: the test proves nothing"
        assert_honest_group(list(results), honest)


async def test_a_leader_takes_no_more_followers_from_one_range() -> None:
    async with averager_swarm(4) as swarm:
        leader, *sybils = swarm.peers
        bits = leader.averager.group_bits
        name = name_where_first(leader.peer_id, [s.peer_id for s in sybils], bits, "g")
        key = matchmaking_key(RUN_ID, name, leader.averager.group_bits)
        round_ = asyncio.ensure_future(
            leader.averager.average(inputs(), name, group_size=8, timeout=20)
        )
        await swarm.wait_for(lambda: any(e[0] is MatchmakingEvent.DECLARED for e in leader.events))
        calls = []
        codes = []
        try:
            for i, sybil in enumerate(sybils):
                address, start = sybil_address(i), time.time()
                await sign(sybil, key, hostile_declaration(sybil, address, start))
                request = averaging_pb2.JoinRequest(
                    key=key,
                    schema_hash=schema_hash(inputs()),
                    mode=int(Mode.NODE),
                    bandwidth=1.0,
                    declared_start=start,
                )
                RequestSigner(sybil.node.identity, RUN_ID, lambda a=address: a).signed(
                    request, leader.peer_id, JOIN_GROUP
                )
                call = join_group_method(sybil.channels.channel(leader.address))(
                    request, timeout=15
                )
                calls.append(call)
                answer = await call.read()
                codes.append((answer.code, answer.detail))
        finally:
            for call in calls:
                call.cancel()
            round_.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await round_
        bound = max_members_per_range(8)
        assert [c for c, _ in codes[:bound]] == [averaging_pb2.JOIN_ACCEPTED] * bound, codes
        assert codes[bound][0] == averaging_pb2.JOIN_REJECT_FULL, codes
        assert f"{SYBIL_NET}.0/24" in codes[bound][1]
