"""Chunk size from the group's advertised bandwidths."""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.averaging.allreduce.chunking import (
    CHUNK_SECONDS,
    MAX_CHUNK_SECONDS,
    MAX_LINK_CHUNK_BYTES,
    MIN_LINK_CHUNK_BYTES,
    chunk_seconds,
    link_chunk_bytes,
)
from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.group import Member, Mode
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)


def members(*bandwidths: float) -> list[Member]:
    return [
        Member(bytes([i]) * 20, f"127.0.0.1:{1000 + i}", Mode.NODE, bandwidth)
        for i, bandwidth in enumerate(bandwidths)
    ]


@pytest.mark.parametrize(
    ("bandwidths", "expected"),
    [
        ((10.0, 10.0, 10.0, 10.0), 512 << 10),  # 80 Mbit/s
        ((12.5, 11.0), 1 << 20),  # 100 Mbit/s
        ((2.0, 30.0), 256 << 10),  # the slowest member decides: 16 Mbit/s, the floor
        ((15.0, 400.0), 1 << 20),
        ((25.0, 30.0), 2 << 20),
        ((150.0, 150.0), 2 << 20),  # loopback, LAN: the cap
        ((1e4, 1e4), 2 << 20),
        ((0.1, 1e4), 256 << 10),  # an under-claim cannot go below the floor
    ],
)
def test_chunk_follows_the_slowest_link(bandwidths: tuple[float, ...], expected: int) -> None:
    assert link_chunk_bytes(members(*bandwidths)) == expected


def test_chunk_is_a_power_of_two_within_bounds_and_never_grows_as_links_slow() -> None:
    previous = 0
    for mb_s in np.geomspace(0.1, 1e4, 200):
        chunk = link_chunk_bytes(members(float(mb_s)))
        assert MIN_LINK_CHUNK_BYTES <= chunk <= MAX_LINK_CHUNK_BYTES
        assert chunk & (chunk - 1) == 0
        assert chunk <= max(MIN_LINK_CHUNK_BYTES, mb_s * 1e6 * CHUNK_SECONDS)
        assert chunk >= previous
        previous = chunk


def test_members_that_reduce_nothing_do_not_count() -> None:
    client = Member(b"\x09" * 20, None, Mode.CLIENT, 0.0)
    assert link_chunk_bytes([*members(200.0), client]) == MAX_LINK_CHUNK_BYTES
    assert link_chunk_bytes([client]) == MAX_LINK_CHUNK_BYTES


async def test_members_agree_on_link_chunks_and_average_exactly(
    grpc_servers: GrpcServerPool,
) -> None:
    """No chunk size configured: every member derives the same one from the group (here
    256 KiB, from bandwidths of 10 MB/s), so a part of 1 MB streams as several chunks and
    the round is complete and exact."""
    config = AllReduceConfig(min_stall=2.0, registration_wait=2.0)
    assert config.chunk_bytes is None
    peers = await start_peers(grpc_servers, 3, config)
    channels = ChannelPool()
    try:
        rng = np.random.default_rng(1)
        inputs = [[rng.standard_normal(900_000).astype(np.float32)] for _ in peers]
        group = make_group(peers, inputs[0])
        slow = tuple(
            Member(m.peer_id, m.address, m.mode, 10.0, data_port=m.data_port) for m in group.members
        )
        group = type(group)(group.group_id, slow, group.schema_hash, group.codec)
        results = await run_group(peers, group, inputs, [1.0] * 3, channels, timeout=30)
        mean = np.mean([x[0] for x in inputs], axis=0)
        for r in results:
            assert isinstance(r, AveragingResult), r
            assert not r.partial
            np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
            assert r.tensors[0].tobytes() == results[0].tensors[0].tobytes()  # type: ignore[union-attr]
    finally:
        await channels.close()
        await close_peers(peers)


def test_a_chunk_time_is_a_streams_share_of_the_slowest_claimed_link() -> None:
    # 2 Mbit/s in a group of four: six streams share the link, 256 KiB take about 6.3 s.
    assert chunk_seconds(members(0.25, 12.5, 12.5, 12.5), 256 << 10) == pytest.approx(6.29, 0.01)
    # Without a size, the rule's chunk (the floor, at 0.25 MB/s).
    assert chunk_seconds(members(0.25, 12.5, 12.5, 12.5)) == pytest.approx(6.29, 0.01)
    # 20 Mbit/s in a group of sixteen: thirty streams.
    assert chunk_seconds(members(*[2.5] * 16), 256 << 10) == pytest.approx(3.15, 0.01)
    # Fast links: well inside the fixed floors (min_stall).
    assert chunk_seconds(members(12.5, 12.5, 12.5, 12.5)) < 1.0


def test_a_chunk_time_ignores_what_is_no_claim_and_caps_an_under_claim() -> None:
    client = Member(b"\x09" * 20, None, Mode.CLIENT, 0.0)
    assert chunk_seconds([*members(1.0), client], 1 << 20) == pytest.approx(2.1, 0.01)
    assert chunk_seconds(members(12.5), 1 << 20) == 0.0  # nobody to stream to
    assert chunk_seconds([client, client], 1 << 20) == 0.0  # no positive claim
    # A member claiming next to nothing stretches every patience at most this far.
    assert chunk_seconds(members(1e-6, 12.5, 12.5), 1 << 20) == MAX_CHUNK_SECONDS
