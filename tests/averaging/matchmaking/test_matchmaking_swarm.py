"""How groups form in the default configuration: no fixed wait, no split, no lost peer.

Many real peers in one process (real DHT, real gRPC). ``matchmaking_time`` is set far
above what any of these rounds needs, so a round that waited it out would show in the
leader's close reason (``deadline``) rather than in a clock reading.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from swarmavg.averaging.errors import NoGroupError
from swarmavg.averaging.matchmaking.config import MatchmakerConfig
from swarmavg.averaging.result import AveragingResult
from tests.averaging.averager_swarm import AveragerSwarm, averager_swarm, fast_config

SLOW_WINDOW = fast_config(matchmaking_time=40.0)


def inputs(i: int) -> list[np.ndarray]:
    return [np.full(64, float(i), dtype=np.float32)]


async def round_of(swarm: AveragerSwarm, key: str, **kwargs: object) -> list[AveragingResult]:
    results = await asyncio.gather(
        *(p.averager.average(inputs(i), key, **kwargs) for i, p in enumerate(swarm.peers)),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    ok = [r for r in results if isinstance(r, AveragingResult)]
    assert len(ok) == len(results), [repr(r) for r in results if not isinstance(r, AveragingResult)]
    return ok


def close_reasons(swarm: AveragerSwarm) -> dict[str, int]:
    total: dict[str, int] = {}
    for peer in swarm.peers:
        for reason, count in peer.averager.matchmaker.closes.items():
            total[reason] = total.get(reason, 0) + count
    return total


def groups_of(results: list[AveragingResult]) -> list[frozenset[str]]:
    """Distinct groups; every member of a group must report the same member list."""
    by_id: dict[str, frozenset[str]] = {}
    for r in results:
        members = frozenset(r.peers)
        assert by_id.setdefault(r.group_id, members) == members
    return sorted(by_id.values(), key=len)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.timeout(90)
async def test_default_group_size_closes_when_everyone_is_in(n: int) -> None:
    async with averager_swarm(n, SLOW_WINDOW) as swarm:
        for step in range(3):
            results = await round_of(swarm, f"step-{step}", timeout=90.0)
            assert [len(g) for g in groups_of(results)] == [n]
            expected = np.mean([inputs(i)[0] for i in range(n)], axis=0)
            for r in results:
                np.testing.assert_array_equal(r.tensors[0], expected)
        reasons = close_reasons(swarm)
        assert "deadline" not in reasons, reasons
        assert sum(reasons.values()) == 3
        # From the second round on, the previous members are the quorum.
        assert reasons.get("quorum", 0) >= 1, reasons


@pytest.mark.timeout(120)
async def test_one_more_peer_than_the_group_size_gives_balanced_groups() -> None:
    async with averager_swarm(5, SLOW_WINDOW) as swarm:
        for step in range(2):
            results = await round_of(swarm, f"r{step}", group_size=4, timeout=90.0)
            groups = groups_of(results)
            assert [len(g) for g in groups] == [2, 3], groups
            assert frozenset().union(*groups) == {p.peer_id.hex() for p in swarm.peers}
        # The caller's count (4) is more than either group of the split: neither leader
        # may wait out the window for it.
        reasons = close_reasons(swarm)
        assert "deadline" not in reasons, reasons


@pytest.mark.timeout(120)
async def test_groups_of_a_split_are_disjoint_and_cover_everyone() -> None:
    # Two leaders count overlapping peers while their views converge; no peer may end up
    # in both groups, and nobody is left out.
    async with averager_swarm(6, SLOW_WINDOW) as swarm:
        for step in range(3):
            results = await round_of(swarm, f"s{step}", group_size=3, timeout=90.0)
            groups = groups_of(results)
            assert [len(g) for g in groups] == [3, 3], groups
            assert not (groups[0] & groups[1])


@pytest.mark.timeout(90)
async def test_a_late_peer_learns_at_once_that_the_round_is_gone() -> None:
    async with averager_swarm(3, SLOW_WINDOW) as swarm:
        early, late = swarm.peers[:2], swarm.peers[2]
        results = await asyncio.gather(
            *(
                p.averager.average(inputs(i), "gone", group_size=2, timeout=60.0)
                for i, p in enumerate(early)
            )
        )
        assert [len(g) for g in groups_of(list(results))] == [2]
        with pytest.raises(NoGroupError, match="closed before this peer joined"):
            await late.averager.average(inputs(2), "gone", group_size=2, timeout=60.0)


@pytest.mark.timeout(120)
async def test_two_peers_left_out_of_a_closed_group_average_together() -> None:
    # The first two close a group of two; the other two then call under the same key.
    # Every declaration is still live, so the split the late two compute counts the
    # closed group's members until each of those says, in its own words, that it is
    # taken: the late two must find each other rather than lead a split apart, wait for
    # followers who averaged already, and both fail.
    async with averager_swarm(4, SLOW_WINDOW) as swarm:
        for step in range(3):
            key = f"left-{step}"
            first, late = swarm.peers[:2], swarm.peers[2:]
            early = await asyncio.gather(
                *(
                    p.averager.average(inputs(i), key, group_size=2, timeout=60.0)
                    for i, p in enumerate(first)
                )
            )
            assert [len(g) for g in groups_of(list(early))] == [2]
            results = await asyncio.gather(
                *(
                    p.averager.average(inputs(i), key, group_size=2, timeout=60.0)
                    for i, p in enumerate(late)
                ),
                return_exceptions=True,
            )
            assert all(isinstance(r, AveragingResult) for r in results), results
            assert groups_of(list(results)) == [frozenset(p.peer_id.hex() for p in late)]


@pytest.mark.timeout(120)
async def test_a_split_into_pairs_holds_when_calls_come_apart() -> None:
    # Four peers, groups of at most two, each call a little after the one before (as
    # training processes finish their steps): every round two pairs, nobody left out.
    # A peer whose usual pair had not declared yet when the other pair closed used to
    # fail at once, and its pair, a moment later, found nobody either.
    async with averager_swarm(4, SLOW_WINDOW) as swarm:

        async def call(i: int, key: str) -> AveragingResult:
            await asyncio.sleep(0.05 * i)  # the arrival order under test, not a readiness wait
            peer = swarm.peers[i]
            return await peer.averager.average(inputs(i), key, group_size=2, timeout=60.0)

        for step in range(6):
            results = await asyncio.gather(
                *(call(i, f"pairs-{step}") for i in range(4)), return_exceptions=True
            )
            assert all(isinstance(r, AveragingResult) for r in results), (step, results)
            assert [len(g) for g in groups_of(list(results))] == [2, 2], step


@pytest.mark.parametrize("third_stops", [False, True])
@pytest.mark.timeout(90)
async def test_the_last_of_two_late_peers_also_learns_that_the_round_is_gone(
    third_stops: bool,
) -> None:
    # Seen on the test bed: two peers late for the same round. The first learns that the
    # round closed without it and fails at once; its declaration lives on. The second
    # used to take that declaration for company: it asked the first to lead (refused: not
    # looking, or no answer once its daemon stopped) and then waited as a leader nobody
    # joins until its timeout ("only 1 peer(s) gathered"), 90 s on the test bed.
    async with averager_swarm(4, SLOW_WINDOW) as swarm:
        early, third, last = swarm.peers[:2], swarm.peers[2], swarm.peers[3]
        results = await asyncio.gather(
            *(
                p.averager.average(inputs(i), "gone", group_size=2, timeout=60.0)
                for i, p in enumerate(early)
            )
        )
        assert [len(g) for g in groups_of(list(results))] == [2]
        with pytest.raises(NoGroupError, match="closed before this peer joined"):
            await third.averager.average(inputs(2), "gone", timeout=60.0)
        if third_stops:
            await third.stop()  # its port refuses from now on: no answer at all
        # A timeout the old code waited out in full, with another message.
        with pytest.raises(NoGroupError, match="closed before this peer joined"):
            await last.averager.average(inputs(3), "gone", timeout=30.0)


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.timeout(90)
async def test_a_dead_previous_member_is_not_waited_for(given: bool) -> None:
    async with averager_swarm(3, SLOW_WINDOW) as swarm:
        options = {"group_size": 3} if given else {}
        results = await round_of(swarm, "step-1", timeout=60.0, **options)
        assert [len(g) for g in groups_of(results)] == [3]
        dead = swarm.peers.pop()
        await dead.stop()  # killed: its port now refuses connections
        before = close_reasons(swarm)
        # The survivors' fast quorum names the dead peer, and a given group size counted
        # it: the leader dials it, is refused, and closes without it instead of waiting
        # out the 40 s window.
        results = await round_of(swarm, "step-2", timeout=60.0, **options)
        assert [len(g) for g in groups_of(results)] == [2]
        after = close_reasons(swarm)
        assert after.get("deadline", 0) == before.get("deadline", 0), after
        swarm.peers.append(dead)  # stopped again (a no-op) on close


@pytest.mark.timeout(150)
async def test_moshpit_groups_expect_only_the_previous_members_that_share_their_next_key() -> None:
    # With group bits, a round's members move to different keys. A peer whose bits come
    # out unchanged must not expect the members that moved on: they never declare under
    # its key, are alive (so no probe drops them), and would hold its group until
    # matchmaking_time (rounds of 15 s with a window of 15 s before the fix).
    config = fast_config(matchmaking_time=40.0, group_bits="0", target_group_size=4)
    async with averager_swarm(6, config) as swarm:
        for step in range(4):
            results = await round_of(swarm, f"m{step}", timeout=90.0)
            assert len(results) == 6
            assert frozenset().union(*groups_of(results)) == {p.peer_id.hex() for p in swarm.peers}
        assert "deadline" not in close_reasons(swarm), close_reasons(swarm)


async def _rpcs_per_round(read_quorum: int, replicas: int, n: int, rounds: int) -> float:
    matchmaker = dataclasses.replace(
        SLOW_WINDOW.matchmaker, read_quorum=read_quorum, declaration_replicas=replicas
    )
    config = dataclasses.replace(SLOW_WINDOW, matchmaker=matchmaker)
    async with averager_swarm(n, config) as swarm:
        await round_of(swarm, "warm-0", timeout=60.0)
        before = sum(p.node.protocol.rpcs_sent for p in swarm.peers)
        for step in range(rounds):
            results = await round_of(swarm, f"step-{step}", timeout=60.0)
            assert [len(g) for g in groups_of(results)] == [n]
        return (sum(p.node.protocol.rpcs_sent for p in swarm.peers) - before) / rounds


@pytest.mark.timeout(120)
async def test_declarations_on_the_nearest_few_form_the_same_group_with_fewer_requests() -> None:
    """``MatchmakerConfig.declaration_replicas`` and ``read_quorum``: declarations are
    stored on the key's 5 nearest nodes and read from its 3 nearest holders. Eight peers
    still form one group of 8 every round, and send fewer DHT requests than when every
    declaration goes to all k nearest (k = 20 > 8: every node) and every read asks them
    all, as matchmaking did before."""
    nearest = await _rpcs_per_round(3, 5, 8, 3)
    everyone = await _rpcs_per_round(20, 20, 8, 3)
    assert nearest < 0.8 * everyone, (nearest, everyone)


def test_a_read_quorum_above_the_replicas_is_refused() -> None:
    with pytest.raises(ValueError, match="read_quorum"):
        MatchmakerConfig(read_quorum=6, declaration_replicas=5)
    with pytest.raises(ValueError, match="read_quorum"):
        MatchmakerConfig(read_quorum=0)
