"""Matchmaking over real DHT nodes and real gRPC, many peers in one process."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from swarmavg.averaging.errors import NoGroupError, SchemaMismatchError
from swarmavg.averaging.group import Mode
from swarmavg.averaging.matchmaking.declarations import (
    Declaration,
    declaration_subkey,
    decode_declaration,
    user_data_digest,
)
from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.matchmaking.matchmaker import MatchmakingEvent, dictionary_entries
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.stubs import JOIN_GROUP, join_group_method
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import RUN_ID, AveragerSwarm, Peer, averager_swarm, ranked


def inputs(i: int) -> list[np.ndarray]:
    return [np.full((3, 4), float(i), dtype=np.float32), np.arange(5, dtype=np.float64) * i]


async def average_all(
    swarm: AveragerSwarm, key: str = "k", **kwargs: object
) -> list[AveragingResult | BaseException]:
    return await asyncio.gather(
        *(
            p.averager.average(inputs(i), key, **kwargs)  # type: ignore[arg-type]
            for i, p in enumerate(swarm.peers)
        ),
        return_exceptions=True,
    )


@pytest.mark.parametrize("n", [2, 5, 8])
@pytest.mark.timeout(60)
async def test_peers_form_one_group(n: int) -> None:
    async with averager_swarm(n) as swarm:
        results = await average_all(swarm, group_size=n, min_group_size=n, timeout=20.0)
        assert all(isinstance(r, AveragingResult) for r in results), results
        ok = [r for r in results if isinstance(r, AveragingResult)]
        assert {r.group_id for r in ok} == {ok[0].group_id}
        assert sorted(ok[0].peers) == sorted(p.peer_id.hex() for p in swarm.peers)
        expected = np.mean([inputs(i)[0] for i in range(n)], axis=0)
        for r in ok:
            assert r.group_size == n
            assert not r.partial
            np.testing.assert_array_equal(r.tensors[0], expected)


@pytest.mark.timeout(60)
async def test_group_size_cap_splits_into_groups() -> None:
    async with averager_swarm(8) as swarm:
        results = await average_all(swarm, group_size=4, min_group_size=4, timeout=20.0)
        ok = [r for r in results if isinstance(r, AveragingResult)]
        assert len(ok) == 8, results
        groups: dict[str, set[str]] = {}
        for p, r in zip(swarm.peers, ok, strict=True):
            groups.setdefault(r.group_id, set()).add(p.peer_id.hex())
            assert r.group_size == 4
        assert sorted(len(g) for g in groups.values()) == [4, 4]
        assert set().union(*groups.values()) == {p.peer_id.hex() for p in swarm.peers}


@pytest.mark.timeout(60)
async def test_too_few_peers_raise_no_group_within_timeout() -> None:
    async with averager_swarm(3) as swarm:
        timeout = 4.0
        started = time.monotonic()
        results = await average_all(swarm, group_size=4, min_group_size=4, timeout=timeout)
        elapsed = time.monotonic() - started
        assert all(isinstance(r, NoGroupError) for r in results), results
        assert "min_group_size is 4" in str(results[0])
        assert elapsed < timeout  # matchmaking gives up at its share of the timeout


@pytest.mark.timeout(60)
async def test_schema_mismatch_is_reported() -> None:
    async with averager_swarm(2) as swarm:
        a, b = swarm.peers
        # A call budget of 600 s (give-up at 300 s) against the test's 60: the mismatch is
        # said at the round's close deadline, not at its give-up time.
        results = await asyncio.gather(
            a.averager.average([np.zeros(4, np.float32)], "k", timeout=600.0),
            b.averager.average([np.zeros(5, np.float32)], "k", timeout=600.0),
            return_exceptions=True,
        )
        assert all(isinstance(r, SchemaMismatchError) for r in results), results
        # each side names its own layout, so the two messages show what differs
        assert "ours: 1 tensor: float32[4]" in str(results[0]), results[0]
        assert "ours: 1 tensor: float32[5]" in str(results[1]), results[1]
        assert "schema" in str(results[0])


@pytest.mark.timeout(60)
async def test_mismatched_peer_does_not_stop_the_others() -> None:
    async with averager_swarm(4) as swarm:
        odd, *rest = swarm.peers
        results = await asyncio.gather(
            odd.averager.average([np.zeros(7, np.float32)], "k", timeout=6.0),
            *(
                p.averager.average([np.full(4, i, np.float32)], "k", group_size=3, timeout=10.0)
                for i, p in enumerate(rest)
            ),
            return_exceptions=True,
        )
        assert isinstance(results[0], SchemaMismatchError), results
        ok = [r for r in results[1:] if isinstance(r, AveragingResult)]
        assert len(ok) == 3, results
        assert all(r.group_size == 3 for r in ok)
        np.testing.assert_array_equal(ok[0].tensors[0], np.full(4, 1.0, np.float32))


async def declarations(peer: Peer, key: str) -> dict[bytes, Declaration]:
    record = await peer.node.get(key, latest=True)
    found = {}
    for subkey, value in dictionary_entries(record).items():
        d = decode_declaration(subkey, value)
        if d is not None:
            found[d.peer_id] = d
    return found


async def declare(peer: Peer, key: str, schema: bytes, start: float) -> None:
    """Store a declaration signed by ``peer`` (a hand-made follower): a leader takes only
    followers whose requests match what they signed."""
    declaration = Declaration(
        peer_id=peer.peer_id,
        address=peer.address,
        start=start,
        deadline=start,
        give_up=time.time() + 30,
        mode=Mode.NODE,
        bandwidth=0.0,
        schema_hash=schema,
        group_size=2,
        codec="none",
        user_data_digest=user_data_digest(b""),
    )
    subkey = declaration_subkey(peer.peer_id)
    assert await peer.node.store(key, declaration.encode(), declaration.give_up, subkey=subkey)


@pytest.mark.timeout(60)
async def test_simultaneous_mutual_join_does_not_deadlock() -> None:
    """Two leaders asking each other at once both get an answer at once.

    In the protocol a peer only asks peers that rank before it, so this cannot happen
    between honest peers with one view of the DHT; the leader-side rule must still make it
    harmless. Different schemas keep both peers looking (neither asks the other), then each
    is asked by the other at the same moment.
    """
    async with averager_swarm(2) as swarm:
        a, b = swarm.peers
        key = matchmaking_key(RUN_ID, "k", a.averager.group_bits)
        rounds = [
            asyncio.ensure_future(
                p.averager.average([np.zeros(i + 1, np.float32)], "k", timeout=6.0)
            )
            for i, p in enumerate((a, b))
        ]
        await swarm.wait_for(
            lambda: all(any(e[0] is MatchmakingEvent.DECLARED for e in p.events) for p in (a, b))
        )
        found: dict[bytes, Declaration] = {}
        async with asyncio.timeout(10):
            while len(found) < 2:
                found = await declarations(a, key)

        def ask(asker: Peer, leader: Peer) -> grpc.aio.UnaryStreamCall:
            d = found[asker.peer_id]
            request = averaging_pb2.JoinRequest(
                key=key,
                schema_hash=found[leader.peer_id].schema_hash,
                mode=int(d.mode),
                bandwidth=d.bandwidth,
                declared_start=d.start,
                data_port=d.data_port,  # a leader takes only what the follower signed
            )
            asker.node.signer.signed(request, leader.peer_id, JOIN_GROUP)
            return join_group_method(asker.channels.channel(leader.address))(request, timeout=10)

        calls = [ask(a, b), ask(b, a)]
        try:
            async with asyncio.timeout(5):  # answers come at once: no one waits on the other
                first = await asyncio.gather(*(c.read() for c in calls))
        finally:
            for c in calls:
                c.cancel()  # the accepted side's stream vanishes: the leader forgets it
        codes = sorted(m.code for m in first)
        assert codes == sorted([averaging_pb2.JOIN_ACCEPTED, averaging_pb2.JOIN_REJECT_NOT_LEADER])
        results = await asyncio.gather(*rounds, return_exceptions=True)
        assert all(isinstance(r, SchemaMismatchError) for r in results), results
        # Both still serve and group normally afterwards.
        again = await average_all(swarm, "k2", group_size=2, timeout=10.0)
        assert all(isinstance(r, AveragingResult) for r in again), again


@pytest.mark.timeout(60)
async def test_bad_join_requests_get_explicit_codes_and_change_nothing() -> None:
    async with averager_swarm(3) as swarm:
        # The stranger ranks before the leader: whatever start it declares, it would lead.
        stranger, leader, late = ranked(swarm.peers, "k")
        key = matchmaking_key(RUN_ID, "k", leader.averager.group_bits)
        round_ = asyncio.ensure_future(
            leader.averager.average(inputs(0), "k", group_size=2, timeout=12.0)
        )
        await swarm.wait_for(lambda: any(e[0] is MatchmakingEvent.DECLARED for e in leader.events))
        schema = (await declarations(leader, key))[leader.peer_id].schema_hash

        async def ask(**fields: object) -> averaging_pb2.JoinResponse:
            request = averaging_pb2.JoinRequest(
                key=key, schema_hash=schema, declared_start=time.time() + 100
            )
            for name, value in fields.items():
                if name != "header":
                    setattr(request, name, value)
            stranger.node.signer.signed(request, leader.peer_id, JOIN_GROUP)
            if "header" in fields:
                request.header.CopyFrom(fields["header"])  # type: ignore[arg-type]
            call = join_group_method(stranger.channels.channel(leader.address))(request, timeout=5)
            try:
                return await call.read()  # type: ignore[no-any-return]
            finally:
                call.cancel()

        forged = stranger.node.identity.make_header(RUN_ID)
        forged.peer_id = late.peer_id  # claims another peer's id with its own key
        wrong_run = stranger.node.identity.make_header("other-run")
        cases = [
            ({"header": forged}, averaging_pb2.JOIN_REJECT_BAD_REQUEST),
            ({"header": wrong_run}, averaging_pb2.JOIN_REJECT_BAD_REQUEST),
            ({"key": "test.other.0b"}, averaging_pb2.JOIN_REJECT_NOT_LOOKING),
            ({"user_data": b"x" * 100_000}, averaging_pb2.JOIN_REJECT_BAD_REQUEST),
            ({"schema_hash": b"short"}, averaging_pb2.JOIN_REJECT_BAD_REQUEST),
            ({"schema_hash": b"y" * 32}, averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH),
            ({"mode": 42}, averaging_pb2.JOIN_REJECT_BAD_REQUEST),
            ({"bandwidth": float("nan")}, averaging_pb2.JOIN_REJECT_BAD_REQUEST),
            ({"declared_start": time.time() + 20}, averaging_pb2.JOIN_REJECT_NOT_LEADER),
        ]
        for fields, code in cases:
            answer = await ask(**fields)
            assert answer.code == code, (fields, answer)
        # The leader still forms its group with an honest peer afterwards.
        other = await late.averager.average(inputs(2), "k", group_size=2, timeout=12.0)
        result = await round_
        assert result.group_id == other.group_id
        assert sorted(result.peers) == sorted([leader.peer_id.hex(), late.peer_id.hex()])


@pytest.mark.timeout(60)
async def test_repeated_join_supersedes_the_stale_stream() -> None:
    async with averager_swarm(3) as swarm:
        leader, stranger, late = ranked(swarm.peers, "k")
        key = matchmaking_key(RUN_ID, "k", leader.averager.group_bits)
        round_ = asyncio.ensure_future(
            leader.averager.average(inputs(0), "k", group_size=3, timeout=12.0)
        )
        await swarm.wait_for(lambda: any(e[0] is MatchmakingEvent.DECLARED for e in leader.events))
        schema = (await declarations(leader, key))[leader.peer_id].schema_hash
        start = time.time() + 1
        await declare(stranger, key, schema, start)

        def join_request() -> averaging_pb2.JoinRequest:
            request = averaging_pb2.JoinRequest(key=key, schema_hash=schema, declared_start=start)
            return stranger.node.signer.signed(request, leader.peer_id, JOIN_GROUP)

        method = join_group_method(stranger.channels.channel(leader.address))
        first, second = method(join_request(), timeout=10), None
        try:
            assert (await first.read()).code == averaging_pb2.JOIN_ACCEPTED
            second = method(join_request(), timeout=10)  # signed anew: a copy is a replay
            assert (await second.read()).code == averaging_pb2.JOIN_ACCEPTED
            assert (await first.read()).code == averaging_pb2.JOIN_DISBANDED
        finally:
            first.cancel()
            if second is not None:
                second.cancel()  # the stranger vanishes: it is not in the group
        await swarm.wait_for(
            lambda: any(
                e[0] is MatchmakingEvent.FOLLOWER_LEFT and e[2] == stranger.peer_id
                for e in leader.events
            )
        )
        other = await late.averager.average(inputs(2), "k", group_size=3, timeout=12.0)
        result = await round_
        assert sorted(result.peers) == sorted([leader.peer_id.hex(), late.peer_id.hex()])
        assert other.group_id == result.group_id


@pytest.mark.timeout(60)
async def test_a_peer_whose_inputs_fail_their_check_while_it_declares_joins_no_group() -> None:
    """The daemon checks a client's tensors while matchmaking declares; a failed check
    ends the search before any group counts the peer, and the others form no group
    with it."""
    from swarmavg.averaging.errors import InvalidTensorsError
    from swarmavg.averaging.request import RoundRequest, check_tensors

    async with averager_swarm(2) as swarm:
        bad, good = swarm.peers
        ready: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        request = RoundRequest.build(key="k", weight=1.0, timeout=6.0, group_size=2)
        failing = asyncio.ensure_future(
            bad.averager.run(check_tensors(inputs(0)), request, inputs_ready=ready)
        )
        await swarm.wait_for(lambda: any(e[0] is MatchmakingEvent.DECLARED for e in bad.events))
        other = asyncio.ensure_future(
            good.averager.average(inputs(1), "k", group_size=2, timeout=6.0)
        )
        await swarm.wait_for(lambda: any(e[0] is MatchmakingEvent.DECLARED for e in good.events))
        ready.set_exception(InvalidTensorsError("tensor 0 holds 1 NaN/Inf value(s)"))
        with pytest.raises(InvalidTensorsError):
            await failing
        with pytest.raises(NoGroupError):
            await other


async def test_a_member_that_left_its_stream_is_told_the_group_when_it_asks_again() -> None:
    """A follower that gave up on its stream after the leader had seated it (the first
    answer came after its join_timeout on a busy loop) is in the group the others average
    now: asking again, it gets that group, not a refusal (at 256 peers such a
    member failed its round and left every member of its group with partial results)."""
    async with averager_swarm(2) as swarm:
        leader, follower = ranked(swarm.peers, "k")
        key = matchmaking_key(RUN_ID, "k", leader.averager.group_bits)
        round_ = asyncio.ensure_future(
            leader.averager.average(inputs(0), "k", group_size=2, timeout=12.0)
        )
        await swarm.wait_for(lambda: any(e[0] is MatchmakingEvent.DECLARED for e in leader.events))
        schema = (await declarations(leader, key))[leader.peer_id].schema_hash
        start = time.time() + 1
        await declare(follower, key, schema, start)
        method = join_group_method(follower.channels.channel(leader.address))

        async def ask(declared_start: float) -> averaging_pb2.JoinResponse:
            request = averaging_pb2.JoinRequest(
                key=key, schema_hash=schema, declared_start=declared_start
            )
            call = method(follower.node.signer.signed(request, leader.peer_id, JOIN_GROUP))
            try:
                return await call.read()  # type: ignore[no-any-return]
            finally:
                call.cancel()  # leaves the stream after its first answer

        assert (await ask(start)).code == averaging_pb2.JOIN_ACCEPTED  # group of 2: closed
        await swarm.wait_for(
            lambda: any(e[0] is MatchmakingEvent.GROUP_FORMED for e in leader.events)
        )
        again = await ask(start)
        assert again.code == averaging_pb2.JOIN_GROUP_FORMED, again
        assert sorted(bytes(m.peer_id) for m in again.group.members) == sorted(
            [leader.peer_id, follower.peer_id]
        )
        # Another round of the same peer under a reused key is not that seat.
        assert (await ask(start + 5)).code == averaging_pb2.JOIN_REJECT_FULL
        round_.cancel()
        await asyncio.gather(round_, return_exceptions=True)
