"""Fixtures of the multi-process peer tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import ProcessPool


@pytest.fixture
def procs(swarmavg_processes: ProcessPool) -> Iterator[ProcessPool]:
    """``swarmavg_processes`` that also closes each process's stdout pipe at teardown.

    tests/harness.py stops the processes but leaves the pipe its reader thread used open,
    which ``filterwarnings=error`` turns into a ResourceWarning error at teardown.
    """
    yield swarmavg_processes
    handles = list(swarmavg_processes.processes)
    swarmavg_processes.close()
    for handle in handles:
        if handle.proc.stdout is not None:
            handle.proc.stdout.close()
