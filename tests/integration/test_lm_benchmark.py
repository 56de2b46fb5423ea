"""benchmarks/lm.py's one-minute configuration: the LM benchmark runs end to end (4 real
daemons, 4 trainer processes) and reports what docs/benchmarks.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = "benchmarks.lm"
"""Run as a module from the repository root, as docs/benchmarks.md runs it."""


@pytest.mark.timeout(900)
def test_the_smoke_configuration_reports_loss_bytes_and_identical_parameters() -> None:
    done = subprocess.run(
        [sys.executable, "-m", BENCHMARK, "--smoke", "--methods", "diloco-h20,sparseloco-h20"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=840,
        check=True,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["method"] for line in lines] == ["single-process", "diloco-h20", "sparseloco-h20"]
    reference = lines[0]["val_loss"]
    assert 0 < reference < 5.6  # below a uniform guess over 256 bytes (ln 256 = 5.55)
    for line in lines[1:]:
        assert line["parameters_identical"], line
        assert line["failed_rounds"] == 0, line
        assert line["rounds_per_peer"] == 5.0  # 100 steps / H = 20
        assert line["bytes_sent_per_peer"] > 0
        assert line["val_loss_vs_single"] == pytest.approx(line["val_loss"] / reference, rel=1e-3)
    # 2-bit top-k sends far fewer bytes than 8-bit dense codes for the same rounds.
    assert lines[2]["bytes_sent_per_peer"] * 2 < lines[1]["bytes_sent_per_peer"]
