"""benchmarks/lm_sim.py: DiLoCo's math on the LM workload in one process (no daemons)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = "benchmarks.lm_sim"
"""Run as a module from the repository root, as docs/benchmarks.md runs it."""


@pytest.mark.timeout(300)
def test_a_short_sweep_reports_the_reference_and_one_line_per_interval() -> None:
    done = subprocess.run(
        [sys.executable, "-m", BENCHMARK, "--steps", "12", "--warmup", "2", "--intervals", "1,12"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
        check=True,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["method"] for line in lines] == [
        "single-process",
        "diloco-sim-h1",
        "diloco-sim-h12",
    ]
    reference = lines[0]["val_loss"]
    for line in lines:
        assert 0 < line["val_loss"] < math.log(256)  # learned something in 12 steps
    for line in lines[1:]:
        assert line["val_loss_vs_single"] == pytest.approx(line["val_loss"] / reference, rel=1e-3)
