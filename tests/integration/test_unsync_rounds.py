"""benchmarks/unsync_rounds.py at a tiny size: one swarm under real timing.

Three real ``swarmavg peer`` daemons (CLI) in the default configuration (no group size
anywhere) and three client processes that start apart and compute for their own seeded
time between calls, with no shared start instant: the way a user runs them. Every round
must be one group of all three, with no error, exact and bit-identical results.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = "benchmarks.unsync_rounds"
"""Run as a module from the repository root, as docs/benchmarks.md runs it."""
ROUNDS = 6


@pytest.mark.timeout(240)
def test_staggered_workers_that_compute_between_calls_form_one_group_every_round(
    tmp_path: Path,
) -> None:
    argv = [sys.executable, "-m", BENCHMARK, "--peers", "3", "--rounds", str(ROUNDS), "--mb", "1"]
    argv += ["--codecs", "none", "--compute", "1", "--stagger", "1", "--seed", "1"]
    argv += ["--timeout", "30", "--daemon-log-level", "DEBUG", "--log-dir", str(tmp_path)]
    # Bounded: start-up, 6 rounds of at most 1 s compute each, and one timed-out call.
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    figures = json.loads(lines[-1])
    assert "error" not in figures, (figures["error"], done.stderr[-3000:])
    assert done.returncode == 0, done.stderr[-3000:]
    (config,) = figures["configs"]
    what = {
        k: config[k]
        for k in ("shape_by_round", "errors", "daemon_closes", "daemon_rejections", "staggers_s")
    }
    assert config["calls"] == 3 * ROUNDS
    assert config["no_group_errors"] == 0, what
    assert config["other_errors"] == 0, what
    assert config["one_group_rounds"] == ROUNDS, what
    assert config["group_sizes"] == {"3": 3 * ROUNDS}, what
    assert config["partial"] == 0, what
    assert config["bit_identical"], what
    assert config["unchecked_results"] == 0
    assert config["exact_within_tolerance"] is True, config
