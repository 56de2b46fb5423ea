"""Many DHT nodes in one process on 127.0.0.1 with OS-chosen ports."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from swarmavg.dht import DHTConfig, DHTNode, Identity


class Swarm:
    """Nodes started from random earlier nodes; :meth:`close` shuts down every one."""

    def __init__(self, base: DHTConfig, seed: int = 0) -> None:
        self.base = base
        self.nodes: list[DHTNode] = []
        self.rng = random.Random(seed)

    def config(self, **changes: Any) -> DHTConfig:
        return dataclasses.replace(self.base, **changes)

    async def add(
        self,
        n: int = 1,
        identity: Identity | None = None,
        initial_peers: list[str] | None = None,
        listen: str = "127.0.0.1:0",
        **changes: Any,
    ) -> list[DHTNode]:
        """Start ``n`` nodes, each bootstrapped from a random live node unless told otherwise."""
        added = []
        for _ in range(n):
            live = [node.address for node in self.nodes if node.address]
            if initial_peers is not None:
                peers = initial_peers
            else:
                peers = [self.rng.choice(live)] if live else []
            config = self.config(initial_peers=peers, **changes)
            node = await DHTNode.create(config, identity=identity, listen=listen)
            self.nodes.append(node)
            added.append(node)
        return added

    async def stop(self, node: DHTNode) -> None:
        await node.shutdown()
        self.nodes.remove(node)

    async def close(self) -> None:
        for node in self.nodes:
            await node.shutdown()
        self.nodes.clear()


@asynccontextmanager
async def swarm(n: int, seed: int = 0, **config: Any) -> AsyncIterator[Swarm]:
    config.setdefault("run_id", "test")
    s = Swarm(DHTConfig(**config), seed)
    try:
        await s.add(n)
        yield s
    finally:
        await s.close()
