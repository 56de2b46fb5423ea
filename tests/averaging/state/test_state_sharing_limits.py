"""Donor streams have deadlines: slow joiners cannot take every upload slot."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from swarmavg.averaging import StateDownloadError
from swarmavg.averaging.state.config import StateSharingConfig
from swarmavg.averaging.stubs import DOWNLOAD_STATE, download_state_method
from swarmavg.dht.auth import RequestSigner
from swarmavg.dht.identity import Identity
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import RUN_ID, AveragerSwarm, fast_config

CONFIG = fast_config(
    state=StateSharingConfig(chunk_size=1 << 20, message_timeout=1.0, max_uploads=8)
)


@pytest.mark.timeout(90)
async def test_eight_slow_readers_do_not_make_every_joiner_busy() -> None:
    """8 joiners ask a donor for every chunk of a 32 MiB state and never read. Without a
    write deadline on donor streams the 8 held every upload slot for as
    long as they liked and every other joiner got ``STATE_BUSY`` (``load_state`` raised
    StateDownloadError). Now a reader that does not keep up is cut and the joiner loads.
    (8 identities: one identity holds at most 2 slots,
    tests/attacks/test_state_upload_slots.py.)"""
    swarm = AveragerSwarm()
    channels: list[grpc.aio.Channel] = []
    calls: list[grpc.aio.UnaryStreamCall] = []
    try:
        donor = await swarm.add(CONFIG)
        joiner = await swarm.add(CONFIG)
        rng = np.random.default_rng(1)
        tensors = [rng.standard_normal(8 << 20).astype(np.float32)]  # 32 MiB, 32 chunks
        await donor.averager.publish_state(tensors, b"step=7")
        sharer = donor.averager.state_sharer
        manifest = sharer.published
        assert manifest is not None
        for _ in range(8):
            channel = grpc.aio.insecure_channel(
                donor.address, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            channels.append(channel)
            request = averaging_pb2.StateRequest(
                root=manifest.root, chunk_hashes=manifest.chunk_hashes
            )
            slow = RequestSigner(Identity.generate(), RUN_ID, lambda: "")
            slow.signed(request, donor.node.peer_id, DOWNLOAD_STATE)
            calls.append(download_state_method(channel)(request, timeout=60))
        await asyncio.wait_for(sharer.uploads.wait_until(lambda n: n == 8), 30)
        metadata, loaded = await joiner.averager.load_state(timeout=30)
        assert metadata == b"step=7"
        assert loaded[0].tobytes() == tensors[0].tobytes()
        assert sharer.uploads_cut.value == 8
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
        await swarm.close()


@pytest.mark.timeout(60)
async def test_joiner_refuses_a_state_larger_than_it_asked_for() -> None:
    """A joiner that expects a 1 MiB model is offered a 32 MiB state. Without a bound it
    would download and buffer whatever was advertised (up to ``max_state_bytes``, 16 GiB);
    now ``max_bytes`` refuses it before any chunk is fetched, and a bound that fits loads."""
    swarm = AveragerSwarm()
    try:
        donor = await swarm.add(CONFIG)
        joiner = await swarm.add(CONFIG)
        rng = np.random.default_rng(2)
        tensors = [rng.standard_normal(8 << 20).astype(np.float32)]  # 32 MiB
        await donor.averager.publish_state(tensors, b"m")
        with pytest.raises(StateDownloadError, match="bound"):
            await joiner.averager.load_state(timeout=20, max_bytes=1 << 20)
        assert joiner.averager.state_sharer.downloaded_chunks == 0
        _, loaded = await joiner.averager.load_state(timeout=20, max_bytes=33 << 20)
        assert loaded[0].tobytes() == tensors[0].tobytes()
    finally:
        await swarm.close()
