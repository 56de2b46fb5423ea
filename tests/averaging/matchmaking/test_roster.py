"""Whom a round expects: presence entries, family rosters, late askers (roster.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

from swarmavg.averaging.errors import RoundClosedError
from swarmavg.averaging.group import Mode
from swarmavg.averaging.matchmaking.closing import MIN_LATENESS_ROUNDS
from swarmavg.averaging.matchmaking.config import MatchmakingEvent
from swarmavg.averaging.matchmaking.declarations import MAX_ADDRESS_CHARS
from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.matchmaking.roster import (
    MAX_ROSTER,
    FamilyRoster,
    Presence,
    decode_presence,
    parse_presence,
    presence_key,
)
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import owner_suffix
from tests.averaging.averager_swarm import RUN_ID, Peer, averager_swarm, fast_config

ME = b"\x01" * 20
OTHER = b"\x02" * 20


def test_presence_round_trips_and_names_its_owner() -> None:
    entry = Presence(OTHER, "127.0.0.1:5", Mode.NODE)
    assert decode_presence(owner_suffix(OTHER), entry.encode()) == entry
    assert presence_key("run") == "run.averagers"


@pytest.mark.parametrize(
    ("subkey", "value"),
    [
        ("plain", {"addr": "a:1", "mode": 0}),  # not an owned subkey
        (owner_suffix(OTHER), "x"),
        (owner_suffix(OTHER), {"addr": "a:1"}),
        (owner_suffix(OTHER), {"addr": "a:1", "mode": 0, "extra": 1}),
        (owner_suffix(OTHER), {"addr": 5, "mode": 0}),
        (owner_suffix(OTHER), {"addr": "a" * (MAX_ADDRESS_CHARS + 1), "mode": 0}),
        (owner_suffix(OTHER), {"addr": "a:1", "mode": True}),
        (owner_suffix(OTHER), {"addr": "a:1", "mode": 99}),
        (owner_suffix(OTHER), {"addr": "a:1", "mode": 1.0}),
    ],
)
def test_malformed_presence_entries_are_dropped(subkey: object, value: object) -> None:
    assert decode_presence(subkey, value) is None


def test_parse_presence_keeps_others_of_the_run_that_average() -> None:
    aux = b"\x03" * 20
    client = b"\x04" * 20
    record = {
        owner_suffix(ME): {"addr": "me:1", "mode": int(Mode.NODE)},
        owner_suffix(OTHER): {"addr": "o:1", "mode": int(Mode.NODE)},
        owner_suffix(aux): {"addr": "x:1", "mode": int(Mode.AUX)},
        owner_suffix(client): {"addr": "", "mode": int(Mode.CLIENT)},
        "junk": 1,
    }
    assert parse_presence(record, ME) == {OTHER: "o:1", client: None}
    assert parse_presence(None, ME) == {}


def test_a_roster_is_bounded_and_learns_addresses() -> None:
    roster = FamilyRoster({OTHER: None})
    roster.add(OTHER, "o:1")
    assert roster.peers == {OTHER: "o:1"}
    for i in range(MAX_ROSTER + 10):
        roster.add(i.to_bytes(20, "big"), None)
    assert len(roster.peers) == MAX_ROSTER


@pytest.mark.timeout(120)
async def test_a_late_peer_is_expected_in_the_next_round_and_the_swarm_is_one_again() -> None:
    # Two peers average under step-0; a third calls after their group closed and fails at
    # once. In the next round the two have joined each other before the third calls:
    # they wait for it (it asked one of them), and all three form one group.
    config = fast_config(matchmaking_time=20.0)
    async with averager_swarm(3, config) as swarm:
        early, other, late = swarm.peers
        tensors = [np.ones(8, dtype=np.float32)]
        first = await asyncio.gather(*(_average(p, "step-0", tensors) for p in (early, other)))
        assert [r.group_size for r in first] == [2, 2]
        with pytest.raises(RoundClosedError, match="closed before this peer joined"):
            await _average(late, "step-0", tensors)
        family = matchmaking_key(RUN_ID, "step-", early.averager.group_bits)
        rosters = [p.averager.matchmaker._last[family].peers for p in (early, other)]
        assert any(late.peer_id in r for r in rosters), rosters

        calls = [asyncio.ensure_future(_average(p, "step-1", tensors)) for p in (early, other)]
        await swarm.wait_for(
            lambda: any(
                event is MatchmakingEvent.FOLLOWER_ACCEPTED and key.endswith("step-1.0b")
                for p in (early, other)
                for event, key, _ in p.events
            )
        )
        calls.append(asyncio.ensure_future(_average(late, "step-1", tensors)))
        results = await asyncio.gather(*calls)
        assert [r.group_size for r in results] == [3, 3, 3]
        assert len({r.group_id for r in results}) == 1


async def _average(
    peer: Peer,
    key: str,
    tensors: list[np.ndarray],
    group_size: int | None = None,
    timeout: float = 20.0,
) -> AveragingResult:
    return await peer.averager.average(tensors, key, group_size=group_size, timeout=timeout)


@pytest.mark.timeout(120)
async def test_a_familys_first_round_waits_past_matchmaking_time_for_the_runs_averagers() -> None:
    # Processes start seconds apart: the first round of a family waits for a daemon of the
    # run whose trainer calls 2 s after the others, longer than matchmaking_time (0.5 s),
    # within the call's own budget. The next round of the family waits no longer than
    # matchmaking_time for a member that does not come.
    config = fast_config(matchmaking_time=0.5)
    async with averager_swarm(3, config) as swarm:
        tensors = [np.ones(8, dtype=np.float32)]
        first, second, late = swarm.peers
        calls = [asyncio.ensure_future(_average(p, "first-0", tensors)) for p in (first, second)]
        await asyncio.sleep(2.0)  # the third trainer is still importing torch
        calls.append(asyncio.ensure_future(_average(late, "first-0", tensors)))
        results = await asyncio.gather(*calls)
        assert [r.group_size for r in results] == [3, 3, 3]
        # Now a roster: the third stays away from the next round; the others close on the
        # window, not on the call's budget.
        results = await asyncio.gather(*(_average(p, "first-1", tensors) for p in (first, second)))
        assert [r.group_size for r in results] == [2, 2]
        assert "deadline" in {
            reason for p in (first, second) for reason in p.averager.matchmaker.closes
        }


@pytest.mark.timeout(120)
async def test_a_member_that_stops_calling_costs_the_others_the_grace_not_the_window() -> None:
    # Three peers average a few rounds of a family together; then one's trainer stops (its
    # daemon lives on: no probe finds it dead) while the others' records still name it
    # (group_size=3). They close on their quorum once the family's grace has passed, not
    # at the end of the window; then it calls again and the three are one group.
    config = fast_config(matchmaking_time=30.0)
    async with averager_swarm(3, config) as swarm:
        tensors = [np.ones(8, dtype=np.float32)]
        everyone = swarm.peers
        # The family's first round has no roster yet: it is not observed.
        rounds = MIN_LATENESS_ROUNDS + 1
        for i in range(rounds):
            results = await asyncio.gather(
                *(_average(p, f"grace-{i}", tensors, group_size=3) for p in everyone)
            )
            assert [r.group_size for r in results] == [3, 3, 3]
        awake = everyone[:2]
        before = sum((p.averager.matchmaker.closes for p in awake), Counter[str]())
        results = await asyncio.gather(
            *(_average(p, f"grace-{rounds}", tensors, group_size=3, timeout=45.0) for p in awake)
        )
        assert [r.group_size for r in results] == [2, 2]
        after = sum((p.averager.matchmaker.closes for p in awake), Counter[str]())
        assert after - before == Counter({"quorum": 1}), after - before
        results = await asyncio.gather(
            *(_average(p, f"grace-{rounds + 1}", tensors, group_size=3) for p in everyone)
        )
        assert [r.group_size for r in results] == [3, 3, 3]
        assert len({r.group_id for r in results}) == 1
