"""The donor's store of published versions: grace bounds, shared chunks, bounded memory."""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.averaging.state.format import PackedState, pack_state
from swarmavg.averaging.state.store import StateStore

CHUNK = 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def packed(version: int, changed: int | None = None) -> PackedState:
    """Two tensors of 4 KiB (4 chunks each) plus the header; tensor 1 differs per version
    unless ``changed`` names another seed for it."""
    fixed = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    seed = version if changed is None else changed
    moving = np.random.default_rng(1000 + seed).standard_normal(1024).astype(np.float32)
    return pack_state([fixed, moving], b"m", float(version), CHUNK)


def unique_bytes(*states: PackedState) -> int:
    chunks: dict[bytes, bytes] = {}
    for s in states:
        chunks.update(s.chunks)
    return sum(len(c) for c in chunks.values())


def test_shared_chunks_are_stored_once() -> None:
    store = StateStore(retain_versions=2, retain_seconds=60.0, clock=FakeClock())
    v1, v2 = packed(1), packed(2)
    store.publish(v1)
    store.publish(v2)
    assert store.roots == [v1.manifest.root, v2.manifest.root]
    assert store.current == v2.manifest
    # header and the fixed tensor are shared: only tensor 1's 4 chunks are held twice
    assert store.held_bytes == unique_bytes(v1, v2) == v1.manifest.total_bytes + 4 * CHUNK
    for digest, data in v1.chunks.items():
        assert store.chunk(digest) == data
    assert store.manifest(v1.manifest.root) == v1.manifest


def test_count_bound_drops_the_oldest_and_only_its_own_chunks() -> None:
    store = StateStore(retain_versions=2, retain_seconds=60.0, clock=FakeClock())
    versions = [packed(v) for v in range(1, 5)]
    for p in versions:
        store.publish(p)
    assert store.roots == [p.manifest.root for p in versions[1:]]
    v1_only = set(versions[0].manifest.chunk_hashes) - set(versions[1].manifest.chunk_hashes)
    assert len(v1_only) == 4
    assert all(store.chunk(h) is None for h in v1_only)
    assert store.manifest(versions[0].manifest.root) is None
    shared = versions[0].manifest.chunk_hashes[0]  # the header: still used by newer versions
    assert store.chunk(shared) == versions[0].chunks[shared]
    assert store.held_bytes == unique_bytes(*versions[1:])


def test_time_bound_counts_from_retirement_or_last_use() -> None:
    clock = FakeClock()
    store = StateStore(retain_versions=5, retain_seconds=10.0, clock=clock)
    v1, v2, v3 = packed(1), packed(2), packed(3)
    store.publish(v1)
    clock.now = 100.0
    assert store.next_expiry() is None  # the current version never expires
    store.publish(v2)  # v1 retired at 100
    clock.now = 105.0
    store.publish(v3)  # v2 retired at 105
    assert store.next_expiry() == 110.0
    clock.now = 108.0
    assert store.touch(v1.manifest.root)  # a download of v1 in progress: grace until 118
    clock.now = 112.0
    assert store.roots == [v1.manifest.root, v2.manifest.root, v3.manifest.root]
    clock.now = 115.0  # v2 expired (retired 105, never asked for)
    assert store.roots == [v1.manifest.root, v3.manifest.root]
    assert store.next_expiry() == 118.0
    clock.now = 118.0
    assert store.manifest(v1.manifest.root) is None
    assert store.roots == [v3.manifest.root]
    assert store.held_bytes == v3.manifest.total_bytes
    assert store.next_expiry() is None
    assert not store.touch(v1.manifest.root)


def test_retain_zero_drops_at_once() -> None:
    store = StateStore(retain_versions=0, retain_seconds=60.0, clock=FakeClock())
    v1, v2 = packed(1), packed(2)
    store.publish(v1)
    store.publish(v2)
    assert store.roots == [v2.manifest.root]
    assert store.held_bytes == v2.manifest.total_bytes


def test_republishing_the_same_content_replaces_its_entry() -> None:
    store = StateStore(retain_versions=2, retain_seconds=60.0, clock=FakeClock())
    a, b = packed(1), packed(2)
    again = packed(3, changed=1)  # same content as ``a``, a newer version number
    assert again.manifest.root == a.manifest.root
    for p in (a, b, again):
        store.publish(p)
    assert store.roots == [b.manifest.root, a.manifest.root]
    assert store.current == again.manifest
    assert store.held_bytes == unique_bytes(a, b)


def test_fifty_publications_hold_bounded_memory() -> None:
    clock = FakeClock()
    store = StateStore(retain_versions=2, retain_seconds=30.0, clock=clock)
    sizes = []
    for v in range(50):
        clock.now += 0.1  # publishing every step: the count bound is the one that applies
        store.publish(packed(v))
        sizes.append(store.held_bytes)
    one = packed(0).manifest.total_bytes
    assert len(store.roots) == 3
    assert max(sizes) == one + 2 * 4 * CHUNK  # current + two retired (their tensor 1 only)
    clock.now += 30.0
    store.prune()
    assert store.held_bytes == one


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="retain"):
        StateStore(retain_versions=-1, retain_seconds=1.0)
    with pytest.raises(ValueError, match="retain"):
        StateStore(retain_versions=1, retain_seconds=float("nan"))
