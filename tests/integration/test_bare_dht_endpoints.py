"""``swarmavg dht --metrics`` and ``swarmavg status`` for a bare DHT node, against
real processes: a bootstrap node has metrics and a status too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swarmavg.peer import connect
from swarmavg.peer.client.errors import SwarmError
from tests.harness import ProcessPool

pytestmark = pytest.mark.integration
RUN = "boot-run"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as page:
        text = page.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll across processes (the DHT's records and contacts travel between them)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_a_bare_dht_node_serves_metrics_and_answers_status(
    swarmavg_processes: ProcessPool, sock_dir: Path
) -> None:
    control = str(sock_dir / "boot.sock")
    boot = swarmavg_processes.start(
        [
            "dht",
            "--listen",
            "127.0.0.1:0",
            "--run-id",
            RUN,
            "--metrics",
            "127.0.0.1:0",
            "--control",
            control,
        ]
    )
    assert boot.ready["control"] == control
    metrics = str(boot.ready["metrics"])
    peer = swarmavg_processes.start(
        [
            "peer",
            "--listen",
            "127.0.0.1:0",
            "--run-id",
            RUN,
            "--join",
            boot.address,
            "--control",
            str(sock_dir / "peer.sock"),
        ]
    )
    with connect(peer.control, use_shm=False) as client:
        assert client.dht.store("boot-run.note", {"hello": 1}, ttl=60)

    def counted() -> bool:
        samples = scrape(metrics)
        return samples["swarmavg_known_peers"] >= 1 and samples["swarmavg_dht_stored_records"] >= 1

    wait_for(counted, "the node's metrics to count the peer and the record")
    assert "swarmavg_rounds_total" not in scrape(metrics)  # a bare node has no rounds

    result = cli("status", "--control", control, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["kind"] == "dht"
    assert (status["peer_id"], status["address"], status["run_id"]) == (
        boot.peer_id,
        boot.address,
        RUN,
    )
    assert status["known_peers"] >= 1
    assert status["stored_records"] >= 1
    table = cli("status", "--control", control)
    assert table.returncode == 0, table.stderr
    assert "bare DHT node" in table.stdout
    assert f"address            {boot.address}" in table.stdout
    assert "stored records" in table.stdout

    # the run's view through the bootstrap node, and a clear answer for what it cannot do
    view = cli("peers", "--control", control, "--json")
    assert view.returncode == 0, view.stderr
    assert {r["peer_id"] for r in json.loads(view.stdout)["peers"]} >= {boot.peer_id}
    with connect(control, use_shm=False) as client, pytest.raises(SwarmError, match="bare DHT"):
        client.load_state(timeout=5)

    boot.stop()
    assert not Path(control).exists()  # the socket is removed on shutdown


@pytest.mark.timeout(60)
def test_the_dht_metrics_port_in_use_is_a_startup_error(swarmavg_processes: ProcessPool) -> None:
    first = swarmavg_processes.start(
        ["dht", "--listen", "127.0.0.1:0", "--run-id", RUN, "--metrics", "127.0.0.1:0"]
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmavg.peer.cli",
            "dht",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            str(first.ready["metrics"]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "cannot serve metrics on" in result.stderr
