"""``Peer`` in process (notebooks, tests): two daemons in one event loop averaging."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmavg.peer import Peer, PeerConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


async def test_two_in_process_peers_average(sock_dir: Path) -> None:
    first = PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "a.sock"), run_id="t")
    async with Peer(first) as a:
        assert a.address is not None
        second = PeerConfig(
            listen="127.0.0.1:0", control=str(sock_dir / "b.sock"), run_id="t", join=[a.address]
        )
        async with Peer(second) as b, a.client() as ca, b.client() as cb:
            x = np.arange(300_000, dtype=np.float32)  # 1.2 MB: shared-memory path
            y = np.ones(300_000, dtype=np.float32)
            ra, rb = await asyncio.gather(
                ca.average([x], key="k", weight=1.0, group_size=2, timeout=20),
                cb.average([y], key="k", weight=3.0, group_size=2, timeout=20),
            )
            expected = (x + 3 * y) / 4
            np.testing.assert_allclose(ra.tensors[0], expected, rtol=1e-6)
            assert ra.tensors[0].tobytes() == rb.tensors[0].tobytes()
            assert sorted(ra.peers) == sorted([a.peer_id, b.peer_id])
            assert await ca.dht.store("note", {"hello": 1}, ttl=30)
            assert await cb.dht.get("note") == {"hello": 1}
            status = await cb.status()
            assert status["known_peers"] == 1
            assert status["rounds_done"] == 1
    assert not (sock_dir / "a.sock").exists()


def test_daemon_never_imports_torch() -> None:
    code = (
        "import sys, swarmavg.peer.daemon, swarmavg.peer.cli, swarmavg.peer.bare_dht;"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False"


async def test_result_and_stats_name_the_codec_the_group_used(sock_dir: Path) -> None:
    # Each peer asks for another codec; the group uses its leader's. Both results and both
    # daemons' per-codec figures must name that one, also on the peer that asked otherwise.
    first = PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "a.sock"), run_id="t")
    async with Peer(first) as a:
        assert a.address is not None
        second = PeerConfig(
            listen="127.0.0.1:0", control=str(sock_dir / "b.sock"), run_id="t", join=[a.address]
        )
        async with Peer(second) as b, a.client() as ca, b.client() as cb:
            x = np.linspace(-1, 1, 4096, dtype=np.float32)
            ra, rb = await asyncio.gather(
                ca.average([x], key="c", group_size=2, timeout=20, codec="float16"),
                cb.average([x], key="c", group_size=2, timeout=20, codec="none"),
            )
            assert ra.codec == rb.codec
            assert ra.codec in {"float16", "none"}
            for client in (ca, cb):
                status = await client.status()
                assert set(status["codecs"]) == {ra.codec}
