"""The hierarchical mode end to end: 2 "machines" x 2 local ranks on loopback.

Each machine is a real ``swarmavg peer`` daemon and two trainer processes
(tests/training/hier_worker.py) in one gloo group (a FileStore of its own); only each
group's rank 0 talks to its daemon. The tests check what a user of a DDP job expects:
every rank ends with the same parameters, equal to the swarm's step on the mean of all
four ranks' contributions weighted by their samples; the swarm sees one process per
machine; and a leader that vanishes makes its follower fail, not hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from tests.harness import ProcessPool, SwarmavgProcess  # noqa: E402
from tests.training.hier_worker import LR, backward, fixed_batch, make_model  # noqa: E402

pytestmark = pytest.mark.integration
WORKER = Path(__file__).with_name("hier_worker.py")
RUN = "hier-test"
REPO = Path(__file__).resolve().parents[2]
BATCHES = {(0, 0): 2, (0, 1): 4, (1, 0): 6, (1, 1): 8}
"""Samples per step of each (machine, rank): unequal, so that the weights matter."""


def start_daemons(pool: ProcessPool, n: int) -> list[SwarmavgProcess]:
    base = ["peer", "--listen", "127.0.0.1:0", "--run-id", RUN]
    first = pool.start([*base, "--control", str(pool.workdir / "m0.sock")])
    daemons = [first]
    for i in range(1, n):
        daemons.append(
            pool.start(
                [*base, "--join", first.address, "--control", str(pool.workdir / f"m{i}.sock")]
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
    workdir: Path, daemons: list[SwarmavgProcess], ranks: int, timeout: float, **spec: Any
) -> dict[tuple[int, int], dict[str, Any]]:
    """Start every rank of every machine, wait for all, return their records."""
    procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
    outs: dict[tuple[int, int], Path] = {}
    for m, daemon in enumerate(daemons):
        for r in range(ranks):
            out = workdir / f"m{m}r{r}"
            full = {
                "run_id": RUN,
                "control": daemon.control,
                "store": str(workdir / f"store-{m}"),
                "rank": r,
                "size": ranks,
                "batch": BATCHES[(m, r)],
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
    records: dict[tuple[int, int], dict[str, Any]] = {}
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


def expected_collaborative(records: dict[tuple[int, int], dict[str, Any]], epochs: int) -> Any:
    """SGD (no momentum) on the samples-weighted mean of all four ranks' accumulated
    gradients, epoch by epoch, from machine 0's leader's initial parameters."""
    model = make_model(0, 3)
    for epoch in range(epochs):
        total = 0.0
        summed = [torch.zeros_like(p) for p in model.parameters()]
        for (m, r), record in records.items():
            steps = record["steps_per_epoch"][epoch]
            samples = steps * BATCHES[(m, r)]
            model.zero_grad()
            backward(model, fixed_batch(10 * m + r, BATCHES[(m, r)], 3))
            for acc, p in zip(summed, model.parameters(), strict=True):
                assert p.grad is not None
                acc += p.grad * samples
            total += samples
        with torch.no_grad():
            for p, acc in zip(model.parameters(), summed, strict=True):
                p -= LR * acc / total
    return [p.detach() for p in model.parameters()]


def assert_one_machine_per_peer(
    records: dict[tuple[int, int], dict[str, Any]], daemons: list[SwarmavgProcess], epochs: int
) -> None:
    from swarmavg.peer import connect

    for key, record in records.items():
        assert record.get("ok"), (key, record)
    for m, _ in enumerate(daemons):
        leader = records[(m, 0)]
        # the swarm sees one progress record per machine, and each round two members
        assert leader["progress_processes"] == 2
        assert leader["group_sizes"] == [2] * epochs
        assert leader["failed"] == 0
    for daemon in daemons:
        with connect(daemon.control) as client:
            status = client.status()
        # the machine's bytes crossed its daemon once per round: one round per epoch
        assert status["rounds_done"] == epochs
        assert status["rounds_failed"] == 0


@pytest.mark.timeout(300)
def test_two_machines_of_two_ranks_average_gradients_once_per_machine(
    swarmavg_processes: ProcessPool, tmp_path: Path
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    epochs = 2
    records = run_machines(
        tmp_path, daemons, 2, timeout=240, wrapper="collaborative", target=48, epochs=epochs
    )
    assert_one_machine_per_peer(records, daemons, epochs)
    for m in range(2):  # ranks of one machine step in lockstep
        assert records[(m, 0)]["steps_per_epoch"] == records[(m, 1)]["steps_per_epoch"]
    final = records[(0, 0)]["params"]
    for key, record in records.items():
        for a, b in zip(record["params"], final, strict=True):
            assert torch.equal(a, b), key
    for got, want in zip(final, expected_collaborative(records, epochs), strict=True):
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.timeout(300)
def test_two_machines_of_two_ranks_diloco_takes_the_weighted_mean_of_all_replicas(
    swarmavg_processes: ProcessPool, tmp_path: Path
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    local_steps = 3
    records = run_machines(
        tmp_path, daemons, 2, timeout=240, wrapper="diloco", local_steps=local_steps, epochs=1
    )
    assert_one_machine_per_peer(records, daemons, 1)
    # With outer SGD at lr 1 the outer step lands on the mean of the replicas after H
    # inner steps, weighted by samples (H * batch per rank), all from the leader's start.
    total = 0.0
    summed: list[Any] = []
    for m, r in records:
        replica = make_model(0, 3)
        inner = torch.optim.SGD(replica.parameters(), lr=LR)
        data = fixed_batch(10 * m + r, BATCHES[(m, r)], 3)
        for _ in range(local_steps):
            backward(replica, data)
            inner.step()
            inner.zero_grad()
        weight = float(local_steps * BATCHES[(m, r)])
        params = [p.detach() * weight for p in replica.parameters()]
        summed = params if not summed else [a + b for a, b in zip(summed, params, strict=True)]
        total += weight
    final = records[(0, 0)]["params"]
    for key, record in records.items():
        for a, b in zip(record["params"], final, strict=True):
            assert torch.equal(a, b), key
    for got, want in zip(final, [s / total for s in summed], strict=True):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.timeout(180)
def test_a_vanished_leader_makes_its_follower_fail_instead_of_hanging(
    swarmavg_processes: ProcessPool, tmp_path: Path
) -> None:
    daemons = start_daemons(swarmavg_processes, 1)
    records = run_machines(
        tmp_path,
        daemons,
        2,
        timeout=150,
        wrapper="collaborative",
        target=10_000,
        epochs=1,
        die_after={"00": 3},
        gloo_timeout=30,
        barrier=False,
    )
    assert records[(0, 0)]["returncode"] == 3
    follower = records[(0, 1)]
    assert follower["returncode"] == 0, follower["stderr"]
    assert follower["ok"] is False
    assert follower["error"] == "LocalGroupError", follower
