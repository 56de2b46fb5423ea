"""Shared-memory segment lifecycle: created by the client, unlinked by the daemon on map."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmavg.peer import shm
from swarmavg.peer.errors import ValidationError


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    base = Path("/dev/shm") if shm.shm_available() else Path("/tmp")
    with tempfile.TemporaryDirectory(dir=base, prefix="sa-test-") as d:
        yield Path(d)


def test_round_trip_and_unlink_on_map(shm_dir: Path) -> None:
    arrays = [np.arange(10, dtype=np.float32), np.ones((3, 5), np.float64)]
    seg = shm.ClientSegment(arrays, shm_dir)
    assert seg.path.exists()
    assert seg.path.stat().st_mode & 0o777 == 0o600
    daemon = shm.DaemonSegment(
        seg.name, seg.size, [a.dtype for a in arrays], [a.shape for a in arrays], shm_dir
    )
    assert not seg.path.exists(), "the daemon unlinks the file as soon as it has mapped it"
    inputs = daemon.inputs()
    np.testing.assert_array_equal(inputs[0], arrays[0])
    daemon.write_results([a * 2 for a in inputs])
    del inputs
    daemon.close()
    results = seg.results()
    np.testing.assert_array_equal(results[0], arrays[0] * 2)
    np.testing.assert_array_equal(results[1], arrays[1] * 2)
    seg.unlink()  # idempotent
    assert list(shm_dir.iterdir()) == []


def test_daemon_rejects_bad_segments(shm_dir: Path) -> None:
    arrays = [np.zeros(8, np.float32)]
    dtypes, shapes = [a.dtype for a in arrays], [a.shape for a in arrays]
    with pytest.raises(ValidationError, match="bad shared-memory segment name"):
        shm.DaemonSegment("../../etc/passwd", 32, dtypes, shapes, shm_dir)
    with pytest.raises(ValidationError, match="does not exist"):
        shm.DaemonSegment(f"swarmavg-1-{'0' * 32}", 32, dtypes, shapes, shm_dir)
    seg = shm.ClientSegment(arrays, shm_dir)
    with pytest.raises(ValidationError, match="does not match the layout"):
        shm.DaemonSegment(seg.name, seg.size + 1, dtypes, shapes, shm_dir)
    with pytest.raises(ValidationError, match="holds"):
        shm.DaemonSegment(seg.name, 64, [np.dtype(np.float32)], [(16,)], shm_dir)
    seg.unlink()


def test_sweep_removes_segments_of_dead_processes(shm_dir: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    stale = shm_dir / f"swarmavg-{dead_pid}-{'a' * 32}"
    stale.write_bytes(b"x")
    alive = shm_dir / f"swarmavg-{os.getpid()}-{'b' * 32}"
    alive.write_bytes(b"x")
    other = shm_dir / "unrelated"
    other.write_bytes(b"x")
    assert shm.sweep_stale(shm_dir) == 1
    assert not stale.exists()
    assert alive.exists()
    assert other.exists()


def test_layout_is_aligned() -> None:
    offsets, size = shm.segment_layout([np.dtype(np.float16), np.dtype(np.float64)], [(3,), (2,)])
    assert offsets == [0, 64]
    assert size == 80
