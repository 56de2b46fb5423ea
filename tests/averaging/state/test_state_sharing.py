"""State sharing over real DHT nodes and gRPC: donors, failures, corruption, increments."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging import StateDownloadError, StateNotFoundError
from swarmavg.averaging.state.config import DonorFaults, StateSharingConfig
from swarmavg.averaging.state.format import pack_state
from tests.averaging.averager_swarm import AveragerSwarm, averager_swarm, fast_config

CHUNK = 4096
CONFIG = fast_config(state=StateSharingConfig(chunk_size=CHUNK, batch_chunks=4))


def state(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((64, 100)).astype(np.float32),  # 25,600 B: 7 chunks
        rng.standard_normal(3000).astype(np.float64),  # 24,000 B: 6 chunks
        np.arange(7, dtype=np.int64),
    ]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        assert x.shape == y.shape
        assert x.tobytes() == y.tobytes()


async def swarm_with(donor_faults: list[DonorFaults | None], joiners: int = 1) -> AveragerSwarm:
    swarm = AveragerSwarm()
    for faults in donor_faults:
        await swarm.add(CONFIG, donor_faults=faults)
    for _ in range(joiners):
        await swarm.add(CONFIG)
    return swarm


@pytest.mark.timeout(60)
async def test_load_from_one_donor() -> None:
    async with averager_swarm(2, CONFIG) as swarm:
        donor, joiner = swarm.peers
        with pytest.raises(StateNotFoundError):
            await joiner.averager.load_state(timeout=10)
        await donor.averager.publish_state(state(), b"step=1")
        metadata, tensors = await joiner.averager.load_state(timeout=10)
        assert metadata == b"step=1"
        assert_same(tensors, state())


@pytest.mark.timeout(60)
async def test_download_is_split_across_three_donors() -> None:
    swarm = await swarm_with([None, None, None])
    try:
        *donors, joiner = swarm.peers
        for d in donors:  # the same state (e.g. after a round): the same root on every donor
            await d.averager.publish_state(state(), b"m")
        metadata, tensors = await joiner.averager.load_state(timeout=20)
        assert metadata == b"m"
        assert_same(tensors, state())
        served = [d.averager.state_sharer.served_chunks for d in donors]
        total = len(pack_state(state(), b"m", 0.0, CHUNK).manifest.chunk_hashes)
        assert sum(served) == total
        assert all(s > 0 for s in served), served
    finally:
        await swarm.close()


@pytest.mark.timeout(60)
async def test_donor_failing_mid_download_is_replaced() -> None:
    swarm = await swarm_with([DonorFaults(fail_after_chunks=2), None])
    try:
        failing, healthy, joiner = swarm.peers
        for d in (failing, healthy):
            await d.averager.publish_state(state(), b"m")
        _, tensors = await joiner.averager.load_state(timeout=20)
        assert_same(tensors, state())
        assert failing.averager.state_sharer.served_chunks <= 2
    finally:
        await swarm.close()


@pytest.mark.timeout(60)
async def test_corrupted_chunks_are_rejected() -> None:
    swarm = await swarm_with([DonorFaults(corrupt_chunks=True)])
    try:
        liar, joiner = swarm.peers
        await liar.averager.publish_state(state(), b"m")
        with pytest.raises(StateDownloadError, match="sha256"):
            await joiner.averager.load_state(timeout=20)
        honest = await swarm.add(CONFIG)
        await honest.averager.publish_state(state(), b"m")
        _, tensors = await joiner.averager.load_state(timeout=20)
        assert_same(tensors, state())  # the liar's chunks never made it in
    finally:
        await swarm.close()


@pytest.mark.timeout(60)
async def test_freshest_of_equally_held_versions_wins_and_download_is_incremental() -> None:
    """Two donors stay at v1 and two publish v2: as many donors vouch for each, so the
    fresher wins (a version held by fewer donors does not win by being fresher,
    tests/attacks/test_state_version_hijack.py)."""
    async with averager_swarm(5, CONFIG) as swarm:
        *donors, joiner = swarm.peers
        for donor in donors:
            await donor.averager.publish_state(state(), b"v1")
        metadata, _ = await joiner.averager.load_state(timeout=10)
        assert metadata == b"v1"
        fetched_v1 = joiner.averager.state_sharer.downloaded_chunks

        v2 = state()
        v2[2] = v2[2] * 2  # one small tensor changes: one chunk, plus the header
        for donor in donors[2:]:
            await donor.averager.publish_state(v2, b"v2")
            await donor.averager.state_sharer.settle_advertisement()  # goes out after
        metadata, tensors = await joiner.averager.load_state(timeout=10)
        assert metadata == b"v2"
        assert_same(tensors, v2)
        fetched_v2 = joiner.averager.state_sharer.downloaded_chunks - fetched_v1
        assert fetched_v1 == math.ceil(25_600 / CHUNK) + math.ceil(24_000 / CHUNK) + 2
        assert fetched_v2 == 2  # header chunk (metadata changed) + the changed tensor


async def test_a_republished_state_is_served_at_once_and_advertised_after() -> None:
    """The first publish returns once its advertisement is stored: a joiner finds it at
    once. A later one returns once it is served, without waiting for the DHT (a round trip
    of every publishing step on a long link); until its advertisement lands, joiners get
    the version before it, which the donor still serves."""
    async with averager_swarm(2, CONFIG) as swarm:
        donor, joiner = swarm.peers
        sharer = donor.averager.state_sharer
        await donor.averager.publish_state(state(), b"v1")
        metadata, _ = await joiner.averager.load_state(timeout=10)
        assert metadata == b"v1"
        gate = asyncio.Event()
        store = sharer.dht.store

        async def held_store(*args: Any, **kwargs: Any) -> Any:
            await gate.wait()
            return await store(*args, **kwargs)

        sharer.dht.store = held_store  # type: ignore[method-assign]
        await asyncio.wait_for(donor.averager.publish_state(state(1), b"v2"), 10)
        metadata, tensors = await joiner.averager.load_state(timeout=10)
        assert metadata == b"v1"  # the advertisement of v2 is held: v1, still served
        assert_same(tensors, state())
        gate.set()
        await asyncio.wait_for(sharer.settle_advertisement(), 10)
        metadata, tensors = await joiner.averager.load_state(timeout=10)
        assert metadata == b"v2"
        assert_same(tensors, state(1))


async def test_a_shutdown_ends_an_advertisement_in_flight() -> None:
    """The background advertisement is the sharer's own task: a shutdown while its store is
    held cancels and awaits it (nothing is left pending on the loop)."""
    async with averager_swarm(1, CONFIG) as swarm:
        (donor,) = swarm.peers
        sharer = donor.averager.state_sharer
        await donor.averager.publish_state(state(), b"v1")
        entered, gate = asyncio.Event(), asyncio.Event()

        async def held_store(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            await gate.wait()  # never opened

        sharer.dht.store = held_store  # type: ignore[method-assign]
        await asyncio.wait_for(donor.averager.publish_state(state(1), b"v2"), 10)
        await asyncio.wait_for(entered.wait(), 10)
        advertiser = sharer._advertiser
        assert advertiser is not None
        assert not advertiser.done()
        await asyncio.wait_for(donor.stop(), 10)
        assert advertiser.cancelled()
        await asyncio.wait_for(sharer.settle_advertisement(), 1)  # nothing left to wait for
