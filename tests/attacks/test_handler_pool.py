"""The gRPC handler pool held by one address (high).

``maximum_concurrent_rpcs`` (2048) is server-wide, and a ``Reduce`` stream that never sent
a message held its handler for ``registration_wait`` (5 s) before any check: one address
held all 2048 handlers and an honest DHT ``Ping`` got ``RESOURCE_EXHAUSTED``. grpc.aio
cannot bound handlers per source, so our handlers do: every call counts against its
connection's address range first (dht/server_limits.py, ``max_rpcs_per_range``), the
``Reduce`` streams of one range that serve no round yet are bounded again in the service
(``max_pending_per_range``), a call over either share is refused at once (its handler is
free again in the same step), and a silent stream is cut after ``first_message_timeout``.

Same class at a smaller scale: a server of 128 handlers, 128 silent streams from
127.0.1.1 (through a TCP relay; the server counts loopback ranges), deadlines longer than
the test. The honest ``Ping`` comes from 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import grpc
import pytest

from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.service import add_reduce_to_server
from swarmavg.dht import Authenticator, DHTConfig, DHTNode, Identity
from swarmavg.dht.server_limits import ServerLimits, make_server
from swarmavg.proto import averaging_pb2
from tests.attacks.test_reduce_slots import (
    ATTACKER,
    OWN_CONNECTION,
    SourceRelay,
    allreduce_config,
    reduce_call,
)
from tests.averaging.allreduce_peers import RUN_ID

pytestmark = pytest.mark.timeout(120)

HANDLERS = 128
"""The server's whole pool here (2048 by default): the attack uses every handler."""


def server_limits(**settings: Any) -> ServerLimits:
    """``ServerLimits`` with ``settings``, leaving out those the code under test lacks."""
    names = {f.name for f in dataclasses.fields(ServerLimits)}
    return ServerLimits(**{k: v for k, v in settings.items() if k in names})


class Target:
    """One server with the DHT and ``Reduce``, as a daemon's public server has."""

    def __init__(self, limits: ServerLimits) -> None:
        self.server = make_server(limits)
        self.node = DHTNode(DHTConfig(run_id=RUN_ID))
        self.node.add_to_server(self.server)
        config = allreduce_config(registration_wait=60.0, limit_local_ranges=True)
        self.service = AllReduceService(Authenticator(Identity.generate(), RUN_ID), config)
        add_reduce_to_server(self.service, self.server)
        self.address = ""

    async def start(self) -> None:
        port = self.server.add_insecure_port("127.0.0.1:0")
        assert port
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        await self.node.start(self.address)

    async def close(self) -> None:
        await self.node.shutdown()
        await self.server.stop(None)
        await self.service.close()


async def settle(service: AllReduceService, calls: list[grpc.aio.StreamStreamCall]) -> set[int]:
    """Wait until every call is in a ``Reduce`` handler of ``service`` or has ended; return
    the ended ones (filled on as more end)."""
    ended: set[int] = set()
    changed = asyncio.Event()

    async def watch(i: int, call: grpc.aio.StreamStreamCall) -> None:
        with contextlib.suppress(grpc.RpcError):
            await call.code()
        ended.add(i)
        changed.set()

    watchers = [asyncio.create_task(watch(i, c)) for i, c in enumerate(calls)]
    try:
        async with asyncio.timeout(30.0):
            while service.inbound.value + len(ended) < len(calls):
                seen = service.inbound.value
                changed.clear()
                moved = asyncio.create_task(
                    service.inbound.wait_until(lambda n, seen=seen: n != seen)
                )
                ended_one = asyncio.create_task(changed.wait())
                try:
                    await asyncio.wait({moved, ended_one}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    moved.cancel()
                    ended_one.cancel()
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    return ended


@pytest.mark.parametrize("per_range", [16, HANDLERS], ids=["range-share", "reduce-pending"])
async def test_silent_streams_from_one_address_leave_handlers_for_a_ping(per_range: int) -> None:
    """``range-share``: the server's per-range share (16) binds first; ``reduce-pending``:
    the share is the whole pool and the service's bound on streams not serving a round
    yet (32 by default) binds."""
    limits = server_limits(
        max_concurrent_rpcs=HANDLERS, max_rpcs_per_range=per_range, limit_local_ranges=True
    )
    target = Target(limits)
    await target.start()
    pinger = await DHTNode.create(DHTConfig(run_id=RUN_ID))
    relay = SourceRelay(target.address, ATTACKER)
    attack: grpc.aio.Channel | None = None
    calls: list[grpc.aio.StreamStreamCall] = []
    try:
        # Control: the pool is free.
        peer_id = target.node.identity.peer_id
        contact = await pinger.protocol.call_ping(target.address, expected_id=peer_id)
        assert contact.peer_id == peer_id

        # Attack: as many silent Reduce streams as the server has handlers, one connection.
        attack = grpc.aio.insecure_channel(await relay.start(), options=[OWN_CONNECTION])
        calls = [reduce_call(attack, 90.0) for _ in range(HANDLERS)]
        ended = await settle(target.service, calls)
        assert len(ended) < HANDLERS  # the attacker holds handlers

        # An honest Ping from another network is served meanwhile.
        contact = await pinger.protocol.call_ping(target.address, expected_id=peer_id)
        assert contact.peer_id == peer_id

        # What the attacker did not get was refused at once, for want of its share.
        pending = getattr(target.service.config, "max_pending_per_range", HANDLERS)
        share = min(per_range, pending)
        exhausted = [
            c for c in calls if c.done() and await c.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        ]
        assert len(exhausted) >= HANDLERS - share
    finally:
        for call in calls:
            call.cancel()
        if attack is not None:
            await attack.close()
        await relay.close()
        await pinger.shutdown()
        await target.close()


async def test_a_silent_stream_is_cut_long_before_its_deadline() -> None:
    """A stream that sends nothing (from an exempt loopback source: no range share
    applies) is cut with ``INVALID_ARGUMENT`` after ``first_message_timeout``, though its
    own deadline and the round-start wait are far longer. Before, it kept its handler for
    ``registration_wait`` (60 s here), past the call's 20 s deadline. Control: a stream
    that does send a message is answered on its merits (UNAUTHENTICATED)."""
    target = Target(server_limits())
    await target.start()
    channel = grpc.aio.insecure_channel(target.address, options=[OWN_CONNECTION])
    try:
        control = reduce_call(channel, 20.0)
        await control.write(averaging_pb2.ReduceRequest())
        assert await control.code() is grpc.StatusCode.UNAUTHENTICATED

        silent = reduce_call(channel, 20.0)
        code = await silent.code()
        assert code is grpc.StatusCode.INVALID_ARGUMENT, code
        assert "no first message" in (await silent.details() or "")
    finally:
        await channel.close()
        await target.close()
