"""Fixtures of the training tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import ProcessPool


@pytest.fixture
def daemon_pool(swarmavg_processes: ProcessPool) -> Iterator[ProcessPool]:
    """``swarmavg_processes`` whose stdout pipes are closed at teardown.

    tests/harness.py stops the processes but leaves their stdout pipe open, which
    ``filterwarnings=error`` turns into a ResourceWarning error (reported to the lead).
    """
    yield swarmavg_processes
    for handle in swarmavg_processes.processes:
        handle.stop(timeout=10)
        if handle.proc.stdout is not None:
            handle.proc.stdout.close()
