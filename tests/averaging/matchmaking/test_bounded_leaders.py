"""The leader decides, the follower checks; members stream only where it is safe.

Real DHT nodes, real gRPC, real data planes, many peers in one process. A hostile peer
signs its own matchmaking declaration (it may: it owns its subkey) and serves a hostile
``JoinGroup``: it accepts every follower and sends back a group that differs from what the
follower asked for or from what its members signed. Followers refuse such a group, say why,
and form their group among the honest peers. A declaration with ``start=-1e300`` (it would
lead every round) is ignored. A stranger who makes members stream at an unrelated
``host:port`` (a plain TCP listener the test owns) gets no part bytes sent there: a leader
lists only members whose addresses their owners signed, and the data plane sends nothing
before the remote answered its HELLO.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.errors import NoGroupError
from swarmavg.averaging.group import Mode, schema_hash
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
from swarmavg.dht import Identity, RequestSigner
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import RUN_ID, Peer, averager_swarm, fast_config, ranked

pytestmark = pytest.mark.timeout(90)

MARKER = np.float32(1234.5)
"""Every honest input holds this value: its bytes in what the listener got = a part leaked."""


def inputs() -> list[np.ndarray]:
    return [np.full(50_000, MARKER, np.float32)]


class Listener:
    """A plain TCP listener that records every byte it receives and never answers."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while data := await reader.read(1 << 16):
                self.received.extend(data)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    def leaked(self) -> bool:
        return MARKER.tobytes() * 16 in self.received

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


def hostile_declaration(
    attacker: Peer, address: str, start: float, *, data_port: int = 0, bandwidth: float = 1.0
) -> Declaration:
    now = time.time()
    return Declaration(
        peer_id=attacker.peer_id,
        address=address,
        start=start,
        deadline=now + 20,
        give_up=now + 30,
        mode=Mode.NODE,
        bandwidth=bandwidth,
        schema_hash=schema_hash(inputs()),
        group_size=4,
        codec="none",
        data_port=data_port,
        user_data_digest=user_data_digest(b""),
    )


async def sign(attacker: Peer, key: str, declaration: Declaration) -> None:
    subkey = declaration_subkey(attacker.peer_id)
    assert await attacker.node.store(key, declaration.encode(), declaration.give_up, subkey=subkey)


class Forgery(enum.Enum):
    CODEC = "another codec"
    FOREIGN_MEMBER = "a member that signed nothing"
    CHANGED_ENTRY = "the follower's own entry changed"
    CHANGED_MEMBER = "the leader's entry differs from what it signed"


def hostile_join(attacker: Peer, address: str, forgery: Forgery, calls: list[bytes]) -> Any:
    """A JoinGroup that accepts at once and then forms a group of [itself, the follower]."""

    async def join(
        request: averaging_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[averaging_pb2.JoinResponse]:
        calls.append(bytes(request.header.peer_id))
        yield averaging_pb2.JoinResponse(
            code=averaging_pb2.JOIN_ACCEPTED, leader_id=attacker.peer_id
        )
        follower = follower_entry(request)
        me = node_entry(attacker.peer_id, address)
        members = [me, follower]
        codec = "none"
        if forgery is Forgery.CODEC:
            codec = "float16"
        elif forgery is Forgery.FOREIGN_MEMBER:
            members.append(
                averaging_pb2.GroupMember(
                    peer_id=Identity.generate().peer_id,
                    address="127.0.0.1:9",
                    mode=int(Mode.NODE),
                    bandwidth=1.0,
                )
            )
        elif forgery is Forgery.CHANGED_ENTRY:
            follower.bandwidth = 0.0  # the follower would reduce nothing: the leader's choice
        else:
            me.bandwidth = 1e9  # more than it signed: it would reduce everything
        yield formed(attacker.peer_id, members, codec)

    return join


def follower_entry(request: averaging_pb2.JoinRequest) -> averaging_pb2.GroupMember:
    """The asking follower's member entry, exactly as it asked (and signed)."""
    return averaging_pb2.GroupMember(
        peer_id=request.header.peer_id,
        address=request.header.address,
        mode=request.mode,
        bandwidth=request.bandwidth,
        user_data=request.user_data,
        data_port=request.data_port,
    )


def node_entry(peer_id: bytes, address: str) -> averaging_pb2.GroupMember:
    """A member entry as ``hostile_declaration`` signs it (node mode, bandwidth 1)."""
    return averaging_pb2.GroupMember(
        peer_id=peer_id, address=address, mode=int(Mode.NODE), bandwidth=1.0
    )


def formed(
    leader_id: bytes, members: list[averaging_pb2.GroupMember], codec: str = "none"
) -> averaging_pb2.JoinResponse:
    """A leader's ``JOIN_GROUP_FORMED`` answer with a fresh group id over ``inputs()``."""
    return averaging_pb2.JoinResponse(
        code=averaging_pb2.JOIN_GROUP_FORMED,
        leader_id=leader_id,
        group=averaging_pb2.GroupDescription(
            group_id=os.urandom(16),
            members=members,
            schema_hash=schema_hash(inputs()),
            codec=codec,
        ),
    )


@contextlib.asynccontextmanager
async def hostile_server(handler: Any) -> AsyncIterator[str]:
    server = grpc.aio.server()
    handlers = {
        "JoinGroup": grpc.unary_stream_rpc_method_handler(
            handler,
            request_deserializer=averaging_pb2.JoinRequest.FromString,
            response_serializer=averaging_pb2.JoinResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarmavg.v1.Averaging", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def assert_honest_group(results: list[Any], honest: list[Peer]) -> None:
    ok = [r for r in results if isinstance(r, AveragingResult)]
    assert len(ok) == len(honest), results
    for r in ok:
        assert sorted(r.peers) == sorted(p.peer_id.hex() for p in honest)
        assert not r.partial
        np.testing.assert_array_equal(r.tensors[0], inputs()[0])


@pytest.mark.parametrize("forgery", list(Forgery))
async def test_followers_refuse_a_group_the_leader_forged(forgery: Forgery) -> None:
    async with averager_swarm(4) as swarm:
        attacker, *honest = ranked(swarm.peers, "k")  # the leader every honest peer asks
        key = matchmaking_key(RUN_ID, "k", honest[0].averager.group_bits)
        calls: list[bytes] = []
        address_box: list[str] = []

        async def join(request: Any, context: Any) -> AsyncIterator[Any]:
            async for answer in hostile_join(attacker, address_box[0], forgery, calls)(
                request, context
            ):
                yield answer

        async with hostile_server(join) as address:
            address_box.append(address)
            await sign(attacker, key, hostile_declaration(attacker, address, time.time() - 5))
            # No group size: the default cap holds all four, so the split is one group that
            # the attacker leads and every honest peer asks it first. (With a group size of
            # 3 the split was two groups and one honest peer was dealt to the attacker: when
            # a loaded machine made its refusal slow, the honest leader had closed its share
            # of two without it.)
            results = await asyncio.gather(
                *(p.averager.average(inputs(), "k", timeout=15) for p in honest),
                return_exceptions=True,
            )
        assert sorted(set(calls)) == sorted(p.peer_id for p in honest), (
            "not every honest peer asked"
        )
        assert_honest_group(results, honest)
        # The refusers' leader leaves the refused one out of its split and closes when they
        # are in, not at its close deadline (the split kept giving them to the attacker).
        closes = [reason for p in honest for reason in p.averager.matchmaker.closes]
        assert "deadline" not in closes, closes


async def test_a_refused_leader_is_named_when_no_group_forms() -> None:
    async with averager_swarm(2) as swarm:
        attacker, honest = ranked(swarm.peers, "k")
        key = matchmaking_key(RUN_ID, "k", honest.averager.group_bits)
        calls: list[bytes] = []
        address_box: list[str] = []

        async def join(request: Any, context: Any) -> AsyncIterator[Any]:
            async for answer in hostile_join(attacker, address_box[0], Forgery.CODEC, calls)(
                request, context
            ):
                yield answer

        async with hostile_server(join) as address:
            address_box.append(address)
            await sign(attacker, key, hostile_declaration(attacker, address, time.time() - 5))
            with pytest.raises(NoGroupError, match=r"refused: .*codec 'float16'"):
                await honest.averager.average(inputs(), "k", group_size=2, timeout=6)
        assert calls


async def test_a_start_far_in_the_past_does_not_lead() -> None:
    async with averager_swarm(4) as swarm:
        # It ranks first: only its start, outside the window, keeps it from leading.
        attacker, *honest = ranked(swarm.peers, "k")
        key = matchmaking_key(RUN_ID, "k", honest[0].averager.group_bits)
        calls: list[bytes] = []

        async def join(request: Any, context: Any) -> AsyncIterator[Any]:
            calls.append(bytes(request.header.peer_id))
            yield averaging_pb2.JoinResponse(code=averaging_pb2.JOIN_REJECT_NOT_LOOKING)

        async with hostile_server(join) as address:
            await sign(attacker, key, hostile_declaration(attacker, address, -1e300))
            results = await asyncio.gather(
                *(p.averager.average(inputs(), "k", group_size=3, timeout=15) for p in honest),
                return_exceptions=True,
            )
        assert calls == []  # ignored, never asked to lead
        assert_honest_group(results, honest)


class Reflection(enum.Enum):
    UNSIGNED = "unsigned"
    """A JoinRequest names the listener; the stranger signed nothing."""
    SIGNED = "signed"
    """The stranger signed a declaration naming the listener (signing proves nothing about
    who listens there)."""


@pytest.mark.parametrize("how", list(Reflection))
async def test_no_part_is_streamed_at_an_unrelated_port(how: Reflection) -> None:
    listener = Listener()
    await listener.start()
    # Senders drop a member that sends nothing after 2 s, not after the default 20 s, and
    # give up on the listener (no data-plane HELLO, then no gRPC reply) after 2 s and 3 s,
    # not 5 s each: nothing reaches it either way, as the listener's bytes show.
    config = fast_config(allreduce=AllReduceConfig(min_stall=1.0, registration_wait=2.0))
    try:
        async with averager_swarm(3, config) as swarm:
            leader, stranger, other = ranked(swarm.peers, "k")
            key = matchmaking_key(RUN_ID, "k", leader.averager.group_bits)
            target = f"127.0.0.1:{listener.port}"
            first = asyncio.ensure_future(
                leader.averager.average(inputs(), "k", group_size=3, min_group_size=2, timeout=15)
            )
            await swarm.wait_for(
                lambda: any(e[0] is MatchmakingEvent.DECLARED for e in leader.events)
            )
            start = time.time()
            # The leader's own claim: the stranger then reduces a part as large as theirs.
            record = dictionary_entries(await leader.node.get(key, latest=True))
            signed = [decode_declaration(k, v) for k, v in record.items()]
            bandwidth = next(d.bandwidth for d in signed if d and d.peer_id == leader.peer_id)
            if how is Reflection.SIGNED:
                declaration = hostile_declaration(
                    stranger, target, start, data_port=listener.port, bandwidth=bandwidth
                )
                await sign(stranger, key, declaration)
            request = averaging_pb2.JoinRequest(
                key=key,
                schema_hash=schema_hash(inputs()),
                mode=int(Mode.NODE),
                bandwidth=bandwidth,
                declared_start=start,
                data_port=listener.port,
            )
            # Signed by the stranger's own key, from the listener's address: the signature
            # proves who sent it, not who listens there.
            RequestSigner(stranger.node.identity, RUN_ID, lambda: target).signed(
                request, leader.peer_id, JOIN_GROUP
            )
            call = join_group_method(stranger.channels.channel(leader.address))(request, timeout=20)
            try:
                answer = await call.read()
                expected = (
                    averaging_pb2.JOIN_ACCEPTED
                    if how is Reflection.SIGNED
                    else averaging_pb2.JOIN_REJECT_BAD_REQUEST
                )
                assert answer.code == expected, answer
                if how is Reflection.UNSIGNED:  # refused for the missing declaration alone
                    assert answer.detail.startswith("not what you signed:"), answer
                second = other.averager.average(
                    inputs(), "k", group_size=3, min_group_size=2, timeout=15
                )
                results = await asyncio.gather(first, second, return_exceptions=True)
            finally:
                call.cancel()
            ok = [r for r in results if isinstance(r, AveragingResult)]
            assert len(ok) == 2, results
            if how is Reflection.UNSIGNED:
                assert all(stranger.peer_id.hex() not in r.peers for r in ok)
            else:  # in the group, but nothing was pumped at its address: its part stayed local
                for r in ok:
                    assert r.partial
                    assert r.peers.index(stranger.peer_id.hex()) in r.failed_parts
        assert not listener.leaked(), f"{len(listener.received)} bytes reached the listener"
    finally:
        await listener.close()
