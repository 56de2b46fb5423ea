"""Downloads that survive donors republishing mid-download, over real DHT nodes and gRPC.

Donors republish from inside the ``DonorFaults.before_chunk`` seam, at an exact count of
chunks served, so every scenario is deterministic without sleeps.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Sequence

import numpy as np
import pytest

from swarmavg.averaging.state.config import DonorFaults, StateSharingConfig
from swarmavg.averaging.state.format import PackedState, pack_state
from swarmavg.averaging.stubs import DOWNLOAD_STATE, download_state_method
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import AveragerSwarm, Peer, fast_config

CHUNK = 4096
STATE = StateSharingConfig(chunk_size=CHUNK, batch_chunks=4)


def state(version: int) -> list[np.ndarray]:
    """Tensor 0 (7 chunks, manifest positions 1-7) never changes; tensor 1 (6 chunks,
    positions 8-13) differs in every version. Position 0 is the header."""
    fixed = np.random.default_rng(0).standard_normal((64, 100)).astype(np.float32)
    moving = np.random.default_rng(1000 + version).standard_normal(3000)
    return [fixed, moving]


def packed(version: int) -> PackedState:
    return pack_state(state(version), b"m", float(version), CHUNK)


def assert_same(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        assert x.shape == y.shape
        assert x.tobytes() == y.tobytes()


class Republisher:
    """A donor's ``before_chunk`` seam: once it has served ``at`` chunks, it publishes
    ``versions`` (in order) before serving the next one."""

    def __init__(self, at: int, versions: Sequence[int]) -> None:
        self.at = at
        self.versions = versions
        self.peer: Peer | None = None
        self.done = False

    async def __call__(self, served: int) -> None:
        if served == self.at and not self.done and self.peer is not None:
            self.done = True
            for v in self.versions:
                await self.peer.averager.publish_state(state(v), b"m", version=float(v))
            # a republished version is advertised in the background: a joiner that reads
            # the DHT again must find the newest
            await self.peer.averager.state_sharer.settle_advertisement()


async def donors(
    swarm: AveragerSwarm, plans: Sequence[Republisher], state_config: StateSharingConfig
) -> list[Peer]:
    config = fast_config(state=state_config)
    peers = []
    for plan in plans:
        peer = await swarm.add(config, donor_faults=DonorFaults(before_chunk=plan))
        plan.peer = peer
        peers.append(peer)
    return peers


async def ask(
    joiner: Peer, donor: Peer, root: bytes, manifest: bool = False, chunks: Sequence[bytes] = ()
) -> list[averaging_pb2.StateResponse]:
    """One raw ``DownloadState`` call, as a joiner sends it."""
    request = averaging_pb2.StateRequest(root=root, want_manifest=manifest, chunk_hashes=chunks)
    joiner.node.signer.signed(request, donor.peer_id, DOWNLOAD_STATE)
    call = download_state_method(joiner.channels.channel(donor.address))(request, timeout=10)
    return [message async for message in call]


@pytest.mark.timeout(60)
async def test_donor_republishing_mid_download_still_serves_the_version_started() -> None:
    swarm = AveragerSwarm()
    try:
        plan = Republisher(at=5, versions=[2])
        (donor,) = await donors(swarm, [plan], STATE)
        joiner = await swarm.add(fast_config(state=STATE))
        await donor.averager.publish_state(state(1), b"m", version=1.0)
        metadata, tensors = await joiner.averager.load_state(timeout=20)
        assert plan.done  # version 2 replaced version 1 in the middle of the download
        assert metadata == b"m"
        assert_same(tensors, state(1))  # exactly version 1, although tensor 1 changed
        sharer = joiner.averager.state_sharer
        assert sharer.load_switches == 0
        assert sharer.downloaded_chunks == len(packed(1).manifest.chunk_hashes)
        assert donor.averager.state_sharer.published == packed(2).manifest
    finally:
        await swarm.close()


@pytest.mark.timeout(60)
async def test_version_gone_restarts_from_the_freshest_reusing_verified_chunks() -> None:
    swarm = AveragerSwarm()
    try:
        # three publications mid-download push version 1 past the 2-version grace
        plan = Republisher(at=5, versions=[2, 3, 4])
        (donor,) = await donors(swarm, [plan], STATE)
        joiner = await swarm.add(fast_config(state=STATE))
        await donor.averager.publish_state(state(1), b"m", version=1.0)
        _, tensors = await joiner.averager.load_state(timeout=20)
        assert plan.done
        assert packed(1).manifest.root not in donor.averager.state_sharer.store.roots
        assert_same(tensors, state(4))  # the freshest, never a mix of 1 and 4
        sharer = joiner.averager.state_sharer
        assert sharer.load_switches == 1
        # header and tensor 0 were verified during the attempt at version 1 and reused:
        # every chunk of version 4 was fetched exactly once, nothing else was
        assert sharer.downloaded_chunks == len(packed(4).manifest.chunk_hashes)
    finally:
        await swarm.close()


@pytest.mark.timeout(60)
async def test_two_donors_republishing_at_different_moments() -> None:
    swarm = AveragerSwarm()
    try:
        plans = [Republisher(at=2, versions=[2]), Republisher(at=3, versions=[3])]
        peers = await donors(swarm, plans, STATE)
        joiner = await swarm.add(fast_config(state=STATE))
        for peer in peers:  # the same state on both (as after a round): one root
            await peer.averager.publish_state(state(1), b"m", version=1.0)
        _, tensors = await joiner.averager.load_state(timeout=20)
        assert all(plan.done for plan in plans)
        assert_same(tensors, state(1))
        assert joiner.averager.state_sharer.load_switches == 0
        served = [p.averager.state_sharer.served_chunks for p in peers]
        assert sum(served) == len(packed(1).manifest.chunk_hashes)  # nothing fetched twice
        assert all(s > 0 for s in served)
    finally:
        await swarm.close()


@pytest.mark.timeout(60)
async def test_two_donors_dropping_the_version_at_different_moments() -> None:
    """Without a grace both donors drop version 1 (at different moments) before the
    joiner has its changed tensor: it restarts at version 2, which both now serve."""
    no_grace = StateSharingConfig(chunk_size=CHUNK, batch_chunks=4, retain_versions=0)
    swarm = AveragerSwarm()
    try:
        plans = [Republisher(at=2, versions=[2]), Republisher(at=3, versions=[2])]
        peers = await donors(swarm, plans, no_grace)
        joiner = await swarm.add(fast_config(state=no_grace))
        for peer in peers:
            await peer.averager.publish_state(state(1), b"m", version=1.0)
        _, tensors = await joiner.averager.load_state(timeout=20)
        assert all(plan.done for plan in plans)
        assert_same(tensors, state(2))
        sharer = joiner.averager.state_sharer
        assert sharer.load_switches == 1
        assert sharer.downloaded_chunks == len(packed(2).manifest.chunk_hashes)
    finally:
        await swarm.close()


@pytest.mark.timeout(60)
async def test_old_version_is_served_within_the_grace_and_dropped_after_it() -> None:
    swarm = AveragerSwarm()
    try:
        config = fast_config(state=STATE)
        donor = await swarm.add(config)
        joiner = await swarm.add(config)
        store = donor.averager.state_sharer.store
        now = [0.0]
        store.clock = lambda: now[0]
        v1, v2 = packed(1), packed(2)
        await donor.averager.publish_state(state(1), b"m", version=1.0)
        await donor.averager.publish_state(state(2), b"m", version=2.0)
        v1_only = sorted(set(v1.manifest.chunk_hashes) - set(v2.manifest.chunk_hashes))
        assert len(v1_only) == 6

        [reply] = await ask(joiner, donor, v1.manifest.root, manifest=True)
        assert reply.code == averaging_pb2.STATE_OK
        assert reply.manifest == v1.manifest.to_proto()
        replies = await ask(joiner, donor, v1.manifest.root, chunks=v1_only)
        assert [r.chunk_data for r in replies] == [v1.chunks[h] for h in v1_only]

        now[0] += STATE.retain_seconds  # the grace runs from the last request
        [reply] = await ask(joiner, donor, v1.manifest.root, manifest=True)
        assert reply.code == averaging_pb2.STATE_NOT_FOUND
        [reply] = await ask(joiner, donor, v1.manifest.root, chunks=v1_only[:1])
        assert reply.code == averaging_pb2.STATE_NOT_FOUND
        assert store.roots == [v2.manifest.root]
        assert store.held_bytes == v2.manifest.total_bytes
        [reply] = await ask(joiner, donor, v2.manifest.root, manifest=True)
        assert reply.code == averaging_pb2.STATE_OK
    finally:
        await swarm.close()


@pytest.mark.timeout(60)
async def test_retired_version_is_freed_when_its_grace_ends_without_requests() -> None:
    short = StateSharingConfig(chunk_size=CHUNK, retain_seconds=0.05)
    swarm = AveragerSwarm()
    try:
        donor = await swarm.add(fast_config(state=short))
        store = donor.averager.state_sharer.store
        freed = asyncio.Event()
        prune = store.prune

        def observed_prune() -> None:
            prune()
            v2 = packed(2).manifest
            if store.current == v2 and store.held_bytes == v2.total_bytes:
                freed.set()

        store.prune = observed_prune  # type: ignore[method-assign]
        await donor.averager.publish_state(state(1), b"m", version=1.0)
        await donor.averager.publish_state(state(2), b"m", version=2.0)
        async with asyncio.timeout(10):
            await freed.wait()  # the sharer's timer pruned: nobody asked for anything
        assert store.roots == [packed(2).manifest.root]
    finally:
        await swarm.close()


@pytest.mark.timeout(60)
async def test_fifty_publications_hold_bounded_memory() -> None:
    swarm = AveragerSwarm()
    try:
        config = fast_config(state=StateSharingConfig(chunk_size=64 << 10))
        donor = await swarm.add(config)
        joiner = await swarm.add(config)

        def big(version: int) -> list[np.ndarray]:  # 1 MiB, all of it changed every time
            return [np.random.default_rng(version).standard_normal(1 << 18).astype(np.float32)]

        state_bytes = 1 << 20
        store = donor.averager.state_sharer.store
        tracemalloc.start()
        try:
            held = []
            for v in range(50):
                await donor.averager.publish_state(big(v), b"m", version=float(v))
                held.append(store.held_bytes)
                if v == 9:
                    gc.collect()
                    after_ten = tracemalloc.get_traced_memory()[0]
            gc.collect()
            after_fifty = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        # current + the 2 retained versions, each at most 1 MiB plus its header chunk
        assert len(store.roots) == 3
        assert max(held) <= 3 * (state_bytes + CHUNK)
        # 40 more publications of 1 MiB each did not leave their bytes anywhere
        assert after_fifty - after_ten < state_bytes
        await donor.averager.state_sharer.settle_advertisement()  # v49's goes out after
        _, tensors = await joiner.averager.load_state(timeout=20)
        assert_same(tensors, big(49))
    finally:
        await swarm.close()
