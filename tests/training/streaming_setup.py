"""The model and Streaming DiLoCo settings shared by the fault tests and their trainer
process (tests/training/stream_trainer.py), so that every member builds the same."""

from __future__ import annotations

from typing import Any

import torch

from swarmavg.averaging.optim import StreamingDiLoCo
from tests.harness import ProcessPool, SwarmavgProcess

RUN = "train-test"
DAEMON_READY = 240.0
"""Seconds a daemon may take to print its ready line: a deadline for a loaded machine
(these tests start three), not a measurement."""
PROGRESS_TTL = 3.0
"""Seconds a killed member's progress record outlives it (then the others stop expecting it)."""
ROUND_TIMEOUT = 8.0


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every member starts from the same parameters
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 2))


def make_streaming(model: torch.nn.Module, client: Any, run_id: str = RUN) -> StreamingDiLoCo:
    """``run_id``: the trainers' run (one per test where tests share daemons)."""
    return StreamingDiLoCo(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.05),
        client=client,
        run_id=run_id,
        local_steps=4,
        fragments=2,
        overlap_steps=1,
        batch_size_per_step=4,
        codec="uint4-blockwise",
        averaging_timeout=ROUND_TIMEOUT,
        progress_ttl=PROGRESS_TTL,
    )


def start_daemons(pool: ProcessPool, n: int) -> list[SwarmavgProcess]:
    """``n`` daemons of run ``RUN``, the others bootstrapped from the first."""
    first = pool.start(
        [
            "peer",
            "--listen",
            "127.0.0.1:0",
            "--run-id",
            RUN,
            "--control",
            f"{pool.workdir}/p0.sock",
        ],
        ready_timeout=DAEMON_READY,
    )
    return [first, *(join_daemon(pool, first, i) for i in range(1, n))]


def join_daemon(pool: ProcessPool, first: SwarmavgProcess, i: int) -> SwarmavgProcess:
    return pool.start(
        [
            "peer",
            "--listen",
            "127.0.0.1:0",
            "--join",
            first.address,
            "--run-id",
            RUN,
            "--control",
            f"{pool.workdir}/p{i}.sock",
        ],
        ready_timeout=DAEMON_READY,
    )
