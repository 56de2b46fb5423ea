"""The roster grace: how long a leader waits for roster peers that have not declared
(pure rules of matchmaking/closing.py and the round's record in round.py)."""

from __future__ import annotations

import asyncio
import math

import pytest

from swarmavg.averaging.group import GroupInfo, Member, Mode
from swarmavg.averaging.matchmaking.closing import (
    GRACE_FACTOR,
    LATENESS_KEPT,
    MIN_GRACE,
    MIN_LATENESS_ROUNDS,
    arrival_lateness,
    close_reason,
    expected_members,
    roster_grace,
    wanted_here,
)
from swarmavg.averaging.matchmaking.config import MatchRequest
from swarmavg.averaging.matchmaking.roster import FamilyRoster
from swarmavg.averaging.matchmaking.round import Round
from tests.averaging.matchmaking.test_matchmaking_closing import SCHEMA, decl, pid, view


def test_lateness_is_the_wider_of_the_signed_spread_and_the_local_view() -> None:
    assert arrival_lateness([10.0, 10.2, 10.5], [0.1, 0.2]) == pytest.approx(0.5)
    # Members whose clocks agree too well (or a reader that came last) still show the
    # delay this peer itself saw before reading a member's declaration.
    assert arrival_lateness([10.0, 10.0], [0.0, 0.8]) == pytest.approx(0.8)
    assert arrival_lateness([], []) == 0.0
    assert arrival_lateness([5.0], [-1.0]) == 0.0  # never negative
    assert arrival_lateness([1.0, math.inf, math.nan], [math.inf]) == 0.0


def test_a_familys_first_rounds_wait_the_whole_window() -> None:
    observed = [0.1] * (MIN_LATENESS_ROUNDS - 1)
    assert roster_grace(observed, settle=0.05, upper=5.0) == 5.0
    assert roster_grace([], settle=0.05, upper=5.0) == 5.0


def test_the_grace_follows_the_latest_arrival_of_recent_rounds() -> None:
    observed = [0.1, 0.3, 0.2]
    expected = GRACE_FACTOR * 0.3 + MIN_GRACE
    assert roster_grace(observed, settle=0.05, upper=5.0) == pytest.approx(expected)
    # The floor follows a slow DHT (the settle time) when that is above MIN_GRACE.
    slow = MIN_GRACE + 0.5
    assert roster_grace(observed, settle=slow, upper=5.0) == pytest.approx(
        GRACE_FACTOR * 0.3 + slow
    )
    # Never past the window.
    assert roster_grace([4.0] * 3, settle=0.05, upper=5.0) == 5.0
    # One outlier among many rounds is not followed (the percentile), two are.
    many = [0.1] * (LATENESS_KEPT - 1) + [3.0]
    assert roster_grace(many, settle=0.05, upper=5.0) == pytest.approx(
        GRACE_FACTOR * 0.1 + MIN_GRACE
    )
    many[0] = 1.0
    assert roster_grace(many, settle=0.05, upper=5.0) == pytest.approx(
        GRACE_FACTOR * 1.0 + MIN_GRACE
    )
    # Only the newest LATENESS_KEPT rounds count: an old outlier is forgotten.
    old = [3.0] + [0.1] * LATENESS_KEPT
    assert roster_grace(old, settle=0.05, upper=5.0) == pytest.approx(
        GRACE_FACTOR * 0.1 + MIN_GRACE
    )
    # Nonsense values are not observations.
    assert roster_grace([math.nan, -1.0, 0.1, 0.1], settle=0.05, upper=5.0) == 5.0


def test_a_late_roster_peer_is_neither_expected_nor_wanted() -> None:
    # Previous round 0, 1, 2, 3; 3 has not declared and the caller's records count 4.
    v = view({1, 2}, [1, 2], previous={1, 2, 3}, wanted=4)
    assert pid(3) in expected_members(v, now=1.0, patience=1.0)
    assert close_reason(v, now=1.0, started=0.0, settle=0.1, patience=1.0, fresh=True) is None
    # Its grace ran out: the group of three closes at once, on its quorum.
    late = view({1, 2}, [1, 2], previous={1, 2, 3}, wanted=4, late={3})
    assert pid(3) not in expected_members(late, now=1.0, patience=1.0)
    assert wanted_here(late) == 3
    assert close_reason(late, now=1.0, started=0.0, settle=0.1, patience=1.0, fresh=False) == (
        "quorum"
    )
    # A late peer that joined after all still counts.
    joined = view({1, 2, 3}, [1, 2, 3], previous={1, 2, 3}, wanted=5, late={3})
    assert wanted_here(joined) == 5


def test_a_round_names_its_late_roster_peers_only_after_the_grace() -> None:
    async def check() -> None:
        rnd = _round(previous={1, 2, 3}, grace_by=10.0)
        rnd.declarations = (decl(0), decl(1))
        assert rnd.late(9.9) == frozenset()
        assert rnd.late(10.0) == {pid(2), pid(3)}
        rnd.declarations = (decl(0), decl(1), decl(2))  # 2 declared after all
        assert rnd.late(10.0) == {pid(3)}
        # The next round's roster leaves out those still late when the round ended.
        assert set(rnd.roster(now=9.0).peers) == {pid(1), pid(2), pid(3)}
        assert set(rnd.roster(now=10.0).peers) == {pid(1), pid(2)}
        # Without a grace (a family's first rounds), nobody is ever late.
        assert _round(previous={1, 2}, grace_by=math.inf).late(1e9) == frozenset()

    asyncio.run(check())


def test_a_formed_round_adds_its_lateness_to_the_roster() -> None:
    async def check() -> None:
        rnd = _round(previous={1, 2}, grace_by=math.inf, lateness=(0.4,))
        rnd.signed = {pid(1): decl(1, start=100.3), pid(2): decl(2, start=100.1)}
        rnd.first_seen = {pid(1): 50.2, pid(2): 50.1}  # started at 50.0
        assert rnd.lateness() is None  # no group yet
        members = tuple(Member(pid(i), f"127.0.0.1:{1000 + i}", Mode.NODE) for i in (0, 1, 2))
        rnd.result.set_result(GroupInfo(b"g" * 16, members, SCHEMA))
        rnd.leader = (pid(1), "127.0.0.1:1001")  # a follower: its reads are not arrivals
        assert rnd.lateness() == pytest.approx(0.3)  # signed starts 100.0 .. 100.3
        assert rnd.roster(now=55.0).lateness == pytest.approx((0.4, 0.3))
        rnd.first_seen[pid(2)] = 50.6  # it led: it read 2's declaration as 2 joined
        rnd.leader = None
        assert rnd.lateness() == pytest.approx(0.6)
        # A family's first round (its roster from presence entries) is not observed:
        # processes start seconds apart there.
        rnd.proven_roster = False
        assert rnd.lateness() is None
        assert rnd.roster(now=55.0).lateness == pytest.approx((0.4,))

    asyncio.run(check())


def test_a_roster_keeps_the_newest_lateness_only() -> None:
    roster = FamilyRoster()
    for i in range(LATENESS_KEPT + 3):
        roster.observe_lateness(float(i), LATENESS_KEPT)
    roster.observe_lateness(math.nan, LATENESS_KEPT)
    roster.observe_lateness(-1.0, LATENESS_KEPT)
    assert roster.lateness == tuple(float(i) for i in range(3, LATENESS_KEPT + 3))


def _round(previous: set[int], grace_by: float, lateness: tuple[float, ...] = ()) -> Round:
    request = MatchRequest(
        key="k",
        schema_hash=SCHEMA,
        group_size=16,
        min_group_size=2,
        codec="none",
        mode=Mode.NODE,
        bandwidth=1.0,
        user_data=b"",
        close_by=60.0,
        give_up_by=70.0,
    )
    return Round(
        request,
        decl(0, start=100.0),
        asyncio.get_running_loop().create_future(),
        started=50.0,
        close_by=60.0,
        previous=frozenset(pid(i) for i in previous),
        previous_lateness=lateness,
        roster_grace_by=grace_by,
    )
