"""Reduce waiting slots filled from one network (medium).

A stream for a group this peer has not started yet waits for it in a slot; there were 64
in all and nothing else. Identities are free and pass the header check, so an outsider
opened 64 signed streams with random group ids from one address and the 65th stream was
refused, an honest member's stream for a real round that registered a moment later
included: that member's part was lost (``failed_parts``). Now the slots are counted per
address range of the connection and per verified sender as well (8 and 4 of the 64 by
default, averaging/allreduce/service.py), so the outsider holds 8 and the honest stream
waits in another.

The attacker's streams come from 127.0.1.1 through a TCP relay (gRPC cannot choose its
source address) and the reducer counts loopback ranges (``limit_local_ranges``), so the
attacker's /24 and the honest members' 127.0.0.0/24 are two networks. The unknown-group
wait (``registration_wait``) is longer than the test, so only the slot limits can let
the honest stream in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.allreduce.runner import run_allreduce
from swarmavg.averaging.allreduce.wire import reduce_digest
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.stubs import REDUCE
from swarmavg.dht import ChannelPool, Identity, RequestSigner
from swarmavg.proto import averaging_pb2
from tests.averaging.allreduce_peers import (
    FAST,
    RUN_ID,
    LocalPeer,
    close_peers,
    make_group,
    start_peers,
)
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(120)

ATTACKER = "127.0.1.1"
"""The attacker's source address: another /24 than the honest members' 127.0.0.1."""
REDUCE_PATH = "/swarmavg.v1.Averaging/Reduce"
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
HONEST = 3
STREAMS = 64  # the default total of waiting slots


def allreduce_config(**settings: Any) -> AllReduceConfig:
    """``FAST`` with ``settings``, leaving out those the code under test does not have (so
    that this file runs, and fails, on the code before the fix too)."""
    names = {f.name for f in dataclasses.fields(AllReduceConfig)}
    return dataclasses.replace(FAST, **{k: v for k, v in settings.items() if k in names})


class SourceRelay:
    """Forwards TCP connections to ``target`` from ``source`` (a loopback address other
    than 127.0.0.1), so that the target sees them come from another network."""

    def __init__(self, target: str, source: str) -> None:
        self.target = target
        self.source = source
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, _, port = self.target.rpartition(":")
        try:
            up_reader, up_writer = await asyncio.open_connection(
                host, int(port), local_addr=(self.source, 0)
            )
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                dst.close()

        tasks = [
            asyncio.create_task(pipe(reader, up_writer)),
            asyncio.create_task(pipe(up_reader, writer)),
        ]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Watched:
    """The target's authenticator, noting every sender it verified (readiness events)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.verified: set[bytes] = set()
        self.checks: collections.Counter[bytes] = collections.Counter()
        self.changed = asyncio.Event()

    def check(self, *args: Any, **kwargs: Any) -> bytes:
        peer_id: bytes = self.inner.check(*args, **kwargs)
        self.verified.add(peer_id)
        self.checks[peer_id] += 1
        self.changed.set()
        return peer_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def reduce_call(channel: grpc.aio.Channel, timeout: float) -> grpc.aio.StreamStreamCall:
    return channel.stream_stream(
        REDUCE_PATH,
        request_serializer=averaging_pb2.ReduceRequest.SerializeToString,
        response_deserializer=averaging_pb2.ReduceResponse.FromString,
    )(timeout=timeout)


def signed_first(
    identity: Identity, receiver: bytes, group_id: bytes
) -> averaging_pb2.ReduceRequest:
    """A valid first message of ``identity`` for ``group_id`` (no chunk: never read)."""
    request = averaging_pb2.ReduceRequest(group_id=group_id, part_index=0, weight=1.0)
    digest = reduce_digest(group_id, 0, 1.0, 0)
    signer = RequestSigner(identity, RUN_ID, lambda: "")
    request.header.CopyFrom(signer.sign(receiver, REDUCE, digest))
    return request


async def honest_round(
    peers: Sequence[LocalPeer], watched: Watched, channels: ChannelPool, seed: int
) -> list[AveragingResult | BaseException]:
    """A round whose reducer of part 0 (peers[0]) starts only once the other members'
    streams for it have reached it and been verified: they must wait for it in slots."""
    rng = np.random.default_rng(seed)
    inputs = [[rng.standard_normal(20_000).astype(np.float32)] for _ in peers]
    group = make_group(peers, inputs[0])
    deadline = time.monotonic() + 30.0

    async def member(i: int) -> AveragingResult:
        return await run_allreduce(
            group,
            i,
            inputs[i],
            1.0,
            deadline=deadline,
            service=peers[i].service,
            channels=channels,
            signer=peers[i].signer,
        )

    expected = {p.identity.peer_id for p in peers[1:]}
    watched.verified -= expected  # verified in an earlier round: not a sign of this one
    senders = [asyncio.create_task(member(i)) for i in range(1, len(peers))]
    async with asyncio.timeout(20.0):
        while not expected <= watched.verified:
            watched.changed.clear()
            await watched.changed.wait()
    results = await asyncio.gather(member(0), *senders, return_exceptions=True)
    mean = weighted_mean([x[0] for x in inputs], [1.0] * len(peers))
    for r in results:
        assert isinstance(r, AveragingResult), r
        assert r.failed_parts == (), r.errors
        assert not r.partial, r.errors
        np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
    return list(results)


@pytest.mark.parametrize(
    ("streams", "one_identity"),
    [(STREAMS, False), (8, True)],
    ids=["fresh-identities", "one-identity"],
)
async def test_one_network_cannot_fill_the_reduce_waiting_slots(
    grpc_servers: GrpcServerPool, streams: int, one_identity: bool
) -> None:
    """``fresh-identities``: 64 streams, each signed by a new identity, from one network:
    it keeps ``max_waiting_per_range`` (8) slots, the honest members' early streams wait in
    others (before: all 64 taken, the honest ones refused). ``one-identity``: 8 streams of
    one identity keep ``max_waiting_per_peer`` (4) slots (before: 8)."""
    config = allreduce_config(registration_wait=15.0, limit_local_ranges=True)
    peers = await start_peers(grpc_servers, HONEST, config, data_plane=False)
    target = peers[0]
    watched = Watched(target.service.authenticator)
    target.service.authenticator = watched  # type: ignore[assignment]
    channels = ChannelPool()
    relay = SourceRelay(target.address, ATTACKER)
    attack: grpc.aio.Channel | None = None
    calls: list[grpc.aio.StreamStreamCall] = []
    watchers: list[asyncio.Task[None]] = []
    try:
        # Control: nobody holds a slot; the members' early streams wait and are served.
        await honest_round(peers, watched, channels, seed=1)

        # Attack: signed streams from one network, each for a random group this peer will
        # never start.
        attack = grpc.aio.insecure_channel(await relay.start(), options=[OWN_CONNECTION])
        ids = [Identity.generate() for _ in range(1 if one_identity else streams)] * (
            streams if one_identity else 1
        )
        ended: set[int] = set()

        async def watch(i: int, call: grpc.aio.StreamStreamCall) -> None:
            with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
                await call.code()
            ended.add(i)
            watched.changed.set()

        for i, identity in enumerate(ids):
            call = reduce_call(attack, 60.0)
            calls.append(call)
            watchers.append(asyncio.create_task(watch(i, call)))
            with contextlib.suppress(grpc.RpcError):
                await call.write(signed_first(identity, target.identity.peer_id, os.urandom(16)))
        # Every attack stream was verified (it then waits, or was refused in that step)
        # or has ended (refused before its message was read).
        async with asyncio.timeout(30.0):
            while not (
                watched.checks[ids[0].peer_id] >= streams
                if one_identity
                else all(i in ended or ids[i].peer_id in watched.verified for i in range(streams))
            ):
                watched.changed.clear()
                await watched.changed.wait()

        # The honest round still runs while the attacker holds what it was given.
        await honest_round(peers, watched, channels, seed=2)
        held = [c for c in calls if not c.done()]
        # The defaults of max_waiting_per_peer and max_waiting_per_range.
        assert 0 < len(held) <= (4 if one_identity else 8)
        exhausted = [
            c for c in calls if c.done() and await c.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        ]
        assert len(exhausted) == streams - len(held)
    finally:
        for call in calls:
            call.cancel()
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        if attack is not None:
            await attack.close()
        await relay.close()
        await channels.close()
        await close_peers(peers)
