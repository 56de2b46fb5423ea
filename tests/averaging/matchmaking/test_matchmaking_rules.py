"""Pure matchmaking rules: declaration parsing, leader order, join decisions, group wire form."""

from __future__ import annotations

import os

import pytest

from swarmavg.averaging.group import GroupInfo, Member, Mode
from swarmavg.averaging.matchmaking.declarations import (
    Declaration,
    FollowerAsk,
    JoinState,
    check_formed_group,
    decide_join,
    declaration_mismatch,
    declaration_subkey,
    decode_declaration,
    group_from_proto,
    group_to_proto,
    leader_candidates,
    leader_order,
    mismatched_schemas,
    user_data_digest,
)
from swarmavg.proto import averaging_pb2

SCHEMA = b"s" * 32
# Peer ids in leader order under the declarations' key (""): "peer i" ranks i-th.
RANKED = sorted((bytes([j]) * 20 for j in range(256)), key=lambda p: leader_order("", p))


def idx(d: Declaration) -> int:
    return RANKED.index(d.peer_id)


def decl(
    start: float,
    pid: int,
    *,
    mode: Mode = Mode.NODE,
    address: str = "127.0.0.1:1",
    schema: bytes = SCHEMA,
    give_up: float = 100.0,
) -> Declaration:
    return Declaration(
        peer_id=RANKED[pid],
        address=address,
        start=start,
        deadline=start + 1,
        give_up=give_up,
        mode=mode,
        bandwidth=1.0,
        schema_hash=schema,
        group_size=4,
    )


def test_declaration_round_trip_and_rejects_garbage() -> None:
    d = decl(1.0, 7)
    sub = declaration_subkey(d.peer_id)
    assert decode_declaration(sub, d.encode()) == d
    good = d.encode()
    bad_values = [
        {**good, "v": 2},
        {**good, "schema": b"short"},
        {**good, "start": float("nan")},
        {**good, "mode": 9},
        {**good, "gs": 0},
        {**good, "gs": True},
        {**good, "bw": -1.0},
        {**good, "addr": 5},
        {**good, "deadline": 0.5},  # before start
        "not a dict",
    ]
    for value in bad_values:
        assert decode_declaration(sub, value) is None, value
    assert decode_declaration(d.peer_id.hex(), good) is None  # not an owned subkey
    assert decode_declaration(sub[:-2] + "]", good) is None


def test_the_hash_rank_leads_not_the_declared_start() -> None:
    me = decl(5.0, 9)
    others = [decl(3.0, 4), decl(1.0, 8), decl(1.0, 2), decl(6.0, 1), me]
    early = decl(-1e9, 12)  # the earliest start of all, but it ranks after us
    order = [idx(d) for d in leader_candidates([*others, early], me, now=0.0)]
    assert order == [1, 2, 4, 8]


def test_each_key_deals_a_fresh_order() -> None:
    ids = [bytes([j]) * 20 for j in range(8)]
    firsts = {min(ids, key=lambda p: leader_order(f"run.step-{k}.0b", p)) for k in range(64)}
    assert len(firsts) == len(ids)  # over 64 keys every one of 8 peers ranked first


def test_candidates_skip_clients_expired_mismatched_and_excluded() -> None:
    me = decl(5.0, 9)
    others = [
        decl(1.0, 1, mode=Mode.CLIENT),
        decl(1.0, 2, address=""),
        decl(1.0, 3, give_up=4.0),
        decl(1.0, 4, schema=b"x" * 32),
        decl(1.0, 5),
        decl(1.0, 6),
    ]
    got = leader_candidates(others, me, now=10.0 - 5.5, excluded={RANKED[6]})
    assert [idx(d) for d in got] == [5]
    assert [idx(d) for d in mismatched_schemas(others, me)] == [4]


def test_client_asks_even_later_peers() -> None:
    me = decl(0.0, 9, mode=Mode.CLIENT, address="")
    got = leader_candidates([decl(3.0, 1), decl(2.0, 2)], me, now=0.0)
    assert [idx(d) for d in got] == [1, 2]


def state(**kw: object) -> JoinState:
    base: dict[str, object] = dict(
        me=decl(1.0, 5), following=False, closed=False, num_members=1, group_size=4
    )
    base.update(kw)
    return JoinState(**base)  # type: ignore[arg-type]


def rank(i: int) -> tuple[bytes, bytes]:
    return leader_order("", RANKED[i])


@pytest.mark.parametrize(
    ("kw", "follower", "expected"),
    [
        ({}, 7, averaging_pb2.JOIN_ACCEPTED),
        ({"closed": True}, 7, averaging_pb2.JOIN_REJECT_FULL),
        ({"following": True}, 7, averaging_pb2.JOIN_REDIRECT),
        ({"num_members": 4}, 7, averaging_pb2.JOIN_REJECT_FULL),
        # A peer that ranks before us asking us: it leads, we do not (no mutual waits).
        ({}, 1, averaging_pb2.JOIN_REJECT_NOT_LEADER),
        # Unless we shun it (it stalled or refused us): we never ask it, we lead it.
        ({"shunned": frozenset({RANKED[1]})}, 1, averaging_pb2.JOIN_ACCEPTED),
    ],
)
def test_join_decisions(kw: dict[str, object], follower: int, expected: int) -> None:
    assert decide_join(state(**kw), rank(follower), True, SCHEMA) == expected


def test_mutual_requests_never_both_accepted() -> None:
    a, b = decl(1.0, 1), decl(1.0, 2)
    a_answers_b = decide_join(state(me=a), b.order, True, SCHEMA)
    b_answers_a = decide_join(state(me=b), a.order, True, SCHEMA)
    assert sorted([a_answers_b, b_answers_a]) == sorted(
        [averaging_pb2.JOIN_ACCEPTED, averaging_pb2.JOIN_REJECT_NOT_LEADER]
    )


def test_schema_mismatch_and_client_follower() -> None:
    assert (
        decide_join(state(), rank(7), True, b"x" * 32) == averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH
    )
    # A client cannot lead, so it is accepted even if it ranks before us.
    assert decide_join(state(), rank(1), False, SCHEMA) == averaging_pb2.JOIN_ACCEPTED


def test_group_wire_round_trip_and_validation() -> None:
    group = GroupInfo(
        group_id=os.urandom(16),
        members=(
            Member(bytes([1]) * 20, "127.0.0.1:5", Mode.NODE, 2.5, b"hi"),
            Member(bytes([2]) * 20, None, Mode.CLIENT, 1.0),
            Member(bytes([3]) * 20, "127.0.0.1:6", Mode.AUX, 1.0),
        ),
        schema_hash=SCHEMA,
        codec="float16",
    )
    message = averaging_pb2.GroupDescription.FromString(group_to_proto(group).SerializeToString())
    assert group_from_proto(message) == group
    broken = averaging_pb2.GroupDescription()
    broken.CopyFrom(message)
    broken.members[0].mode = 7
    with pytest.raises(ValueError, match="mode"):
        group_from_proto(broken)
    broken.CopyFrom(message)
    broken.members[1].peer_id = broken.members[0].peer_id
    with pytest.raises(ValueError, match="twice"):
        group_from_proto(broken)
    broken.CopyFrom(message)
    broken.schema_hash = b"x"
    with pytest.raises(ValueError, match="32"):
        group_from_proto(broken)


def _ask(me: bytes, **changes: object) -> FollowerAsk:
    fields: dict[str, object] = {
        "peer_id": me,
        "address": "127.0.0.1:5",
        "mode": Mode.NODE,
        "bandwidth": 1.0,
        "user_data": b"mine",
        "data_port": 7,
        "schema_hash": SCHEMA,
        "codec": "none",
        "min_group_size": 2,
        "group_size": 4,
    }
    fields.update(changes)
    return FollowerAsk(**fields)  # type: ignore[arg-type]


def _signed(member: Member, **changes: object) -> Declaration:
    fields: dict[str, object] = {
        "peer_id": member.peer_id,
        "address": member.address or "",
        "start": 1.0,
        "deadline": 2.0,
        "give_up": 3.0,
        "mode": member.mode,
        "bandwidth": member.bandwidth,
        "schema_hash": SCHEMA,
        "group_size": 4,
        "codec": "none",
        "data_port": member.data_port,
        "user_data_digest": user_data_digest(member.user_data),
    }
    fields.update(changes)
    return Declaration(**fields)  # type: ignore[arg-type]


def test_follower_checks_the_formed_group() -> None:
    me, leader = bytes([1]) * 20, bytes([2]) * 20
    mine = Member(me, "127.0.0.1:5", Mode.NODE, 1.0, b"mine", data_port=7)
    theirs = Member(leader, "127.0.0.1:6", Mode.NODE, 1.0, b"", data_port=8)
    group = GroupInfo(group_id=b"g", members=(mine, theirs), schema_hash=SCHEMA)
    wire = group_to_proto(group)
    signed = {leader: _signed(theirs)}
    assert check_formed_group(wire, _ask(me), leader, signed) == group
    refused: list[tuple[FollowerAsk, bytes, dict[bytes, Declaration], str]] = [
        (_ask(bytes([3]) * 20), leader, signed, "lacks"),
        (_ask(me), bytes([3]) * 20, signed, "lacks"),
        (_ask(me, schema_hash=b"x" * 32), leader, signed, "schema"),
        (_ask(me, codec="float16"), leader, signed, "codec 'none'"),
        (_ask(me, min_group_size=3), leader, signed, "2 members"),
        (_ask(me, group_size=1, min_group_size=1), leader, signed, "2 members"),
        (_ask(me, mode=Mode.AUX), leader, signed, "altered"),
        (_ask(me, user_data=b"other"), leader, signed, "altered"),
        (_ask(me, bandwidth=2.0), leader, signed, "altered"),
        (_ask(me, address="127.0.0.1:9"), leader, signed, "altered"),
        (_ask(me, data_port=9), leader, signed, "altered"),
        (_ask(me), leader, {}, "no signed declaration"),
        (_ask(me), leader, {leader: _signed(theirs, address="10.0.0.1:6")}, "address"),
        (_ask(me), leader, {leader: _signed(theirs, data_port=9)}, "data port"),
        (_ask(me), leader, {leader: _signed(theirs, bandwidth=1e9)}, "bandwidth"),
        (_ask(me), leader, {leader: _signed(theirs, mode=Mode.AUX)}, "mode"),
        (_ask(me), leader, {leader: _signed(theirs, user_data_digest=b"u" * 16)}, "user data"),
    ]
    for ask, leader_id, declarations, reason in refused:
        with pytest.raises(ValueError, match=reason):
            check_formed_group(wire, ask, leader_id, declarations)


def test_declared_starts_outside_the_window_do_not_count() -> None:
    now = 1_000_000.0
    assert decl(now - 5, 1).within_window(now)
    assert decl(now + 5, 1).within_window(now)
    for start in (-1e300, now - 601, now + 31, 1e300):
        assert not decl(start, 1).within_window(now)
    assert not decl(now - 11, 1).within_window(now, (10.0, 10.0))


def test_declarations_sign_codec_data_port_and_user_data() -> None:
    member = Member(bytes([4]) * 20, "127.0.0.1:5", Mode.NODE, 2.0, b"u", data_port=9)
    d = _signed(member)
    assert decode_declaration(declaration_subkey(d.peer_id), d.encode()) == d
    assert declaration_mismatch(member, d) is None
    good = d.encode()
    for bad in (
        {**good, "dp": 70000},
        {**good, "dp": True},
        {**good, "codec": 5},
        {**good, "codec": "x" * 65},
        {**good, "ud": b"short"},
    ):
        assert decode_declaration(declaration_subkey(d.peer_id), bad) is None
