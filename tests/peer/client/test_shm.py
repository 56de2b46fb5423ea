"""Shared-memory segment lifecycle: created by the client, unlinked by the daemon on map."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmavg.peer.client import shm
from swarmavg.peer.client.errors import ValidationError


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    base = Path("/dev/shm") if shm.shm_available() else Path("/tmp")
    with tempfile.TemporaryDirectory(dir=base, prefix="sa-test-") as d:
        yield Path(d)


def test_round_trip_and_unlink_on_map(shm_dir: Path) -> None:
    arrays = [np.arange(10, dtype=np.float32), np.ones((3, 5), np.float64)]
    dtypes, shapes = [a.dtype for a in arrays], [a.shape for a in arrays]
    seg = shm.ClientSegment.holding(arrays, shm_dir)
    assert seg.path.exists()
    assert seg.path.stat().st_mode & 0o777 == 0o600
    daemon = shm.DaemonSegment(seg.name, seg.size, shm_dir)
    assert not seg.path.exists(), "the daemon unlinks the file as soon as it has mapped it"
    inputs = daemon.inputs(dtypes, shapes)
    np.testing.assert_array_equal(inputs[0], arrays[0])
    daemon.write_results([a * 2 for a in inputs])
    del inputs
    daemon.close()
    assert not seg.in_use()
    results = seg.results(dtypes, shapes)
    assert seg.in_use()
    np.testing.assert_array_equal(results[0], arrays[0] * 2)
    np.testing.assert_array_equal(results[1], arrays[1] * 2)
    seg.unlink()  # idempotent
    assert list(shm_dir.iterdir()) == []


def test_daemon_rejects_bad_segments(shm_dir: Path) -> None:
    arrays = [np.zeros(8, np.float32)]
    with pytest.raises(ValidationError, match="bad shared-memory segment name"):
        shm.DaemonSegment("../../etc/passwd", 32, shm_dir)
    with pytest.raises(ValidationError, match="does not exist"):
        shm.DaemonSegment(f"swarmavg-1-{'0' * 32}", 32, shm_dir)
    seg = shm.ClientSegment.holding(arrays, shm_dir)
    with pytest.raises(ValidationError, match="holds"):
        shm.DaemonSegment(seg.name, seg.size + 1, shm_dir)
    assert not seg.path.exists(), "a refused segment is unlinked as well"
    seg = shm.ClientSegment.holding(arrays, shm_dir)
    daemon = shm.DaemonSegment(seg.name, seg.size, shm_dir)
    with pytest.raises(ValidationError, match="does not fit"):
        daemon.inputs([np.dtype(np.float32)], [(9,)])
    daemon.close()
    seg.unlink()


def test_pool_reuses_an_idle_segment_only(shm_dir: Path) -> None:
    pool = shm.SegmentPool(shm_dir)  # segments it leaves unreleased stay in tmp_path
    x = [np.arange(4, dtype=np.float32)]
    first = pool.acquire(x)
    pool.release(first, ok=True)  # never mapped by a daemon: not kept
    assert len(pool) == 0
    assert pool.acquire(x) is not first
    first.daemon_mapped = True
    pool.release(first, ok=True)
    again = pool.acquire([x[0] + 1])
    assert again is first
    held = again.results([np.dtype(np.float32)], [(4,)])
    np.testing.assert_array_equal(held[0], [1, 2, 3, 4])
    pool.release(again, ok=True)
    other = pool.acquire(x)
    assert other is not first, "results still point into it"
    np.testing.assert_array_equal(held[0], [1, 2, 3, 4])  # and they are left untouched
    assert pool.acquire([np.arange(5, dtype=np.float32)]) is not first, "another size"
    del held
    assert pool.acquire(x) is first, "free again once the results are gone"
    pool.release(first, ok=False)  # a failed call drops it
    assert len(pool) == 0
    assert pool.acquire(x) is not first
    other.unlink()


def test_pool_alternates_when_the_previous_result_is_held(shm_dir: Path) -> None:
    """The training-loop pattern: ``res`` of call k is alive while call k + 1 runs."""
    pool = shm.SegmentPool(shm_dir)
    layout = ([np.dtype(np.float32)], [(8,)])
    used: list[shm.ClientSegment] = []
    result: list[np.ndarray] | None = None
    for step in range(6):
        segment = pool.acquire([np.full(8, step, np.float32)])
        segment.daemon_mapped = True  # as after the daemon's "accepted"
        used.append(segment)
        pool.release(segment, ok=True)
        result = segment.results(*layout)  # rebinding drops the previous call's result
        np.testing.assert_array_equal(result[0], np.full(8, step))
    assert len({id(s) for s in used}) == 2, "two segments, used in turn"
    assert used[2:] == used[:2] * 2
    assert len(pool) == 2
    del result


def test_pool_keeps_at_most_keep_idle_segments(shm_dir: Path) -> None:
    pool = shm.SegmentPool(shm_dir, keep=2)
    segments = [pool.acquire([np.zeros(n, np.float32)]) for n in (1, 2, 3)]
    for segment in segments:
        segment.daemon_mapped = True
        pool.release(segment, ok=True)
    assert len(pool) == 2
    assert pool.acquire([np.zeros(1, np.float32)]) is not segments[0], "the oldest went first"
    assert pool.acquire([np.zeros(3, np.float32)]) is segments[2]
    with pytest.raises(ValueError, match="keep"):
        shm.SegmentPool(shm_dir, keep=0)


def test_daemon_cache_bounds_and_sweeps() -> None:
    cache = shm.DaemonSegmentCache(per_client=2)
    x = [np.ones(16, np.float32)]
    segments = [shm.ClientSegment.holding(x, shm.SHM_DIR) for _ in range(3)]
    names = [seg.name for seg in segments]
    for seg in segments:
        cache.open(seg.name, seg.size, reuse=False)
        assert not seg.path.exists()
    assert len(cache) == 2, "at most per_client segments per client process"
    with pytest.raises(ValidationError, match="not mapped"):
        cache.open(names[0], segments[0].size, reuse=True)
    assert cache.open(names[2], segments[2].size, reuse=True) is not None
    assert cache.sweep() == 0  # this process is alive
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = shm.ClientSegment.holding(x, shm.SHM_DIR)
    stale_name = f"swarmavg-{int(dead.stdout)}-{'c' * 32}"
    os.rename(orphan.path, shm.SHM_DIR / stale_name)
    cache.open(stale_name, orphan.size, reuse=False)
    assert cache.sweep() == 1
    cache.close()
    assert len(cache) == 0


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


def test_unlink_if_orphaned_spares_live_creators() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = shm.ClientSegment(64, shm.SHM_DIR)
    orphan_path = shm.SHM_DIR / f"swarmavg-{int(dead.stdout)}-{'d' * 32}"
    os.rename(orphan.path, orphan_path)
    live = shm.ClientSegment(64, shm.SHM_DIR)
    assert shm.unlink_if_orphaned(orphan_path.name) is True
    assert not orphan_path.exists()
    assert shm.unlink_if_orphaned(live.name) is False
    assert live.path.exists()
    live.unlink()


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A 1 MiB tmpfs: a shared-memory folder with little room, as a container's 64 MB
    /dev/shm is for a large model (needs root and mount; skipped without)."""
    with tempfile.TemporaryDirectory(prefix="sa-small-shm-") as d:
        try:
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m,mode=700", "tmpfs", d],
                capture_output=True,
                check=False,
                timeout=30,
            )
        except FileNotFoundError:
            pytest.skip("no mount command here")
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
        try:
            yield Path(d)
        finally:
            subprocess.run(["umount", "-l", d], check=False, timeout=30)


def test_a_segment_larger_than_the_folders_room_fails_at_creation(small_tmpfs: Path) -> None:
    """tmpfs grants a file any size and kills the process that writes past its room with
    SIGBUS; the segment takes its pages when it is made, so it fails there instead."""
    with pytest.raises(OSError, match="No space left") as caught:
        shm.ClientSegment(4 << 20, small_tmpfs)
    assert caught.value.errno == errno.ENOSPC
    assert list(small_tmpfs.iterdir()) == []
    small = shm.ClientSegment(64 << 10, small_tmpfs)  # one that fits is made as before
    small.unlink()


def test_a_loaded_state_larger_than_the_folders_room_fails_the_daemons_write(
    small_tmpfs: Path,
) -> None:
    """The daemon writes a loaded state into the client's offer with ``pwrite``: past the
    folder's room that fails with ENOSPC (the state then goes inline), not with SIGBUS."""
    offer = shm.LoadOffer(small_tmpfs)
    try:
        with pytest.raises(OSError, match="No space left") as caught:
            shm.fill_offer(offer.name, [np.ones(1_000_000, np.float32)], small_tmpfs)
        assert caught.value.errno == errno.ENOSPC
        fits = [np.arange(1000, dtype=np.float32), np.ones(3, np.float64)]
        offer.unlink()
        offer = shm.LoadOffer(small_tmpfs)
        size = shm.fill_offer(offer.name, fits, small_tmpfs)
        got = offer.arrays(size, [a.dtype for a in fits], [a.shape for a in fits])
        for have, want in zip(got, fits, strict=True):
            np.testing.assert_array_equal(have, want)
    finally:
        offer.unlink()
    assert list(small_tmpfs.iterdir()) == []


@pytest.mark.parametrize("during_declaration", [True, False])
def test_calls_too_large_for_the_folder_go_inline_with_one_warning(
    small_tmpfs: Path, during_declaration: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from swarmavg.peer.client.calls import PreparedAverage, PreparedPublish

    monkey = pytest.MonkeyPatch()
    monkey.setattr(shm._NoRoom, "warned", False)
    pool = shm.SegmentPool(small_tmpfs)
    tensors = [np.ones(1_000_000, np.float32)]  # 4 MB against 1 MiB of room
    try:
        with caplog.at_level("WARNING", logger=shm.log.name):
            call = PreparedAverage(
                tensors,
                key="k",
                weight=1.0,
                group_size=None,
                min_group_size=2,
                timeout=5.0,
                codec=None,
                segments=pool,
                write_during_declaration=during_declaration,
            )
            publish = PreparedPublish(tensors, {"epoch": 1}, pool)
    finally:
        monkey.undo()
    assert call.segment is None
    assert not call.early
    assert call.start.shm_name == ""
    assert not call.start.inputs_checked
    assert len(list(call.requests())) > 1, "the tensor bytes follow the start"
    assert publish.segment is None
    assert len(publish.messages()) > 1
    warnings = [r.getMessage() for r in caplog.records if "no room" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "--shm-size" in warnings[0]
    assert list(small_tmpfs.iterdir()) == []
    with pytest.raises(ValidationError, match="NaN"):  # inline calls are still checked
        PreparedPublish([np.full(1_000_000, np.nan, np.float32)], {}, pool)
