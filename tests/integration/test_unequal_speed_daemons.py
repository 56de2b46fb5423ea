"""The unequal-speed benchmark (``python -m benchmarks.unequal_speed``) at a small size:
four real daemons, four trainer processes of unequal (simulated) speed, ``DiLoCo`` with a
pace, and the slowest trainer's process stopped (SIGSTOP) and resumed mid-run.

Bounded, and nothing is asserted about seconds: identical anchors after every sync, the
others' syncs while one trainer is stopped, and its return. That a pace lets the fast
members run more inner steps than a fixed H is shown without daemons, faster
(tests/training/test_unequal_speed.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def run(*argv: str, timeout: float) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.unequal_speed", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stderr[-4000:]
    assert lines, done.stderr[-4000:]
    figures: dict[str, object] = json.loads(lines[-1])
    return figures


@pytest.mark.timeout(600)
def test_a_stopped_trainer_does_not_stop_the_others_and_comes_back() -> None:
    figures = run(
        "--speeds", "1,1,1,0.5", "--modes", "pace", "--seconds", "15", "--step-ms", "20",
        "--local-steps", "10", "--timeout", "6", "--stall", "5", "--no-stall-control",
        timeout=580,
    )  # fmt: skip
    (paced,) = figures["runs"]  # type: ignore[misc]
    stall = paced["stall"]
    assert paced["identical_anchors"], paced
    # the others kept computing while it was stopped: more outer steps than it took
    assert stall["victim_syncs"] >= 1, stall
    assert stall["late_merges"] + stall["late_discards"] + stall["rejoins"] >= 1, stall
    assert stall["victim_outer_steps"] >= stall["swarm_outer_steps"] - 1, stall
    assert stall["rejoined"], stall
