"""README's training script, run as written: two real daemons, two trainer processes that
start one after the other, one model at the end."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ProcessPool
from tests.run_daemons import start_run

pytestmark = pytest.mark.integration
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(start: str, language: str) -> str:
    """The README's fenced ``language`` block that starts with ``start``."""
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.DOTALL)
    found = [b for b in blocks if b.startswith(start)]
    assert len(found) == 1, f"README has {len(found)} {language} blocks starting {start!r}"
    return str(found[0])


def test_the_readme_commands_match_what_this_test_runs() -> None:
    commands = readme_block("swarmavg peer --listen 127.0.0.1:31337", "bash")
    assert "--run-id demo --control /tmp/demo-a.sock" in commands
    assert "--join 127.0.0.1:31337 --run-id demo --control /tmp/demo-b.sock" in commands
    assert "SWARMAVG_CONTROL=/tmp/demo-b.sock python train.py" in commands


@pytest.mark.timeout(240)
def test_the_readme_training_script_ends_with_one_model(
    swarmavg_processes: ProcessPool, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(readme_block("# train.py\n", "python"))
    # the README's commands, with ports from the OS (tests never take fixed ports)
    first, second = start_run(swarmavg_processes, "demo", 2)
    trainers = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**os.environ, "SWARMAVG_CONTROL": daemon.control},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for daemon in (first, second)
    ]
    outputs = []
    for trainer in trainers:
        out, err = trainer.communicate(timeout=200)
        assert trainer.returncode == 0, err
        outputs.append(out.strip().splitlines()[-1])
    epochs_and_weights = [ast.literal_eval(line.split("weights", 1)[1].strip()) for line in outputs]
    assert all(line.startswith("epoch 10 ") for line in outputs), outputs
    assert epochs_and_weights[0] == epochs_and_weights[1], outputs
