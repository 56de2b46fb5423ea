"""A late joiner's state download reports its progress: the daemon logs bytes,
rate and ETA, and the training process's ``load_state`` shows the daemon's figures."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmavg.averaging.state.config import DonorFaults
from swarmavg.averaging.transfer_progress import TransferProgress
from swarmavg.peer import Peer, PeerConfig

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


class Seen(logging.Handler):
    """Sets an event when a log line containing ``text`` is emitted (same thread: the loop)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text = text
        self.event = asyncio.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        if self.text in line:
            self.event.set()


async def test_load_state_shows_the_daemons_download_progress(sock_dir: Path) -> None:
    client_lines = Seen("loading state: ")
    daemon_lines = Seen("downloaded state ")
    logging.getLogger("swarmavg.peer.client").addHandler(client_lines)
    logging.getLogger("swarmavg.averaging.state.sharer").addHandler(daemon_lines)
    for name in ("swarmavg.peer.client", "swarmavg.averaging.state.sharer"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        config = PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "a.sock"), run_id="s")
        async with Peer(config) as donor, donor.client() as publisher:
            state = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: several chunks

            async def hold_until_the_joiner_showed_progress(served: int) -> None:
                # the donor serves one chunk, then waits until the joiner's load_state has
                # shown a progress line: the download is half-way at that point
                if served == 1:
                    await asyncio.wait_for(client_lines.event.wait(), 30)

            assert donor.averager is not None
            donor.averager._components[2].faults = DonorFaults(  # type: ignore[index]
                before_chunk=hold_until_the_joiner_showed_progress
            )
            await publisher.publish_state([state], {"epoch": 3})
            joiner_config = PeerConfig(
                listen="127.0.0.1:0",
                control=str(sock_dir / "b.sock"),
                run_id="s",
                join=[donor.address or ""],
            )
            async with Peer(joiner_config) as joiner, joiner.client() as trainer:
                metadata, tensors = await trainer.load_state(timeout=60)
                assert metadata == {"epoch": 3}
                np.testing.assert_array_equal(tensors[0], state)
                progress = joiner.state_progress()
                assert isinstance(progress, TransferProgress)
                assert progress.done == progress.total >= state.nbytes
    finally:
        logging.getLogger("swarmavg.peer.client").removeHandler(client_lines)
        logging.getLogger("swarmavg.averaging.state.sharer").removeHandler(daemon_lines)
    first = next(line for line in client_lines.lines if "loading state: " in line)
    assert "B/4.0 MiB (" in first  # the chunks served so far out of the 4 MiB
    assert "/s, ETA " in first
    assert any(line.startswith("downloading state ") for line in daemon_lines.lines)
    assert daemon_lines.event.is_set()


def test_transfer_figures() -> None:
    progress = TransferProgress(total=4 << 20, started=100.0)
    assert progress.eta(now=100.0) is None
    progress.add(1 << 20)
    assert progress.rate(now=102.0) == (1 << 20) / 2
    assert progress.eta(now=102.0) == 6.0
    assert progress.line("state ab", now=102.0) == (
        "state ab: 1.0 MiB/4.0 MiB (25%), 512.0 KiB/s, ETA 6 s"
    )
    assert not progress.due(now=101.0)
    assert progress.due(now=106.0)
    assert not progress.due(now=107.0)
