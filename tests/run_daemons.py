"""Real ``swarmavg peer`` daemons of one run on 127.0.0.1, each with its own control socket,
and a stack that closes the clients a test opens to them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from tests.harness import ProcessPool, SwarmavgProcess


def run_daemon(
    pool: ProcessPool, run_id: str, i: int, join: SwarmavgProcess | None = None
) -> SwarmavgProcess:
    """Daemon ``i`` of run ``run_id`` (control socket ``p{i}.sock``), joining ``join``."""
    joining = ["--join", join.address] if join is not None else []
    control = str(pool.workdir / f"p{i}.sock")
    return pool.start(
        ["peer", "--listen", "127.0.0.1:0", "--control", control, "--run-id", run_id, *joining]
    )


def start_run(pool: ProcessPool, run_id: str, n: int) -> list[SwarmavgProcess]:
    """``n`` daemons of run ``run_id``, every later one joining the first."""
    first = run_daemon(pool, run_id, 0)
    return [first, *(run_daemon(pool, run_id, i, first) for i in range(1, n))]


@pytest.fixture
def clients() -> Iterator[ExitStack]:
    """Enter each client with ``clients.enter_context(connect(...))``; closed at teardown."""
    with ExitStack() as stack:
        yield stack
