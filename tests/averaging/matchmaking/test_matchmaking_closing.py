"""The closing rule and the balanced split (pure logic of matchmaking/closing.py)."""

from __future__ import annotations

import math

import pytest

from swarmavg.averaging.group import Mode
from swarmavg.averaging.matchmaking.closing import (
    MAX_SETTLE,
    MIN_SETTLE,
    Latency,
    LeaderView,
    assign_leaders,
    close_reason,
    expected_members,
    key_family,
    read_back_suffices,
    settle_time,
)
from swarmavg.averaging.matchmaking.declarations import Declaration, leader_order

SCHEMA = b"s" * 32


# Peer ids in leader order under the key the declarations below carry (""): pid(0) ranks
# first, so "peer i" ranks i-th, as the tests' reasoning assumes.
RANKED = sorted((bytes([j]) * 20 for j in range(256)), key=lambda p: leader_order("", p))


def pid(i: int) -> bytes:
    return RANKED[i]


def decl(i: int, start: float | None = None, mode: Mode = Mode.NODE) -> Declaration:
    return Declaration(
        peer_id=pid(i),
        address="" if mode is Mode.CLIENT else f"127.0.0.1:{1000 + i}",
        start=float(i) if start is None else start,
        deadline=100.0,
        give_up=200.0,
        mode=mode,
        bandwidth=1.0,
        schema_hash=SCHEMA,
        group_size=16,
    )


def view(
    members: set[int],
    declared: list[int],
    *,
    previous: set[int] = frozenset(),  # type: ignore[assignment]
    taken: set[int] = frozenset(),  # type: ignore[assignment]
    gone: set[int] = frozenset(),  # type: ignore[assignment]
    wanted: int = 0,
    seen_at: float = 0.0,
    group_size: int = 16,
    min_group_size: int = 2,
    away: set[int] = frozenset(),  # type: ignore[assignment]
    proven_roster: bool = True,
    late: set[int] = frozenset(),  # type: ignore[assignment]
) -> LeaderView:
    return LeaderView(
        me=decl(0),
        members=frozenset(pid(i) for i in members | {0}),
        declarations=tuple(decl(i) for i in sorted(set(declared) | {0})),
        first_seen={pid(i): seen_at for i in declared},
        previous=frozenset(pid(i) for i in previous),
        taken=frozenset(pid(i) for i in taken),
        group_size=group_size,
        min_group_size=min_group_size,
        wanted=wanted,
        gone=frozenset(pid(i) for i in gone),
        away=frozenset(pid(i) for i in away),
        proven_roster=proven_roster,
        late=frozenset(pid(i) for i in late),
    )


def test_split_is_balanced_never_n_plus_one() -> None:
    for n, size in [(17, 16), (16, 16), (33, 16), (5, 2), (7, 3)]:
        assignment = assign_leaders([decl(i) for i in range(n)], size)
        groups: dict[bytes, int] = {}
        for leader in assignment.values():
            groups[leader] = groups.get(leader, 0) + 1
        assert len(groups) == math.ceil(n / size)
        assert max(groups.values()) - min(groups.values()) <= 1
        assert max(groups.values()) <= size
    sizes = sorted(
        list(assign_leaders([decl(i) for i in range(17)], 16).values()).count(leader)
        for leader in (pid(0), pid(1))
    )
    assert sizes == [8, 9]


def test_members_come_after_their_leader_or_cannot_lead() -> None:
    declarations = [decl(i, mode=Mode.CLIENT if i % 5 == 0 else Mode.NODE) for i in range(23)]
    by_id = {d.peer_id: d for d in declarations}
    for member, leader in assign_leaders(declarations, 4).items():
        assert by_id[leader].can_lead
        if member != leader:
            assert by_id[member].order > by_id[leader].order or not by_id[member].can_lead


def test_every_peer_computes_the_same_split_in_any_order() -> None:
    declarations = [decl(i, start=10.0 - i * 0.1) for i in range(9)]
    assert assign_leaders(declarations, 4) == assign_leaders(declarations[::-1], 4)


def test_nobody_can_lead() -> None:
    assert assign_leaders([decl(1, mode=Mode.CLIENT)], 4) == {}


def test_complete_when_every_declared_peer_is_in_and_the_read_is_fresh() -> None:
    v = view({1, 2}, [1, 2])
    assert close_reason(v, now=1.0, started=0.0, settle=0.1, patience=1.0, fresh=True) == (
        "complete"
    )
    # A stale read may have missed a newcomer: wait for a fresh one.
    assert close_reason(v, now=1.0, started=0.0, settle=0.1, patience=1.0, fresh=False) is None
    # Inside the settle time, a peer that called at the same moment may not be visible yet.
    assert close_reason(v, now=0.05, started=0.0, settle=0.1, patience=1.0, fresh=True) is None


def test_a_declared_straggler_is_waited_for_within_its_patience_only() -> None:
    v = view({1}, [1, 2], seen_at=0.0)
    assert close_reason(v, now=0.5, started=0.0, settle=0.1, patience=1.0, fresh=True) is None
    assert close_reason(v, now=1.5, started=0.0, settle=0.1, patience=1.0, fresh=True) == (
        "complete"
    )


def test_fast_quorum_closes_without_settle_or_fresh_read() -> None:
    v = view({1, 2, 3}, [1, 2, 3], previous={1, 2, 3})
    assert close_reason(v, now=0.0, started=0.0, settle=0.5, patience=1.0, fresh=False) == (
        "quorum"
    )


def test_an_undeclared_previous_member_is_expected() -> None:
    v = view({1}, [1], previous={1, 2})
    assert pid(2) in expected_members(v, now=5.0, patience=1.0)
    assert close_reason(v, now=5.0, started=0.0, settle=0.1, patience=1.0, fresh=True) is None
    # Known to be in another, closed group: not waited for; the rest of the quorum is in.
    v = view({1}, [1], previous={1, 2}, taken={2})
    assert close_reason(v, now=5.0, started=0.0, settle=0.1, patience=1.0, fresh=False) == (
        "quorum"
    )


def test_a_dead_previous_member_is_neither_expected_nor_wanted() -> None:
    # Previous round 0, 1, 2, 3; 3 was found dead. The caller counted 4 (3's records).
    v = view({1, 2}, [1, 2], previous={1, 2, 3}, wanted=4)
    assert close_reason(v, now=5.0, started=0.0, settle=0.1, patience=1.0, fresh=True) is None
    v = view({1, 2}, [1, 2], previous={1, 2, 3}, wanted=4, gone={3})
    assert pid(3) not in expected_members(v, now=5.0, patience=1.0)
    assert close_reason(v, now=0.0, started=0.0, settle=0.1, patience=1.0, fresh=False) == (
        "quorum"
    )
    # A dead peer that is in the group after all (it restarted) still counts as wanted.
    v = view({1, 2, 3}, [1, 2, 3], previous={1, 2, 3}, wanted=5, gone={3})
    assert close_reason(v, now=5.0, started=0.0, settle=0.1, patience=1.0, fresh=True) is None


def test_peers_of_the_other_half_of_a_split_are_not_expected() -> None:
    # 17 declarers, size 16: this leader (peer 0) gets 0, 2, 4, ..., 16.
    v = view(set(range(2, 17, 2)), list(range(1, 17)))
    assert expected_members(v, now=0.5, patience=1.0) == {pid(i) for i in range(0, 17, 2)}
    assert close_reason(v, now=0.5, started=0.0, settle=0.1, patience=1.0, fresh=True) == (
        "complete"
    )


def test_full_and_minimum() -> None:
    assert close_reason(view({1}, [1, 2, 3], group_size=2), 0.0, 0.0, 1.0, 1.0, fresh=False) == (
        "full"
    )
    assert close_reason(view(set(), [], min_group_size=2), 9.0, 0.0, 0.1, 1.0, fresh=True) is None


def test_settle_time_follows_latency_within_bounds() -> None:
    assert settle_time(0.0, 0.0) == MIN_SETTLE
    assert settle_time(10.0, 10.0) == MAX_SETTLE
    assert settle_time(0.01, 0.005) == pytest.approx(0.05)


def test_latency_rises_at_once_and_falls_slowly() -> None:
    latency = Latency(initial=0.02, smoothing=0.5)
    latency.observe(0.1)
    assert latency.value == 0.1
    latency.observe(0.0)
    assert latency.value == pytest.approx(0.05)
    for bad in (-1.0, float("nan"), float("inf")):
        latency.observe(bad)
    assert latency.value == pytest.approx(0.05)
    with pytest.raises(ValueError, match="initial"):
        Latency(initial=0.0)


def test_key_family() -> None:
    assert key_family("step-42") == key_family("step-7") == "step-"
    assert key_family("run.grad.e12") == "run.grad.e"
    assert key_family("k") == "k"


def test_a_caller_count_larger_than_the_split_gives_waits_for_the_share_only() -> None:
    # 5 declarers called with group_size=4 (the caller counts 4): the split is 3 + 2 and
    # this leader gets 0, 2, 4, so its group closes rather than wait for a fourth member.
    v = view({2, 4}, [1, 2, 3, 4], wanted=4, group_size=4)
    assert close_reason(v, now=0.5, started=0.0, settle=0.1, patience=1.0, fresh=True) == (
        "complete"
    )
    # Members of the other group, closed already, still count in the swarm.
    v = view({2, 4}, [1, 2, 3, 4], taken={1, 3}, wanted=4, group_size=4)
    assert close_reason(v, now=0.5, started=0.0, settle=0.1, patience=1.0, fresh=True) == (
        "complete"
    )
    # While the swarm fits in one group, the caller's whole count is waited for.
    v = view({2}, [1, 2], wanted=4, group_size=4)
    assert close_reason(v, now=5.0, started=0.0, settle=0.1, patience=1.0, fresh=True) is None


def test_a_read_back_stands_when_it_holds_the_last_round_and_room_for_one_more() -> None:
    seen = {pid(i) for i in range(4)}
    previous = {pid(i) for i in range(1, 4)}
    assert read_back_suffices(seen, previous, previous_seen=4, group_size=16)
    # more than the last round saw: a newcomer declared in time
    assert read_back_suffices(seen | {pid(9)}, previous, previous_seen=4, group_size=16)


@pytest.mark.parametrize(
    ("seen", "previous", "previous_seen", "group_size", "why"),
    [
        ({1, 2, 3}, set(), 0, 16, "a first round"),
        ({1, 2, 3}, {2, 3}, 0, 16, "no count of the last round"),
        ({1, 2}, {2, 3}, 3, 16, "a member of the last round missing"),
        ({1, 2, 3}, {2, 3}, 4, 16, "fewer than the last round saw"),
        ({1, 2, 3, 4}, {2, 3, 4}, 4, 4, "the group size binds: one missed peer splits"),
        ({1, 2, 3, 4, 5}, {2, 3, 4}, 4, 4, "more than one group"),
    ],
)
def test_a_read_back_does_not_stand(
    seen: set[int], previous: set[int], previous_seen: int, group_size: int, why: str
) -> None:
    assert not read_back_suffices(
        {pid(i) for i in seen}, {pid(i) for i in previous}, previous_seen, group_size
    ), why


def test_a_split_heals_the_roster_of_every_peer_seen_is_waited_for() -> None:
    # Last round split into {0, 1} and {2, 3}; peer 0 saw all four. Its next round waits
    # for 2 and 3 as well, not only for its last group's member 1.
    v = view({1}, [1], previous={1, 2, 3})
    assert {pid(2), pid(3)} <= expected_members(v, now=0.5, patience=1.0)
    assert close_reason(v, now=0.5, started=0.0, settle=0.1, patience=1.0, fresh=True) is None
    v = view({1, 2, 3}, [1, 2, 3], previous={1, 2, 3})
    assert close_reason(v, now=0.0, started=0.0, settle=0.1, patience=1.0, fresh=False) == (
        "quorum"
    )


def test_a_declared_roster_peer_is_waited_for_past_the_patience() -> None:
    # A roster peer is known to call: its slow join on a loaded machine is waited for (up
    # to the caller's upper bound); a newcomer's patience runs out.
    v = view({1}, [1, 2, 3], previous={1, 2}, seen_at=0.0)
    expected = expected_members(v, now=10.0, patience=1.0)
    assert pid(2) in expected
    assert pid(3) not in expected


def test_roster_peers_that_will_not_come_are_not_waited_for() -> None:
    v = view({1}, [1], previous={1, 2, 3}, away={2}, gone={3})
    assert expected_members(v, now=0.5, patience=1.0) == {pid(0), pid(1)}
    assert close_reason(v, now=0.0, started=0.0, settle=0.1, patience=1.0, fresh=False) == (
        "quorum"
    )


def test_roster_peers_the_split_gives_to_another_leader_do_not_hold_this_one() -> None:
    # 6 peers seen, group size 4: 0 leads {0, 2, 4}, 1 leads {1, 3, 5}.
    v = view({2, 4}, [1, 2, 3, 4, 5], previous={1, 2, 3, 4, 5}, group_size=4)
    assert close_reason(v, now=0.0, started=0.0, settle=0.1, patience=1.0, fresh=False) == (
        "quorum"
    )


def test_a_first_rounds_presence_roster_waits_but_closes_only_as_complete() -> None:
    # The run's averagers (presence entries) are waited for until they declare ...
    v = view({1}, [1], previous={1, 2}, proven_roster=False)
    assert pid(2) in expected_members(v, now=0.5, patience=1.0)
    assert close_reason(v, now=0.5, started=0.0, settle=0.1, patience=1.0, fresh=True) is None
    # ... but close after the settle time on a fresh read, never at once.
    v = view({1, 2}, [1, 2], previous={1, 2}, proven_roster=False)
    assert close_reason(v, now=0.0, started=0.0, settle=0.1, patience=1.0, fresh=False) is None
    assert close_reason(v, now=0.5, started=0.0, settle=0.1, patience=1.0, fresh=True) == (
        "complete"
    )
