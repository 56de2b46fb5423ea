"""Machines of trainer ranks on loopback, for the hierarchical-mode tests and benchmark.

A "machine" is one real ``swarmavg peer`` daemon and ``ranks`` trainer processes
(tests/training/hier_worker.py) in one gloo group with a FileStore of its own; the
group's rank 0 talks to the daemon. :func:`run_machines` starts every rank for one
scenario; :class:`ServedRanks` starts them once and runs one scenario per call. Either
releases the ranks together once all are built (a start barrier) and returns what each
wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
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


Procs = Mapping[tuple[int, int], subprocess.Popen[bytes]]


def rank_spec(
    workdir: Path,
    daemons: list[SwarmavgProcess],
    key: tuple[int, int],
    ranks: int,
    *,
    run_id: str,
    batch_of: Callable[[int, int], int],
    **spec: Any,
) -> dict[str, Any]:
    """The worker spec of rank ``key`` = (machine, rank) for one scenario in ``workdir``:
    ``spec`` with the rank's own fields; a dict value ``{"MR": value}`` of ``spec`` is
    per (machine M, rank R), None for the others."""
    m, r = key
    full = {
        "run_id": run_id,
        "control": daemons[m].control,
        "store": str(workdir / f"store-{m}"),
        "rank": r,
        "size": ranks,
        "batch": batch_of(m, r),
        "data_seed": 10 * m + r,
        # the leaders start alike (as a run's peers do); their followers start
        # elsewhere: the leader's parameters must win
        "model_seed": 0 if r == 0 else 100 * m + r,
        "out": str(workdir / f"m{m}r{r}"),
        "go_file": str(workdir / "go") if spec.get("barrier", True) else None,
        **spec,
    }
    for name, value in spec.items():
        if isinstance(value, dict):
            full[name] = value.get(f"{m}{r}")
    return full


def start_rank(args: list[str], stderr: Path, cwd: Path, **popen: Any) -> subprocess.Popen[bytes]:
    """A worker process; its stderr goes to a file, read for the failure messages (a file
    cannot fill up and block the rank as an unread pipe would)."""
    with stderr.open("ab") as err:
        return subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=worker_env(),
            cwd=cwd,
            **popen,
        )


def read_record(out: Path, proc: subprocess.Popen[bytes], stderr: Path) -> dict[str, Any]:
    """What the rank wrote for its scenario, with its return code (None while it serves
    more) and the tail of its stderr."""
    json_path = out.with_suffix(".json")
    record: dict[str, Any] = json.loads(json_path.read_text()) if json_path.exists() else {}
    record["returncode"] = proc.poll()
    record["stderr"] = stderr.read_text(errors="replace")[-3000:]
    if out.with_suffix(".pt").exists():
        record["params"] = torch.load(out.with_suffix(".pt"))
    return record


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
    """Start ``ranks`` ranks per daemon for one scenario (``spec``, see :func:`rank_spec`),
    wait for all to exit, return their records by (machine, rank)."""
    procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
    outs: dict[tuple[int, int], Path] = {}
    errs = {key: workdir / f"m{key[0]}r{key[1]}.err" for key in machine_ranks(daemons, ranks)}
    for key, err in errs.items():
        full = rank_spec(workdir, daemons, key, ranks, run_id=run_id, batch_of=batch_of, **spec)
        outs[key] = Path(full["out"])
        procs[key] = start_rank([json.dumps(full)], err, workdir)
    records: Records = {}
    try:
        if spec.get("barrier", True):
            release_when_ready(workdir, procs, outs, errs, timeout)
        deadline = time.monotonic() + timeout
        for key, proc in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stacks = dump_stacks(procs, errs)
                raise AssertionError(f"rank {key} did not finish: {stacks}") from None
            records[key] = read_record(outs[key], proc, errs[key])
    finally:
        stop_ranks(procs)
    return records


class ServedRanks:
    """``ranks`` trainer ranks per daemon, started once and given one scenario per
    :meth:`run` (hier_worker.py ``--serve``): a test pays Python's and torch's start only
    when the ranks of an earlier one broke (a rank that exited or hung is stopped with
    all the others, and the next scenario starts fresh ones)."""

    def __init__(self, logdir: Path, daemons: list[SwarmavgProcess], ranks: int) -> None:
        self.logdir = logdir
        self.daemons = daemons
        self.ranks = ranks
        self.procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self.errs = {
            key: logdir / f"m{key[0]}r{key[1]}.err" for key in machine_ranks(daemons, ranks)
        }

    def run(
        self,
        workdir: Path,
        timeout: float,
        *,
        run_id: str,
        batch_of: Callable[[int, int], int],
        **spec: Any,
    ) -> Records:
        """Run one scenario (``spec``, see :func:`rank_spec`) in ``workdir`` on every rank;
        return the records by (machine, rank) once every rank wrote its own."""
        if not self.procs or any(proc.poll() is not None for proc in self.procs.values()):
            self.close()
            self.procs = {
                key: start_rank(["--serve"], err, self.logdir, stdin=subprocess.PIPE)
                for key, err in self.errs.items()
            }
        outs: dict[tuple[int, int], Path] = {}
        try:
            for key, proc in self.procs.items():
                full = rank_spec(
                    workdir, self.daemons, key, self.ranks, run_id=run_id, batch_of=batch_of, **spec
                )
                outs[key] = Path(full["out"])
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(full).encode() + b"\n")
                proc.stdin.flush()
            if spec.get("barrier", True):
                release_when_ready(workdir, self.procs, outs, self.errs, timeout)
            records = {key: out.with_suffix(".json") for key, out in outs.items()}
            wait_for_files(records, self.procs, self.errs, timeout, "did not finish")
        except BaseException:
            self.close()
            raise
        return {key: read_record(outs[key], p, self.errs[key]) for key, p in self.procs.items()}

    def close(self) -> None:
        """End the ranks: end of input (they exit after their scenario), else killed."""
        for proc in self.procs.values():
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()
        stop_ranks(self.procs, grace=10.0)
        self.procs = {}


def machine_ranks(daemons: list[SwarmavgProcess], ranks: int) -> list[tuple[int, int]]:
    return [(m, r) for m in range(len(daemons)) for r in range(ranks)]


def stop_ranks(procs: Procs, grace: float = 0.0) -> None:
    deadline = time.monotonic() + grace
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def dump_stacks(procs: Procs, errs: Mapping[tuple[int, int], Path]) -> dict[str, str]:
    """Every rank's stderr, with the stacks of those still running (hier_worker dumps
    them on SIGUSR1), for the failure message; the ranks are stopped."""
    running = [key for key, proc in procs.items() if proc.poll() is None]
    for key in running:
        procs[key].send_signal(signal.SIGUSR1)
    details: dict[str, str] = {}
    deadline = time.monotonic() + 5.0  # the time faulthandler takes to write the stacks
    for key, proc in procs.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        state = "running" if key in running else proc.returncode
        details[f"{key} ({state})"] = errs[key].read_text(errors="replace")[-4000:]
    return details


def wait_for_files(
    paths: Mapping[tuple[int, int], Path],
    procs: Procs,
    errs: Mapping[tuple[int, int], Path],
    timeout: float,
    what: str,
    early: Mapping[tuple[int, int], Path] | None = None,
) -> None:
    """Wait until every rank wrote its file of ``paths``; a rank that exits first, or
    writes its file of ``early`` first (a record before it got ready: it failed), or the
    deadline fails the test with every rank's stacks."""
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths.values()):
        exited = {key: p.returncode for key, p in procs.items() if p.poll() is not None}
        failed = {  # what the rank wrote says why
            k: path.read_text()[:1000]
            for k, path in (early or {}).items()
            if path.exists() and not paths[k].exists()
        }
        if exited or failed or time.monotonic() > deadline:
            late = [key for key, path in paths.items() if not path.exists()]
            raise AssertionError(
                f"ranks {late} {what} (exited: {exited}, failed: {failed}): "
                f"{dump_stacks(procs, errs)}"
            )
        time.sleep(0.02)


def release_when_ready(
    workdir: Path,
    procs: Procs,
    outs: Mapping[tuple[int, int], Path],
    errs: Mapping[tuple[int, int], Path],
    timeout: float,
) -> None:
    """The start barrier (hier_worker.start_barrier): once every rank has built its
    wrapper, let them all train; a rank that exits, or writes its record, before that
    fails the test."""
    ready = {key: out.with_suffix(".ready") for key, out in outs.items()}
    records = {key: out.with_suffix(".json") for key, out in outs.items()}
    wait_for_files(ready, procs, errs, timeout, "did not get ready", early=records)
    (workdir / "go").write_text("go")
