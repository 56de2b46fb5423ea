"""The confirmed wipe through the client API, against real daemons (docs/dht.md, "Owned
(signed) records").

``client.dht.store(f"{run}.{key}.0b", "x", ttl=3600)`` used to make every honest peer's next
``average`` under that key fail with ``NoGroupError``; the same at ``{run}.state`` hid every
published state, and at ``{run}.progress`` every peer's training progress. The daemon now
refuses such a store with a clear ``ValidationError``, and the run keeps working.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.peer import Peer, PeerConfig, connect
from swarmavg.peer.client.errors import ValidationError

pytestmark = pytest.mark.timeout(90)

RUN = "t"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


@pytest.fixture
async def peers(sock_dir: Path) -> AsyncIterator[tuple[Peer, Peer]]:
    first = PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "a.sock"), run_id=RUN)
    async with Peer(first) as a:
        assert a.address is not None
        second = PeerConfig(
            listen="127.0.0.1:0", control=str(sock_dir / "b.sock"), run_id=RUN, join=[a.address]
        )
        async with Peer(second) as b:
            yield a, b


async def attack(peer: Peer, key: str) -> None:
    """The attacker's one call: a plain value with a long TTL at a protocol key."""
    async with peer.client() as client:
        with pytest.raises(ValidationError, match="accept only owner-signed"):
            await client.dht.store(key, "x", ttl=3600)
        with pytest.raises(ValidationError, match="owner"):  # an unowned subkey neither
            await client.dht.store(key, {"epoch": 2**50}, ttl=3600, subkey="evil")


async def test_plain_value_at_a_matchmaking_key_is_refused_and_rounds_still_work(
    peers: tuple[Peer, Peer],
) -> None:
    a, b = peers
    await attack(b, f"{RUN}.k.0b")
    async with a.client() as ca, b.client() as cb:
        x, y = np.zeros(1000, np.float32), np.ones(1000, np.float32)
        ra, rb = await asyncio.gather(
            ca.average([x], key="k", group_size=2, timeout=20),
            cb.average([y], key="k", group_size=2, timeout=20),
        )
    assert ra.group_size == rb.group_size == 2
    np.testing.assert_allclose(ra.tensors[0], 0.5)


async def test_plain_value_at_the_state_key_is_refused_and_state_still_loads(
    peers: tuple[Peer, Peer],
) -> None:
    a, b = peers
    await attack(b, f"{RUN}.state")
    async with a.client() as ca, b.client() as cb:
        await ca.publish_state([np.arange(10, dtype=np.float32)], b"meta")
        metadata, tensors = await cb.load_state(timeout=20)
    assert metadata == b"meta"
    np.testing.assert_array_equal(tensors[0], np.arange(10, dtype=np.float32))


async def test_plain_value_at_a_progress_key_is_refused_and_progress_still_adds_up(
    peers: tuple[Peer, Peer],
) -> None:
    a, b = peers
    await attack(b, f"{RUN}.progress")
    endpoints = (str(a.control), str(b.control))

    def train() -> tuple[int, int]:  # the training processes, blocking clients in a thread
        with connect(endpoints[0]) as client_a, connect(endpoints[1]) as client_b:
            first = ProgressTracker(client_a, RUN, target_batch_size=100)
            second = ProgressTracker(client_b, RUN, target_batch_size=100)
            first.add_samples(30)
            second.add_samples(20)
            assert first.report()
            assert second.report()
            seen = second.refresh()
            return seen.samples, seen.num_peers

    assert await asyncio.to_thread(train) == (50, 2)
