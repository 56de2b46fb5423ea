"""``publish_state`` and ``load_state`` through shared memory between real daemons: a joiner
downloads exactly the state published last, though every publish of a training loop writes
the same segment, and gets it through a segment of its own."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmavg.peer import Peer, PeerConfig
from swarmavg.peer.client.shm import NAME_RE, SHM_DIR
from tests.peer.shm_views import in_shared_memory

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def state_of(epoch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(epoch)
    return [rng.standard_normal(500_000).astype(np.float32), np.full(3, epoch, np.float64)]


async def test_a_joiner_loads_the_last_state_published_through_shared_memory(
    sock_dir: Path,
) -> None:
    config = PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "a.sock"), run_id="s")
    async with Peer(config) as donor, donor.client() as publisher:
        for epoch in (1, 2, 3):
            await publisher.publish_state(state_of(epoch), {"epoch": epoch})
        assert len(publisher._publish_segments) == 1, "one segment, reused by every publish"
        assert donor.averager is not None  # later versions are advertised in the background
        await asyncio.wait_for(donor.averager.state_sharer.settle_advertisement(), 10)
        joiner_config = PeerConfig(
            listen="127.0.0.1:0",
            control=str(sock_dir / "b.sock"),
            run_id="s",
            join=[donor.address or ""],
        )
        async with Peer(joiner_config) as joiner, joiner.client() as trainer:
            metadata, tensors = await trainer.load_state(timeout=60)
    assert metadata == {"epoch": 3}
    assert all(in_shared_memory(t) for t in tensors), "loaded through the offered segment"
    for got, want in zip(tensors, state_of(3), strict=True):
        np.testing.assert_array_equal(got, want)
    pid = str(os.getpid())
    mine = [n for n in SHM_DIR.iterdir() if (m := NAME_RE.match(n.name)) and m[1] == pid]
    assert mine == [], "every segment unlinked: by the daemon when it mapped it, or the client"
