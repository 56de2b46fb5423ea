"""Fixtures shared by the all-reduce tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.averaging import allreduce_peers


@pytest.fixture(params=["grpc", "data-plane"])
def allreduce_transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test once with ``Reduce`` over gRPC and once over the framed-TCP data plane
    (``start_peers`` reads the switch)."""
    allreduce_peers.DATA_PLANE = request.param == "data-plane"
    try:
        yield str(request.param)
    finally:
        allreduce_peers.DATA_PLANE = False
