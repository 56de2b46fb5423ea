"""``swarmavg peers`` against real ``swarmavg peer`` processes (a view of the run).

Three daemons (one in client mode) on 127.0.0.1; trainers report progress through real
clients with :class:`ProgressTracker` (the part of the wrappers that writes the records),
and the CLI, run as a real process, must list every daemon with its address, mode, epoch,
throughput and metrics, and the run's epoch, samples/s and ETA.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.peer import connect
from tests.harness import ProcessPool, SwarmavgProcess

pytestmark = pytest.mark.integration
RUN = "view-run"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def peers_cli(control: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", "peers", "--control", control, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def wait_for_view(control: str, ready: Any, timeout: float = 60.0) -> dict[str, Any]:
    """Poll the daemon's view until ``ready(view)`` (records travel through the DHT of
    other processes: there is no event to wait on across them)."""
    deadline = time.monotonic() + timeout
    with connect(control, use_shm=False) as client:
        while True:
            view = client.peers()
            if ready(view):
                return view
            if time.monotonic() > deadline:
                raise AssertionError(f"the view never became ready: {view}")
            time.sleep(0.1)


def start(pool: ProcessPool, sock: Path, *extra: str) -> SwarmavgProcess:
    return pool.start(
        ["peer", "--listen", "127.0.0.1:0", "--control", str(sock), "--run-id", RUN, *extra]
    )


@pytest.mark.timeout(150)
def test_peers_lists_every_daemon_with_progress_and_metrics(
    swarmavg_processes: ProcessPool, sock_dir: Path
) -> None:
    first = start(swarmavg_processes, sock_dir / "a.sock")
    second = start(swarmavg_processes, sock_dir / "b.sock", "--join", first.address)
    light = start(swarmavg_processes, sock_dir / "c.sock", "--join", first.address, "--client-mode")
    clients = [connect(d.control, use_shm=False) for d in (first, second, light)]
    try:
        trackers = [ProgressTracker(c, RUN, target_batch_size=1000, ttl=60.0) for c in clients]
        for i, tracker in enumerate(trackers):
            tracker.set_epoch(3)
            tracker.samples = 100 * (i + 1)
            tracker.meter.rate = 10.0 * (i + 1)
        trackers[0].set_metrics({"loss": 0.25, "accuracy": 0.875})
        for tracker in trackers:
            assert tracker.report()

        def all_three(view: dict[str, Any]) -> bool:
            return sum(r["method"] == "collaborative" for r in view["peers"]) == 3

        wait_for_view(second.control, all_three)
        result = peers_cli(second.control, "--json")
        assert result.returncode == 0, result.stderr
        view = json.loads(result.stdout)
    finally:
        for client in clients:
            client.close()
    assert view["run_id"] == RUN
    rows = {r["peer_id"]: r for r in view["peers"]}
    assert set(rows) == {first.peer_id, second.peer_id, light.peer_id}
    assert view["peers"][0]["peer_id"] == second.peer_id
    assert view["peers"][0]["this_peer"]
    assert rows[first.peer_id]["address"] == first.address
    assert rows[second.peer_id]["address"] == second.address
    assert (rows[first.peer_id]["mode"], rows[light.peer_id]["mode"]) == ("full", "client")
    assert rows[light.peer_id]["address"] is None
    assert [rows[p.peer_id]["epoch"] for p in (first, second, light)] == [3, 3, 3]
    assert [rows[p.peer_id]["samples_per_second"] for p in (first, second, light)] == [
        10.0,
        20.0,
        30.0,
    ]
    assert rows[first.peer_id]["metrics"] == {"accuracy": 0.875, "loss": 0.25}
    assert rows[second.peer_id]["metrics"] == {}
    assert all(0 <= r["last_seen"] < 60 for r in view["peers"])
    (progress,) = view["progress"]
    assert progress["method"] == "collaborative"
    assert (progress["epoch"], progress["samples"], progress["target"]) == (3, 600, 1000)
    assert progress["samples_per_second"] == 60.0
    assert progress["eta"] == pytest.approx(400 / 60.0)
    assert progress["peers"] == 3

    table = peers_cli(first.control)
    assert table.returncode == 0, table.stderr
    assert f"run {RUN} (collaborative): epoch 3, 600/1000 samples, 60.0 samples/s" in table.stdout
    assert "next step in 7 s, 3 peers" in table.stdout
    assert first.peer_id[:12] + "*" in table.stdout
    assert second.address in table.stdout
    assert "loss=0.25" in table.stdout


@pytest.mark.timeout(90)
def test_peers_without_trainers_lists_the_routing_table_bootstrap_node_included(
    swarmavg_processes: ProcessPool, sock_dir: Path
) -> None:
    bootstrap = swarmavg_processes.start(["dht", "--listen", "127.0.0.1:0", "--run-id", RUN])
    first = start(swarmavg_processes, sock_dir / "a.sock", "--join", bootstrap.address)
    second = start(swarmavg_processes, sock_dir / "b.sock", "--join", bootstrap.address)
    everyone = {bootstrap.peer_id, first.peer_id, second.peer_id}

    view = wait_for_view(first.control, lambda v: {r["peer_id"] for r in v["peers"]} == everyone)
    assert view["progress"] == []
    assert all(r["method"] is None and r["epoch"] is None for r in view["peers"])
    rows = {r["peer_id"]: r for r in view["peers"]}
    assert (rows[bootstrap.peer_id]["address"], rows[bootstrap.peer_id]["mode"]) == (
        bootstrap.address,
        "full",
    )
    table = peers_cli(first.control)
    assert table.returncode == 0, table.stderr
    assert f"run {RUN}: no trainer reports progress yet" in table.stdout
    assert bootstrap.address in table.stdout
