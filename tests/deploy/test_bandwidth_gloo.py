"""``benchmarks/bandwidth.py --gloo`` on the multi-host test bed: torch gloo's ``all_reduce``
runs beside our rounds, one rank per host in the host's namespace, over the bed's links.

Its figures must be there, every rank's sum must match the exact sum (checked by the
rank itself, every timed round), and its bytes must have crossed the hosts' shaped links:
a ring moves at least 2(N-1)/N of the tensor out of every host.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.testbed import missing_requirements

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SUM_TOLERANCE = 1e-5
"""benchmarks/testbed_gloo.py's bound on a sum's error relative to the largest exact sum (a
test imports nothing from the benchmarks: it runs them as a user does)."""
BENCHMARK = "benchmarks.bandwidth"
"""Run as a module from the repository root, as docs/benchmarks.md runs it."""


@pytest.mark.timeout(240)
def test_gloo_runs_beside_our_rounds_on_the_testbed() -> None:
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    hosts, rounds, mb = 3, 2, 2.0
    argv = [sys.executable, "-m", BENCHMARK, "--gloo", "--hosts", str(hosts), "--mb", str(mb)]
    argv += ["--codecs", "none", "--rounds", str(rounds), "--rate-mbit", "100"]
    argv += ["--raw-repeats", "1", "--timeout", "60"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    gloo = figures["gloo"]
    assert "error" not in gloo, gloo["error"]
    assert gloo["failed_rounds"] == []
    assert len(gloo["rounds_seconds"]) == rounds
    assert gloo["seconds"] > 0
    assert gloo["sum_ok"], gloo
    assert gloo["max_rel_error"] <= SUM_TOLERANCE
    payload_mb = 2 * (hosts - 1) / hosts * mb
    assert gloo["wire_mb_per_host"] >= payload_mb, gloo
    ours = figures["codecs"]["none"]
    assert ours["failed_rounds"] == [], ours["failed_rounds"]
    assert figures["none_vs_gloo"] == pytest.approx(ours["seconds"] / gloo["seconds"], rel=0.01)
