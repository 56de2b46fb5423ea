"""``benchmarks/bandwidth.py --unsync`` on the multi-host test bed (one swarm under real
timing): every host's training process runs its own loop, starting a seeded
random offset apart, in the default configuration (no group size), over rate-limited links.
Every round must still be one group of all hosts, with no error.
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
BENCHMARK = "benchmarks.bandwidth"
"""Run as a module from the repository root, as docs/benchmarks.md runs it."""


@pytest.mark.timeout(240)
def test_unsync_rounds_are_one_group_on_the_testbed() -> None:
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    hosts, rounds = 3, 3
    argv = [sys.executable, "-m", BENCHMARK, "--unsync", "--hosts", str(hosts), "--mb", "2"]
    argv += ["--codecs", "none", "--rounds", str(rounds), "--rate-mbit", "100"]
    argv += ["--raw-repeats", "0", "--timeout", "60"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["mode"] == "unsync"
    assert figures["group_size"] == "default"
    assert "error" not in figures, figures["error"]
    none = figures["codecs"]["none"]
    assert none["calls"] == hosts * rounds, none
    assert none["one_group_rounds"] == rounds, (none["shape_by_round"], none["errors"])
    assert none["group_sizes"] == {str(hosts): hosts * rounds}, none
    assert none["no_group_errors"] == 0, none["errors"]
    assert none["other_errors"] == 0, none["errors"]
    assert none["partial"] == 0
    assert none["bit_identical"], none
    assert none["exact_within_tolerance"], none
    assert none["link_bound_s"] > 0
