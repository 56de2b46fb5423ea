"""The digits benchmark's setup, which the Byzantine test trains with from threads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
CHECK = """
import threading
import torch
from benchmarks.training import make_model

reference = [p.detach().clone() for p in make_model(0).parameters()]
start = threading.Barrier(8)
built = []

def build():
    start.wait(timeout=30)
    for _ in range(20):
        built.append([p.detach().clone() for p in make_model(0).parameters()])

threads = [threading.Thread(target=build) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=30)
assert len(built) == 160, len(built)
for params in built:
    assert all(torch.equal(p, q) for p, q in zip(params, reference, strict=True))
"""
"""Runs in a child process from the repository root: the tests never import the
benchmarks, they run them as a user does."""


@pytest.mark.timeout(60)
def test_models_built_in_threads_at_once_start_from_the_same_parameters() -> None:
    """torch's default generator is shared by a process's threads: trainers that seed and
    build at the same moment must still get the seed's parameters (the swarm would
    otherwise repair three of four members at the first round)."""
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=55, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
