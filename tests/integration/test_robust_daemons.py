"""``client.average(..., aggregation=...)`` through real ``swarmavg peer`` processes."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from swarmavg.peer import connect
from tests.harness import ProcessPool, SwarmavgProcess

pytestmark = pytest.mark.integration
RULES = ["centered-clip", "trimmed-mean"]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for control sockets (unix socket paths are capped at 107 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def swarm(pool: ProcessPool, sock_dir: Path, n: int) -> list[SwarmavgProcess]:
    def args(i: int, *join: str) -> list[str]:
        return ["peer", "--listen", "127.0.0.1:0", "--control", str(sock_dir / f"p{i}.sock"), *join]

    first = pool.start(args(0))
    return [first, *(pool.start(args(i, "--join", first.address)) for i in range(1, n))]


@pytest.mark.timeout(120)
def test_robust_rules_through_daemons(swarmavg_processes: ProcessPool, sock_dir: Path) -> None:
    daemons = swarm(swarmavg_processes, sock_dir, 4)
    rng = np.random.default_rng(3)
    honest = [rng.standard_normal(20000).astype(np.float32) for _ in range(3)]
    inputs = [*honest, np.full(20000, 1e6, np.float32)]  # member 3 sends a huge vector
    honest_mean = np.mean(honest, axis=0, dtype=np.float64)
    spread = np.abs(np.stack(honest) - honest_mean).max()
    with connect(daemons[0].control) as client:  # bad names: refused before anything is sent
        for bad in ("median", "centered-clip:tau=-1", "trimmed-mean:trim=0.7"):
            with pytest.raises(ValueError, match=r"aggregation|tau|trim"):
                client.average([honest[0]], key="bad", aggregation=bad, timeout=5.0)
        assert client.status()["rounds_failed"] == 0  # nothing reached the daemon's rounds

    for rule in RULES:

        def one(i: int, rule: str = rule) -> Any:
            with connect(daemons[i].control) as client:
                return client.average(
                    [inputs[i]],
                    key=f"robust-{rule}",
                    group_size=4,
                    min_group_size=4,
                    timeout=40.0,
                    aggregation=rule,
                )

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(4)))
        for result in results:
            assert result.group_size == 4
            assert not result.partial
            assert result.aggregation.startswith(rule + ":")
            assert result.num_adjusted > 0
            assert result.weights_clipped == 0
            assert np.abs(result.tensors[0] - honest_mean).max() <= 2 * spread
        for other in results[1:]:
            assert other.tensors[0].tobytes() == results[0].tensors[0].tobytes()
