"""Chunk size from the group's advertised bandwidths (issue 21)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from swarmavg.averaging.allreduce.chunking import (
    CHUNK_SECONDS,
    LEGACY_CHUNK_CAP,
    MAX_LINK_CHUNK_BYTES,
    MIN_LINK_CHUNK_BYTES,
    link_chunk_bytes,
)
from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.partition import MAX_CHUNK_BYTES
from swarmavg.averaging.group import Member, Mode
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)


def members(*bandwidths: float, cap: int = MAX_LINK_CHUNK_BYTES) -> list[Member]:
    """Members of this version (``cap=0``: of a version before the chunk cap)."""
    return [
        Member(bytes([i]) * 20, f"127.0.0.1:{1000 + i}", Mode.NODE, bandwidth, chunk_cap=cap)
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
        ((41.0, 50.0), 2 << 20),  # 4.1 MB: rounds down to 2 MiB
        ((42.0, 50.0), 3 << 20),  # 4.2 MB: 4 MiB, over the cap
        ((150.0, 150.0), 3 << 20),  # loopback, LAN: the cap
        ((1e4, 1e4), 3 << 20),
        ((0.1, 1e4), 256 << 10),  # an under-claim cannot go below the floor
    ],
)
def test_chunk_follows_the_slowest_link(bandwidths: tuple[float, ...], expected: int) -> None:
    assert link_chunk_bytes(members(*bandwidths)) == expected


def test_chunk_is_a_power_of_two_or_the_cap_and_never_grows_as_links_slow() -> None:
    assert MAX_LINK_CHUNK_BYTES <= MAX_CHUNK_BYTES  # what one message may carry
    previous = 0
    for mb_s in np.geomspace(0.1, 1e4, 200):
        chunk = link_chunk_bytes(members(float(mb_s)))
        assert MIN_LINK_CHUNK_BYTES <= chunk <= MAX_LINK_CHUNK_BYTES
        assert chunk & (chunk - 1) == 0 or chunk == MAX_LINK_CHUNK_BYTES
        assert chunk <= max(MIN_LINK_CHUNK_BYTES, mb_s * 1e6 * CHUNK_SECONDS)
        assert chunk >= previous
        previous = chunk


def test_a_member_of_an_older_version_keeps_the_group_at_its_cap() -> None:
    """Members that do not say they cut 3 MiB chunks (0: a version before the cap; any
    other value) hold the group to the 2 MiB every older member computes, whatever the
    links; a client's cap counts too (it cuts chunks as well)."""
    new = members(200.0, 200.0, 200.0)
    assert link_chunk_bytes(new) == MAX_LINK_CHUNK_BYTES
    assert link_chunk_bytes(members(200.0, 200.0, 200.0, cap=0)) == LEGACY_CHUNK_CAP
    for cap in (0, 1, 1 << 20, MAX_LINK_CHUNK_BYTES - 1):
        mixed = [*new[:2], replace(new[2], chunk_cap=cap)]
        assert link_chunk_bytes(mixed) == LEGACY_CHUNK_CAP
    assert link_chunk_bytes([*new[:2], replace(new[2], chunk_cap=(1 << 32) - 1)]) == (
        MAX_LINK_CHUNK_BYTES
    )
    old_client = Member(b"\x09" * 20, None, Mode.CLIENT, 0.0)
    assert link_chunk_bytes([*new, old_client]) == LEGACY_CHUNK_CAP
    # Slow links decide below either cap, alike for old and new members.
    assert link_chunk_bytes(members(12.5, 11.0, cap=0)) == 1 << 20
    assert link_chunk_bytes(members(12.5, 11.0)) == 1 << 20


def test_members_that_reduce_nothing_do_not_count() -> None:
    client = Member(b"\x09" * 20, None, Mode.CLIENT, 0.0, chunk_cap=MAX_LINK_CHUNK_BYTES)
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
