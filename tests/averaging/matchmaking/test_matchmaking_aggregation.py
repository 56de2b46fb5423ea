"""The group agrees on one aggregation rule: peers of different rules never group, a
leader cannot hand a follower another rule, and the rule reaches every reducer."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from swarmavg.averaging.group import GroupInfo, Member, Mode
from swarmavg.averaging.matchmaking.declarations import (
    Declaration,
    FollowerAsk,
    JoinState,
    check_formed_group,
    decide_join,
    declaration_subkey,
    decode_declaration,
    group_from_proto,
    group_to_proto,
    leader_candidates,
    requested_aggregation,
    user_data_digest,
)
from swarmavg.averaging.result import AveragingResult
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import averager_swarm

SCHEMA = b"s" * 32
CLIP = "centered-clip:tau=1.0,iters=5,reject=3.0"


def decl(start: float, pid: int, aggregation: str = "mean") -> Declaration:
    return Declaration(
        peer_id=bytes([pid]) * 20,
        address="127.0.0.1:1",
        start=start,
        deadline=start + 1,
        give_up=100.0,
        mode=Mode.NODE,
        bandwidth=1.0,
        schema_hash=SCHEMA,
        group_size=4,
        aggregation=aggregation,
    )


def test_declarations_carry_the_rule() -> None:
    d = decl(1.0, 1, CLIP)
    subkey = declaration_subkey(d.peer_id)
    assert decode_declaration(subkey, d.encode()) == d
    older = {k: v for k, v in decl(1.0, 1).encode().items() if k != "agg"}
    assert decode_declaration(subkey, older) == decl(1.0, 1)  # no field: the mean
    # Peers send canonical names only; another spelling is not read as today's rule: an
    # older version's "centered-clip:tau=1.0,iters=5" meant no rejection, and filling in
    # reject=3 would group peers that mean different rules.
    old_clip = "centered-clip:tau=1.0,iters=5"
    for bad in ("median", 5, "x" * 100, "trimmed-mean:trim=0.9", "centered-clip", old_clip):
        assert decode_declaration(subkey, {**d.encode(), "agg": bad}) is None


def test_candidates_and_joins_need_the_same_rule() -> None:
    me = decl(5.0, 9, CLIP)
    others = [decl(1.0, 1), decl(2.0, 2, CLIP), decl(3.0, 3, "trimmed-mean:trim=0.25")]
    assert [d.peer_id for d in leader_candidates(others, me, now=0.0)] == [bytes([2]) * 20]
    state = JoinState(
        me=decl(0.0, 1, CLIP), following=False, closed=False, num_members=1, group_size=4
    )
    follower = (b"\xff" * 32, bytes([2]) * 20)  # ranks after any leader
    assert decide_join(state, follower, True, SCHEMA, CLIP) == averaging_pb2.JOIN_ACCEPTED
    assert (
        decide_join(state, follower, True, SCHEMA, "mean")
        == averaging_pb2.JOIN_REJECT_AGGREGATION_MISMATCH
    )
    assert requested_aggregation(averaging_pb2.JoinRequest()) == "mean"
    assert requested_aggregation(averaging_pb2.JoinRequest(aggregation=CLIP)) == CLIP
    for bad in ("median", "centered-clip", "centered-clip:tau=1.0,iters=5"):
        with pytest.raises(ValueError, match=r"unknown aggregation .*canonical name"):
            requested_aggregation(averaging_pb2.JoinRequest(aggregation=bad))


def declaration_of(member: Member, codec: str, aggregation: str) -> Declaration:
    """The declaration ``member`` signed (what a follower reads from the DHT)."""
    now = time.time()
    return Declaration(
        peer_id=member.peer_id,
        address=member.address or "",
        start=now,
        deadline=now + 5,
        give_up=now + 10,
        mode=member.mode,
        bandwidth=member.bandwidth,
        schema_hash=SCHEMA,
        group_size=2,
        aggregation=aggregation,
        codec=codec,
        data_port=member.data_port,
        user_data_digest=user_data_digest(member.user_data),
    )


def test_follower_refuses_a_group_of_another_rule() -> None:
    me, leader = bytes([1]) * 20, bytes([2]) * 20
    group = GroupInfo(
        group_id=b"g",
        members=(
            Member(me, "127.0.0.1:5", Mode.NODE, 1.0),
            Member(leader, "127.0.0.1:6", Mode.NODE, 1.0),
        ),
        schema_hash=SCHEMA,
        aggregation=CLIP,
    )
    wire = group_to_proto(group)
    assert group_from_proto(wire) == group
    ask = FollowerAsk(
        peer_id=me,
        address="127.0.0.1:5",
        mode=Mode.NODE,
        bandwidth=1.0,
        user_data=b"",
        data_port=0,
        schema_hash=SCHEMA,
        codec=group.codec,
        min_group_size=2,
        group_size=2,
        aggregation=CLIP,
    )
    leader_signed = {leader: declaration_of(group.members[1], group.codec, CLIP)}
    assert check_formed_group(wire, ask, leader, leader_signed) == group
    # a leader must not downgrade a robust member to the mean, nor the reverse
    mean_wire = group_to_proto(dataclasses.replace(group, aggregation="mean"))
    with pytest.raises(ValueError, match="aggregation"):
        check_formed_group(mean_wire, ask, leader, leader_signed)
    with pytest.raises(ValueError, match="aggregation"):
        check_formed_group(
            wire, dataclasses.replace(ask, aggregation="mean"), leader, leader_signed
        )
    for bad, match in (("centered-clip", "canonical"), ("median", "unknown"), ("c" * 100, "long")):
        broken = averaging_pb2.GroupDescription()
        broken.CopyFrom(wire)
        broken.aggregation = bad
        with pytest.raises(ValueError, match=match):
            group_from_proto(broken)


@pytest.mark.timeout(90)
async def test_peers_of_different_rules_form_separate_groups() -> None:
    rules = ["centered-clip", "mean", "centered-clip", "mean"]
    async with averager_swarm(4) as swarm:
        results = await asyncio.gather(
            *(
                p.averager.average(
                    [np.full(1000, float(i), np.float32)],
                    "k",
                    group_size=4,
                    min_group_size=2,
                    timeout=12.0,
                    aggregation=rule,
                )
                for i, (p, rule) in enumerate(zip(swarm.peers, rules, strict=True))
            ),
            return_exceptions=True,
        )
        ok = [r for r in results if isinstance(r, AveragingResult)]
        assert len(ok) == 4, results
        for i, r in enumerate(ok):  # groups {0, 2} (values 0, 2) and {1, 3} (values 1, 3)
            assert r.group_size == 2
            assert r.aggregation == (CLIP if rules[i] != "mean" else "mean")
            assert {ok[j].group_id for j in range(4) if rules[j] == rules[i]} == {r.group_id}
        assert ok[0].group_id != ok[1].group_id
        for i, expected in ((0, 1.0), (2, 1.0), (1, 2.0), (3, 2.0)):
            np.testing.assert_array_equal(ok[i].tensors[0], np.full(1000, expected, np.float32))
