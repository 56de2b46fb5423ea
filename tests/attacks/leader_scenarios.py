"""Hostile leaders built over the real code, shared by the leader attack tests and
``tests/attacks/leader_report.py``.

Nothing here imports what only the rank-ordered matchmaking has, so the benchmark can
load these scenarios against older code too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from swarmavg.averaging.matchmaking.round import Round
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import Peer
from tests.averaging.matchmaking.test_bounded_leaders import (
    follower_entry,
    formed,
    hostile_declaration,
    node_entry,
    sign,
)

EARLY_CLAIM = 590.0
"""Seconds before now the early claimer says it started (the window accepts 600)."""
SYBIL_NET = "100.64.7"
"""Where the sybils say they listen: shared (carrier-grade NAT) address space counts as a
public range (it is not a private network) and is routed nowhere on the internet."""

JoinHandler = Callable[
    [averaging_pb2.JoinRequest, grpc.aio.ServicerContext[Any, Any]],
    AsyncIterator[averaging_pb2.JoinResponse],
]


def claim_early_starts(peer: Peer) -> None:
    """Make ``peer``'s real matchmaker sign declarations that started EARLY_CLAIM ago.

    Everything else stays the real code: the signed start, the start its join requests
    repeat and the one it answers with as a leader are the same value.
    """
    matchmaker = peer.averager.matchmaker
    honest_declare = matchmaker._declare

    async def declare_early(self: Any, rnd: Round) -> None:
        rnd.me = dataclasses.replace(rnd.me, start=rnd.me.start - EARLY_CLAIM)
        await honest_declare(rnd)

    matchmaker._declare = types.MethodType(declare_early, matchmaker)  # type: ignore[method-assign]


def silent_join(attacker: Peer, accepted: list[bytes]) -> JoinHandler:
    """A ``JoinGroup`` that accepts every follower and never closes (the stream ends when
    the follower leaves)."""

    async def join(
        request: averaging_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[averaging_pb2.JoinResponse]:
        accepted.append(bytes(request.header.peer_id))
        yield averaging_pb2.JoinResponse(
            code=averaging_pb2.JOIN_ACCEPTED, leader_id=attacker.peer_id
        )
        await asyncio.Event().wait()

    return join


def sybil_address(i: int) -> str:
    return f"{SYBIL_NET}.{10 + i}:31337"


def sybil_join(
    attacker: Peer, address: list[str], sybils: list[Peer], asked: list[bytes]
) -> JoinHandler:
    """A ``JoinGroup`` that accepts and forms a group of itself (at ``address[0]``, known
    once its server is bound), the follower and every sybil at its signed address."""

    async def join(
        request: averaging_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[averaging_pb2.JoinResponse]:
        asked.append(bytes(request.header.peer_id))
        yield averaging_pb2.JoinResponse(
            code=averaging_pb2.JOIN_ACCEPTED, leader_id=attacker.peer_id
        )
        members = [
            node_entry(attacker.peer_id, address[0]),
            follower_entry(request),
            *(node_entry(s.peer_id, sybil_address(i)) for i, s in enumerate(sybils)),
        ]
        yield formed(attacker.peer_id, members)

    return join


async def stage(attack: bool, attacker: Peer, address: str, key: str) -> None:
    """Attack: sign the attacker's declaration under ``key`` with a start a little early
    (by which it led when the earliest start led; now its rank makes it lead). Control:
    stop the attacker, so that the honest peers run the same round without it."""
    if attack:
        await sign(attacker, key, hostile_declaration(attacker, address, time.time() - 5))
    else:
        await attacker.stop()


async def sign_sybils(sybils: list[Peer], key: str) -> None:
    """One declaration per sybil at its own address in SYBIL_NET, signed by its owner."""
    now = time.time()
    for i, sybil in enumerate(sybils):
        await sign(sybil, key, hostile_declaration(sybil, sybil_address(i), now))
