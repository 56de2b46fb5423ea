"""Fixtures shared by all test suites (see tests/harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.harness import GrpcServerPool, ProcessPool

TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the tests that load the machine into two queues for ``make test``'s workers
    (``pytest -n 4 --dist loadgroup``): those that start real daemons, train models or
    are marked ``slow`` (64 peers in one process, a 100M-element tensor) one after another
    on one worker, those on the network test bed one after another on another. They were
    written for a machine running one of them at a time, and two at once starve each
    other's rounds; the in-process tests, mostly waiting on timers and sockets, share the
    other workers. Without xdist the marker does nothing."""
    for item in items:
        path = item.path
        if path.is_relative_to(TESTS / "deploy"):
            item.add_marker(pytest.mark.xdist_group("testbed"))
        elif (
            item.get_closest_marker("integration")
            or item.get_closest_marker("slow")
            or path.is_relative_to(TESTS / "training")
        ):
            item.add_marker(pytest.mark.xdist_group("processes"))


@pytest.fixture
async def grpc_servers() -> AsyncIterator[GrpcServerPool]:
    """``await grpc_servers.start(n, register)`` -> n loopback addresses; stopped at teardown."""
    pool = GrpcServerPool()
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
def swarmavg_processes(tmp_path: Path) -> Iterator[ProcessPool]:
    """``swarmavg_processes.start([...])`` runs the CLI and waits for its ready line."""
    pool = ProcessPool(tmp_path)
    try:
        yield pool
    finally:
        pool.close()
