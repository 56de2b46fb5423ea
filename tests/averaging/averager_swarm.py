"""Many averaging peers in one process: real DHT nodes, real gRPC servers on port 0.

Each peer runs one ``grpc.aio`` server carrying both the DHT and the Averaging service,
with one shared :class:`ChannelPool`, exactly as the daemon wires them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.averager import Averager, AveragerConfig
from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.matchmaking.matchmaker import MatchmakerConfig, MatchmakingEvent
from swarmavg.dht import ChannelPool, DHTConfig, DHTNode

RUN_ID = "test"


@dataclass
class Peer:
    """One in-process peer."""

    node: DHTNode
    averager: Averager
    server: grpc.aio.Server
    channels: ChannelPool
    address: str
    events: list[tuple[MatchmakingEvent, str, bytes]] = field(default_factory=list)
    stopped: bool = False

    @property
    def peer_id(self) -> bytes:
        return self.node.peer_id

    async def stop(self) -> None:
        """Stop serving at once (streams in flight are aborted), then release everything."""
        if self.stopped:
            return
        self.stopped = True
        await self.server.stop(None)
        await self.averager.shutdown(grace=0.0)
        await self.node.shutdown()
        await self.channels.close()


class AveragerSwarm:
    """Peers bootstrapped from the first one; :meth:`close` stops every one."""

    def __init__(self) -> None:
        self.peers: list[Peer] = []
        self.changed = asyncio.Event()

    async def add(
        self, config: AveragerConfig, client_mode: bool = False, **averager_kwargs: Any
    ) -> Peer:
        """Start one peer; a ``client_mode`` peer serves nothing (its server stays unbound)."""
        channels = ChannelPool()
        initial = [self.peers[0].address] if self.peers else []
        node = DHTNode(
            DHTConfig(run_id=RUN_ID, initial_peers=initial, client_mode=client_mode),
            channels=channels,
        )
        server = grpc.aio.server()
        if not client_mode:
            node.add_to_server(server)
        events: list[tuple[MatchmakingEvent, str, bytes]] = []

        def observe(event: MatchmakingEvent, key: str, other: bytes) -> None:
            events.append((event, key, other))
            self.changed.set()

        averager = Averager(node, config, channels, observer=observe, **averager_kwargs)
        if client_mode:
            address = ""
            await node.start(None)
        else:
            averager.add_to_server(server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            address = f"127.0.0.1:{port}"
            await node.start(address)
        await averager.start()
        peer = Peer(node, averager, server, channels, address, events)
        self.peers.append(peer)
        return peer

    async def wait_for(self, predicate: Any, timeout: float = 20.0) -> None:
        """Wait until ``predicate()`` holds, re-checked on every matchmaking event."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        for peer in self.peers:
            with contextlib.suppress(Exception):
                await peer.stop()
        self.peers.clear()


def fast_config(**changes: Any) -> AveragerConfig:
    """Settings for tests on a loaded machine: short windows, frequent polls.

    All peers of a test share one event loop on two busy cores, so a member can lag by
    seconds; the all-reduce's stall patience is raised so that such lag is not taken for
    a dead sender (these tests are about matchmaking; stalls are tested in
    allreduce/test_allreduce*.py).
    """
    base: dict[str, Any] = {
        "matchmaking_time": 1.5,
        "matchmaker": MatchmakerConfig(poll_interval=0.3, retry_after=0.3),
        "allreduce": AllReduceConfig(min_stall=10.0),
    }
    base.update(changes)
    return AveragerConfig(**base)


@contextlib.asynccontextmanager
async def averager_swarm(
    n: int, config: AveragerConfig | None = None
) -> AsyncIterator[AveragerSwarm]:
    swarm = AveragerSwarm()
    try:
        for _ in range(n):
            await swarm.add(config or fast_config())
        yield swarm
    finally:
        await swarm.close()


def ranked(peers: list[Peer], name: str) -> list[Peer]:
    """``peers`` in leader order under round ``name`` (the first leads them all).

    Leadership goes by a hash of the round key and the peer id (matchmaking/declarations.py,
    ``leader_order``), so a test that needs "the leader" and "a follower" picks its roles
    by rank, not by who calls first.
    """
    # Imported here: benchmarks load these helpers against older checkouts too.
    from swarmavg.averaging.matchmaking.declarations import leader_order

    def order(peer: Peer) -> tuple[bytes, bytes]:
        key = matchmaking_key(RUN_ID, name, peer.averager.group_bits)
        return leader_order(key, peer.peer_id)

    return sorted(peers, key=order)


def name_where_first(
    first: bytes, others: list[bytes], group_bits: str = "", prefix: str = "k"
) -> str:
    """A round name (``prefix`` and a number: one key family) under which peer ``first``
    ranks before every one of ``others``: it is the leader everyone asks first."""
    from swarmavg.averaging.matchmaking.declarations import leader_order

    for i in range(100_000):
        name = f"{prefix}{i}"
        key = matchmaking_key(RUN_ID, name, group_bits)
        mine = leader_order(key, first)
        if all(mine < leader_order(key, other) for other in others):
            return name
    raise AssertionError("no such name in 100,000 tries")
