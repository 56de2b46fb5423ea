"""Real ``swarmavg peer`` daemons load ml_dtypes only for their first bfloat16 round: a
plain start and float32 rounds never do, and a bfloat16 round then still averages. The
status answer still carries the version, which the daemon now reads on first use."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import swarmavg.peer
from swarmavg.peer import connect
from tests.harness import ProcessPool, SwarmavgProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps"),
]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for control sockets (unix socket paths are capped at 107 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def maps_ml_dtypes(daemon: SwarmavgProcess) -> bool:
    """Whether the daemon process has ml_dtypes' extension mapped (it is imported)."""
    return "_ml_dtypes_ext" in Path(f"/proc/{daemon.proc.pid}/maps").read_text()


def average_in_both(daemons: list[SwarmavgProcess], key: str, dtype: type) -> list[np.ndarray]:
    inputs = [np.array([1.0, 2.0, 4.0], dtype), np.array([3.0, 6.0, 8.0], dtype)]

    def one(i: int) -> np.ndarray:
        with connect(daemons[i].control) as client:
            result = client.average([inputs[i]], key=key, group_size=2, timeout=60.0)
        assert result.group_size == 2
        return np.asarray(result.tensors[0])

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(2)))


@pytest.mark.timeout(150)
def test_daemons_import_ml_dtypes_at_their_first_bfloat16_round(
    swarmavg_processes: ProcessPool, sock_dir: Path
) -> None:
    base = ["peer", "--listen", "127.0.0.1:0", "--run-id", "lazy-bf16"]
    first = swarmavg_processes.start([*base, "--control", str(sock_dir / "a.sock")])
    second = swarmavg_processes.start(
        [*base, "--join", first.address, "--control", str(sock_dir / "b.sock")]
    )
    daemons = [first, second]
    assert not any(maps_ml_dtypes(d) for d in daemons)

    for out in average_in_both(daemons, "f32", np.float32):
        assert out.dtype == np.float32
        assert out.tolist() == [2.0, 4.0, 6.0]
    assert not any(maps_ml_dtypes(d) for d in daemons)

    for out in average_in_both(daemons, "bf16", ml_dtypes.bfloat16):
        assert out.dtype == np.dtype(ml_dtypes.bfloat16)
        assert out.astype(np.float32).tolist() == [2.0, 4.0, 6.0]
    assert all(maps_ml_dtypes(d) for d in daemons)
    with connect(first.control) as client:  # the version, read on first use (peer/version.py)
        assert client.status()["version"] == swarmavg.peer.__version__ != ""
