"""A declaration whose first store misses its deadline is retried.

When a whole swarm starts a round at once, the burst of declaration stores can keep the
DHT busy past ``dht_timeout`` (256 peers on two cores: every store did). A peer whose
declaration was never stored is invisible, so it can never lead; when that happens to
every peer, nobody leads and the round fails for all. Here every peer's first store hangs
past its deadline (a slow DHT, seen through a narrow seam around the real node); the
retried stores land and the group forms.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from swarmavg.averaging import Averager
from swarmavg.averaging.matchmaking.matchmaker import MatchmakerConfig
from swarmavg.dht import ChannelPool, DHTConfig, DHTNode
from tests.averaging.averager_swarm import RUN_ID, fast_config


class FirstStoreStalls:
    """The real DHT node, except that its first store never finishes (a DHT too busy to
    answer before the caller's deadline); every other call goes straight through."""

    def __init__(self, node: DHTNode) -> None:
        self._node = node
        self.stalled = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    async def store(self, *args: Any, **kwargs: Any) -> bool:
        """The node's store, whatever its arguments, except that the first one stalls."""
        if self.stalled == 0:
            self.stalled += 1
            await asyncio.Event().wait()  # cancelled by the caller's deadline
        result: bool = await self._node.store(*args, **kwargs)
        return result


@pytest.mark.timeout(60)
async def test_peers_whose_first_declaration_stalled_still_form_a_group() -> None:
    started: list[tuple[grpc.aio.Server, Averager, DHTNode, ChannelPool]] = []
    try:
        wrappers = []
        for _ in range(3):
            channels = ChannelPool()
            initial = [started[0][2].address or ""] if started else []
            node = DHTNode(DHTConfig(run_id=RUN_ID, initial_peers=initial), channels=channels)
            server = grpc.aio.server()
            node.add_to_server(server)
            dht = FirstStoreStalls(node)
            config = fast_config(
                matchmaking_time=10.0,
                matchmaker=MatchmakerConfig(poll_interval=0.3, retry_after=0.3, dht_timeout=0.5),
            )
            averager = Averager(dht, config, channels)  # type: ignore[arg-type]
            averager.add_to_server(server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await node.start(f"127.0.0.1:{port}")
            await averager.start()
            started.append((server, averager, node, channels))
            wrappers.append(dht)
        results = await asyncio.gather(
            *(
                averager.average(
                    [np.full(4, float(i), np.float32)],
                    "k",
                    group_size=3,
                    min_group_size=3,
                    timeout=30,
                )
                for i, (_, averager, _, _) in enumerate(started)
            )
        )
        assert all(w.stalled == 1 for w in wrappers)  # every first store did stall
        for res in results:
            assert res.group_size == 3
            np.testing.assert_array_equal(res.tensors[0], np.full(4, 1.0, np.float32))
    finally:
        for server, averager, node, channels in started:
            await server.stop(None)
            await averager.shutdown(grace=0.0)
            await node.shutdown()
            await channels.close()
