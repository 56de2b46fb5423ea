"""Real ``swarmavg peer`` processes started through the CLI, real client processes.

Every daemon here is a separate process on 127.0.0.1 with an OS-chosen port; every client
is a separate Python process running tests/integration/client_worker.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from swarmavg.peer.shm import NAME_RE, SHM_DIR
from tests.harness import ProcessPool, SwarmavgProcess

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("client_worker.py")
sys.path.insert(0, str(WORKER.parent))
from client_worker import make_tensors  # noqa: E402


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for control sockets (unix socket paths are capped at 107 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def start_peer(
    pool: ProcessPool, control: Path, *extra: str, env: dict[str, str] | None = None
) -> SwarmavgProcess:
    return pool.start(
        ["peer", "--listen", "127.0.0.1:0", "--control", str(control), *extra], env=env
    )


class Worker:
    """One client process averaging seeded tensors."""

    def __init__(self, workdir: Path, name: str, **spec: Any) -> None:
        self.out = workdir / name
        self.spec = {"out": str(self.out), **spec}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(self.spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_connected(self, timeout: float = 30.0) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "connected" once the daemon answered
        assert line.strip() == "connected", self.proc.stderr.read() if self.proc.stderr else ""

    def outcome(self, timeout: float) -> dict[str, Any]:
        _, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        record: dict[str, Any] = json.loads(self.out.with_suffix(".json").read_text())
        if record["ok"]:
            with np.load(self.out.with_suffix(".npz")) as data:
                record["tensors"] = [data[f"arr_{i}"] for i in range(len(data.files))]
        return record

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


def status(control: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", "status", "--control", str(control), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    figures: dict[str, Any] = json.loads(result.stdout)
    return figures


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll a cheap condition on another process (no event to wait on across processes)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if (m := NAME_RE.match(n)) and int(m.group(1)) == pid]


def swarm(pool: ProcessPool, sock_dir: Path, n: int) -> list[SwarmavgProcess]:
    first = start_peer(pool, sock_dir / "p0.sock")
    rest = [start_peer(pool, sock_dir / f"p{i}.sock", "--join", first.address) for i in range(1, n)]
    return [first, *rest]


@pytest.mark.timeout(120)
def test_four_daemons_four_clients_get_the_weighted_mean(
    procs: ProcessPool, sock_dir: Path, tmp_path: Path
) -> None:
    peers = swarm(procs, sock_dir, 4)
    shapes = [[300, 1000], [17], [4, 5, 6]]  # 1.2 MB: the first round goes through shm
    weights = [1.0, 2.0, 3.0, 4.0]
    for round_index, use_shm in enumerate([True, False]):
        workers = [
            Worker(
                tmp_path,
                f"r{round_index}-c{i}",
                control=p.control,
                seed=i,
                shapes=shapes,
                weight=weights[i],
                key=f"round-{round_index}",
                group_size=4,
                min_group_size=4,
                timeout=40.0,
                use_shm=use_shm,
            )
            for i, p in enumerate(peers)
        ]
        outcomes = [w.outcome(timeout=60) for w in workers]
        inputs = [make_tensors(i, shapes, "float32") for i in range(4)]
        for outcome in outcomes:
            assert outcome["ok"], outcome
            assert outcome["group_size"] == 4
            assert sorted(outcome["peers"]) == sorted(p.peer_id for p in peers)
            assert outcome["partial"] is False
            for t, got in enumerate(outcome["tensors"]):
                want = sum(
                    w * x[t].astype(np.float64) for w, x in zip(weights, inputs, strict=True)
                )
                want /= sum(weights)
                assert got.dtype == np.float32
                assert got.shape == tuple(shapes[t])
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for other in outcomes[1:]:  # bit-identical across members
            for a, b in zip(outcomes[0]["tensors"], other["tensors"], strict=True):
                assert a.tobytes() == b.tobytes()
        assert len({o["group_id"] for o in outcomes}) == 1
    for p in peers:
        figures = status(Path(p.control))
        assert figures["known_peers"] == 3, figures  # 4 peers: itself and 3 others
        assert figures["rounds_done"] == 2
        assert figures["bytes_sent"] > 0
        assert figures["codecs"]["none"]["rounds"] == 2
    human = subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", "status", "--control", peers[0].control],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "4 (3 known + this one)" in human
    assert peers[0].peer_id in human
