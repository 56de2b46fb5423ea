"""Machines of trainer ranks on loopback, for the hierarchical-mode tests and benchmark.

A "machine" is one real ``swarmavg peer`` daemon and ``ranks`` trainer processes
(tests/training/hier_worker.py) in one gloo group with a FileStore of its own; the
group's rank 0 talks to the daemon. :func:`run_machines` starts every rank, releases them
together once all are built (a start barrier) and returns what each wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.harness import ProcessPool, SwarmavgProcess

WORKER = Path(__file__).with_name("hier_worker.py")
REPO = Path(__file__).resolve().parents[2]
Records = dict[tuple[int, int], dict[str, Any]]


def start_daemons(
    pool: ProcessPool, n: int, run_id: str, ready_timeout: float = 120.0
) -> list[SwarmavgProcess]:
    """``n`` daemons of ``run_id``, the others joining the first. The ready wait is longer
    than the harness's default: these tests start up to six Python processes at once, and
    on a loaded machine a daemon's start alone can pass 30 s."""
    base = ["peer", "--listen", "127.0.0.1:0", "--run-id", run_id]
    first = pool.start(
        [*base, "--control", str(pool.workdir / "m0.sock")], ready_timeout=ready_timeout
    )
    daemons = [first]
    for i in range(1, n):
        daemons.append(
            pool.start(
                [*base, "--join", first.address, "--control", str(pool.workdir / f"m{i}.sock")],
                ready_timeout=ready_timeout,
            )
        )
    return daemons


def worker_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
        "OMP_NUM_THREADS": "1",
    }


def run_machines(
    workdir: Path,
    daemons: list[SwarmavgProcess],
    ranks: int,
    timeout: float,
    *,
    run_id: str,
    batch_of: Callable[[int, int], int],
    **spec: Any,
) -> Records:
    """Start ``ranks`` ranks per daemon, wait for all, return their records by (machine,
    rank). ``spec`` goes to every worker; a dict value ``{"MR": value}`` is per (machine
    M, rank R), None for the others."""
    procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
    outs: dict[tuple[int, int], Path] = {}
    for m, daemon in enumerate(daemons):
        for r in range(ranks):
            out = workdir / f"m{m}r{r}"
            full = {
                "run_id": run_id,
                "control": daemon.control,
                "store": str(workdir / f"store-{m}"),
                "rank": r,
                "size": ranks,
                "batch": batch_of(m, r),
                "data_seed": 10 * m + r,
                # the leaders start alike (as a run's peers do); their followers start
                # elsewhere: the leader's parameters must win
                "model_seed": 0 if r == 0 else 100 * m + r,
                "out": str(out),
                "go_file": str(workdir / "go") if spec.get("barrier", True) else None,
                **spec,
            }
            for key, value in spec.items():  # per-(machine, rank) values: {"MR": value}
                if isinstance(value, dict):
                    full[key] = value.get(f"{m}{r}")
            outs[(m, r)] = out
            procs[(m, r)] = subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(full)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=worker_env(),
                cwd=workdir,
            )
    records: Records = {}
    try:
        if spec.get("barrier", True):
            release_when_ready(workdir, procs, outs, timeout)
        deadline = time.monotonic() + timeout
        for key, proc in procs.items():
            try:
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {key} did not finish: {dump_stacks(procs)}") from None
            json_path = outs[key].with_suffix(".json")
            record = json.loads(json_path.read_text()) if json_path.exists() else {}
            record["returncode"] = proc.returncode
            record["stderr"] = err.decode(errors="replace")[-3000:]
            if outs[key].with_suffix(".pt").exists():
                record["params"] = torch.load(outs[key].with_suffix(".pt"))
            records[key] = record
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return records


def dump_stacks(procs: dict[tuple[int, int], subprocess.Popen[bytes]]) -> dict[str, str]:
    """Every rank's stderr, with the stacks of those still running (hier_worker dumps
    them on SIGUSR1), for the failure message; the ranks are stopped."""
    running = [key for key, proc in procs.items() if proc.poll() is None]
    for key in running:
        procs[key].send_signal(signal.SIGUSR1)
    details: dict[str, str] = {}
    for key, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate(timeout=10)
        details[f"{key} ({'running' if key in running else proc.returncode})"] = err.decode(
            errors="replace"
        )[-4000:]
    return details


def release_when_ready(
    workdir: Path,
    procs: dict[tuple[int, int], subprocess.Popen[bytes]],
    outs: dict[tuple[int, int], Path],
    timeout: float,
) -> None:
    """The start barrier (hier_worker.start_barrier): once every rank has built its
    wrapper, let them all train; a rank that exits before that fails the test."""
    deadline = time.monotonic() + timeout
    while not all(out.with_suffix(".ready").exists() for out in outs.values()):
        exited = {key: p.returncode for key, p in procs.items() if p.poll() is not None}
        if exited or time.monotonic() > deadline:
            late = [key for key, out in outs.items() if not out.with_suffix(".ready").exists()]
            raise AssertionError(
                f"ranks {late} did not get ready (exited: {exited}): {dump_stacks(procs)}"
            )
        time.sleep(0.02)
    (workdir / "go").write_text("go")
