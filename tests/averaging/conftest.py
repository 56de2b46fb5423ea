"""Fixtures shared by the all-reduce tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from swarmavg.dht import ChannelPool
from tests.averaging import allreduce_peers


@pytest.fixture
async def channels() -> AsyncIterator[ChannelPool]:
    """One channel pool for every peer of a test (closed at teardown)."""
    pool = ChannelPool()
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture(params=["grpc", "data-plane"])
def allreduce_transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test once with ``Reduce`` over gRPC and once over the framed-TCP data plane
    (``start_peers`` reads the switch)."""
    allreduce_peers.DATA_PLANE = request.param == "data-plane"
    try:
        yield str(request.param)
    finally:
        allreduce_peers.DATA_PLANE = False
