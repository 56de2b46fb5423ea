"""Fixtures shared by all test suites (see tests/harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.harness import GrpcServerPool, ProcessPool


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
