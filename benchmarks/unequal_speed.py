"""Volunteers of unequal speed: does anybody wait for the slowest?

Four real ``swarmavg peer`` daemons (CLI, loopback) and four trainer processes (this
script with ``--worker``), each trainer talking to its own daemon. Every trainer trains the
digits MLP of benchmarks/training.py on its shard, with AdamW inside ``DiLoCo``; its inner
step's compute is **simulated**: ``--step-ms / speed`` of ``time.sleep`` plus the real (tiny)
forward and backward. A sleep stands for a GPU that is busy: it occupies the trainer and
none of the machine's CPUs, so four trainers of unequal speed can share a small machine
honestly. Each run lasts ``--seconds`` of wall time from one shared go.

Per run (speeds, mode), the figures:

* ``utilisation``: per trainer, compute time / wall time over the run (the compute being
  the sleeps and the forward/backward passes; a round's time and its waits are not);
* ``fast_utilisation``: the mean over the trainers of the fastest speed, and
  ``fast_vs_all_fastest``: that divided by the same mode's run where all four are fastest;
* ``outer_steps`` and ``inner_steps`` per trainer, ``group_sizes`` of the rounds;
* ``identical_anchors``: every outer step after which two trainers hold the anchor and
  the outer optimizer's state, they hold the same bytes (sha256), and
  ``anchor_checks`` how many (epoch, trainer) states were compared;
* ``catch_ups``: epochs a trainer reached by loading the swarm's state instead of a round,
  and ``catch_ups_at_the_swarms_state`` how many of those held exactly the state the
  rounds' members held at that epoch (the others are repaired by the next round);
* ``val_loss``: the validation loss (cross-entropy on the held-out digits) of the anchor
  each trainer holds at the end (the median; they are the same state when in one epoch).

Modes: ``fixed`` (``local_steps=H`` for everybody: the homogeneous setting), ``pace``
(``SwarmPace(target_samples=4*H*batch)``: the same samples per outer step as ``fixed``
when all are equally fast) and ``collaborative`` (``CollaborativeOptimizer``, target
``4*H*batch/--collab-div`` samples, gradients averaged every global step).

``--stall S``: in the runs of mode ``pace``, after a third of the run the parent stops the
slowest trainer's process (SIGSTOP, a laptop's lid closing) for S seconds, then resumes
it (SIGCONT). ``stall`` then gives the other trainers' utilisation over those S seconds,
whether the stopped one merged or discarded its work (``late_merges``), and whether it
rejoined: it reached the swarm's last outer step and took part in a round of all four
after it came back (``rejoined``). Each such run is preceded by its all-running control
(same speeds, same daemons, nobody stopped), whose ``stall_control`` gives the others'
utilisation over the same window of the run: on a loaded machine the figure to compare
with (``--no-stall-control`` leaves it out). Both give ``others_seconds_in_step``, the
seconds the others spent inside ``opt.step()`` in the window (rounds, waits for a missing
member, downloads).

Prints ONE JSON line on stdout (progress on stderr)::

    python -m benchmarks.unequal_speed --speeds 1,1,1,1 1,1,1,0.25 1,0.5,0.33,0.25 \
        --modes fixed,pace --seconds 30 --step-ms 50 --local-steps 20
    python -m benchmarks.unequal_speed --speeds 1,1,1,1 1,1,1,0.25 --modes pace \
        --seconds 70 --stall 30
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import Proc, module_command
from .training import BatchStream, load_data, make_model, shard_indices, start_daemons

BATCH = 32
PEERS = 4
INNER_LR = 3e-3
OUTER_MOMENTUM = 0.5
STARTUP_TIMEOUT = 300.0
"""Seconds a trainer may take to import torch, load the data and join (a loaded machine)."""


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def log(message: str) -> None:
    print(f"[unequal_speed] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- one trainer


def anchor_sha256(opt: Any) -> str:
    """sha256 of what every member must hold identically between outer steps: the anchor
    (DiLoCo) or the parameters (CollaborativeOptimizer), and the outer optimizer's state."""
    import torch

    digest = hashlib.sha256()
    held = getattr(opt, "anchor", None) or opt.params
    for t in held:
        digest.update(t.detach().contiguous().numpy().tobytes())
    outer = getattr(opt, "outer_optimizer", None)
    if outer is not None:
        for _, state in sorted(outer.state_dict()["state"].items()):
            for _, value in sorted(state.items()):
                if isinstance(value, torch.Tensor):
                    digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def build(spec: dict[str, Any], model: Any, client: Any) -> Any:
    import torch

    from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo
    from swarmavg.averaging.training.pace import SwarmPace

    inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR)

    def outer(params: list[Any]) -> Any:
        # momentum 0.5: the paper's 0.9 overshoots on a run of a few outer steps
        # (docs/training.md, "DiLoCo")
        return torch.optim.SGD(params, lr=0.7, momentum=OUTER_MOMENTUM, nesterov=True)

    common = {"averaging_timeout": spec["timeout"], "final_round": False}
    h = int(spec["local_steps"])
    if spec["mode"] == "collaborative":
        return CollaborativeOptimizer(
            model.parameters(),
            inner,
            client,
            spec["run_id"],
            target_batch_size=max(BATCH, PEERS * h * BATCH // int(spec["collab_div"])),
            batch_size_per_step=BATCH,
            max_wait=spec["timeout"],
            **common,
        )
    pace = SwarmPace(target_samples=PEERS * h * BATCH) if spec["mode"] == "pace" else None
    return DiLoCo(
        model.parameters(),
        inner,
        client,
        spec["run_id"],
        local_steps=h,
        batch_size_per_step=BATCH,
        pace=pace,
        outer_optimizer=outer,
        **common,
    )


def train(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from swarmavg.peer import connect

    torch.set_num_threads(1)  # four trainers share a small machine's cores
    x_tr, y_tr, x_te, y_te = load_data()
    # Pixels that are constant in the train split get a standard deviation of ~1e-6, so a
    # test image that lights one up has features of 1e5 and a loss in the tens: clipped
    # to the range seen in training, the loss measures the model, not that artefact.
    x_te = np.clip(x_te, x_tr.min(0), x_tr.max(0))
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    stream = BatchStream(shard_indices(len(x_tr))[spec["shard"]], BATCH, 100 + spec["shard"])
    model = make_model(0)
    step_seconds = spec["step_ms"] / 1000.0 / spec["speed"]
    with connect(spec["control"]) as client:
        opt = build(spec, model, client)
        emit({"event": "started"})
        go = json.loads(sys.stdin.readline())
        deadline = float(go["deadline"])
        started = time.time()
        compute = 0.0
        in_step = 0.0  # seconds inside opt.step(): its rounds, waits and downloads
        inner_steps = 0
        while time.time() < deadline:
            t0 = time.monotonic()
            time.sleep(step_seconds)  # the simulated compute (see the module docstring)
            idx = stream.next()
            torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            compute += time.monotonic() - t0
            epoch, rejoins = opt.epoch, opt.stats.rejoins
            t1 = time.monotonic()
            opt.step()
            opt.zero_grad()
            in_step += time.monotonic() - t1
            inner_steps += 1
            emit(
                {
                    "event": "step",
                    "t": time.time(),
                    "compute": compute,
                    "in_step": in_step,
                    "epoch": opt.epoch,
                }
            )
            if opt.epoch != epoch:
                # a catch-up (the step found the swarm ahead) loads the newest state there
                # is, which may be one outer step older than the epoch it continues at:
                # the next round's digests repair it (docs/training.md, "Staying in one
                # swarm"), so it is counted apart from the rounds' states
                caught_up = opt.stats.rejoins != rejoins
                event = "catch-up" if caught_up else "sync"
                emit({"event": event, "epoch": opt.epoch, "sha256": anchor_sha256(opt)})
        ended = time.time()
        opt.close()
    held = getattr(opt, "anchor", None) or opt.params
    with torch.no_grad():
        for p, a in zip(model.parameters(), held, strict=True):
            p.copy_(a)
        logits = model(torch.from_numpy(x_te))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y_te))
        accuracy = float((logits.argmax(1).numpy() == y_te).mean() * 100)
    stats = opt.stats
    return {
        "event": "done",
        "shard": spec["shard"],
        "speed": spec["speed"],
        "utilisation": compute / max(ended - started, 1e-9),
        "compute": compute,
        "wall": ended - started,
        "inner_steps": inner_steps,
        "outer_steps": int(opt.epoch),
        "group_sizes": stats.group_sizes,
        "failed": stats.failed,
        "repairs": stats.repairs,
        "partial": stats.partial,
        "rejoins": stats.rejoins,
        "late_merges": stats.late_merges,
        "late_discards": stats.late_discards,
        "val_loss": float(loss),
        "val_accuracy": accuracy,
    }


def worker() -> None:
    for line in sys.stdin:
        if line.strip():
            emit(train(json.loads(line)))


# ---------------------------------------------------------------- the parent


def compute_at(steps: list[dict[str, Any]], t: float, field: str = "compute") -> float:
    """A trainer's cumulative ``field`` (compute, or seconds inside ``opt.step()``) at wall
    time ``t`` (its last step record before)."""
    before = [s.get(field, 0.0) for s in steps if s["t"] <= t]
    return before[-1] if before else 0.0


def window_figures(
    lines: list[list[dict[str, Any]]], victim: int, start: float, end: float
) -> dict[str, list[float]]:
    """The other trainers' utilisation over ``[start, end]`` and the seconds they spent
    inside ``opt.step()`` there (rounds, the waits for a missing member, downloads)."""
    utilisation, in_step = [], []
    for i, member in enumerate(lines):
        if i == victim:
            continue
        steps = [r for r in member if r.get("event") == "step"]
        spent = compute_at(steps, end) - compute_at(steps, start)
        utilisation.append(round(spent / (end - start), 3))
        waited = compute_at(steps, end, "in_step") - compute_at(steps, start, "in_step")
        in_step.append(round(waited, 2))
    return {"others_utilisation": utilisation, "others_seconds_in_step": in_step}


def run_one(
    workers: list[Proc],
    daemons: list[tuple[Proc, str]],
    speeds: list[float],
    mode: str,
    args: argparse.Namespace,
    index: int,
    stop: bool = True,
) -> dict[str, Any]:
    """One run; with ``--stall`` in mode pace, ``stop`` says whether the slowest trainer
    is stopped (False: the all-running control, measured over the same window)."""
    run_id = f"unequal-{index}-{mode}-{os.getpid()}"
    marks = []
    for i, (w, speed) in enumerate(zip(workers, speeds, strict=True)):
        spec = {
            "run_id": run_id,
            "control": daemons[i][1],
            "shard": i,
            "speed": speed,
            "mode": mode,
            "step_ms": args.step_ms,
            "local_steps": args.local_steps,
            "timeout": args.timeout,
            "collab_div": args.collab_div,
        }
        marks.append(w.send(spec))
    for w, mark in zip(workers, marks, strict=True):
        w.wait_for(lambda r: r.get("event") == "started", STARTUP_TIMEOUT, mark)
    go = time.time() + 0.5
    deadline = go + args.seconds
    for w in workers:
        w.send({"deadline": deadline})
    stall: dict[str, Any] | None = None
    victim = min(range(PEERS), key=lambda i: speeds[i])
    if args.stall > 0 and mode == "pace":
        time.sleep(max(go + args.seconds / 3 - time.time(), 0.0))
        stopped_at = time.time()
        if stop:
            workers[victim].signal(signal.SIGSTOP)
        time.sleep(args.stall)
        if stop:
            workers[victim].signal(signal.SIGCONT)
        resumed_at = time.time()
        stall = {"victim": victim, "from": stopped_at, "to": resumed_at}
    done = [
        w.wait_for(lambda r: r.get("event") == "done", args.seconds + 180, mark)
        for w, mark in zip(workers, marks, strict=True)
    ]
    lines = [w.lines[mark:] for w, mark in zip(workers, marks, strict=True)]
    by_epoch: dict[int, set[str]] = {}
    checks = 0
    catch_ups: list[tuple[int, str]] = []
    for member in lines:
        for r in member:
            if r.get("event") == "sync":
                by_epoch.setdefault(int(r["epoch"]), set()).add(r["sha256"])
                checks += 1
            elif r.get("event") == "catch-up":
                catch_ups.append((int(r["epoch"]), r["sha256"]))
    fastest = max(speeds)
    fast = [d["utilisation"] for d in done if d["speed"] == fastest]
    figures: dict[str, Any] = {
        "speeds": speeds,
        "mode": mode,
        "utilisation": [round(d["utilisation"], 3) for d in done],
        "fast_utilisation": round(statistics.mean(fast), 3),
        "outer_steps": [d["outer_steps"] for d in done],
        "inner_steps": [d["inner_steps"] for d in done],
        "group_sizes": [d["group_sizes"] for d in done],
        "failed_rounds": sum(d["failed"] for d in done),
        "repairs": sum(d["repairs"] for d in done),
        "identical_anchors": all(len(h) == 1 for h in by_epoch.values()),
        "anchor_mismatches": sorted(e for e, h in by_epoch.items() if len(h) > 1),
        "partial_rounds": sum(d["partial"] for d in done),
        "anchor_checks": checks,
        "catch_ups": len(catch_ups),
        "catch_ups_at_the_swarms_state": sum(
            1 for epoch, sha in catch_ups if by_epoch.get(epoch) == {sha}
        ),
        "val_loss": round(statistics.median(d["val_loss"] for d in done), 4),
        "val_accuracy": round(statistics.median(d["val_accuracy"] for d in done), 2),
    }
    if stall is not None and not stop:
        figures["stall_control"] = {
            "seconds": round(stall["to"] - stall["from"], 2),
            **window_figures(lines, victim, stall["from"], stall["to"]),
        }
    elif stall is not None:
        window = stall["to"] - stall["from"]
        back = done[stall["victim"]]
        after = [
            r["epoch"]
            for r in lines[stall["victim"]]
            if r.get("event") == "sync" and r.get("epoch") is not None
        ]
        last_epoch = max(d["outer_steps"] for d in done)
        figures["stall"] = {
            "seconds": round(window, 2),
            **window_figures(lines, victim, stall["from"], stall["to"]),
            "late_merges": back["late_merges"],
            "late_discards": back["late_discards"],
            "rejoins": back["rejoins"],
            "victim_outer_steps": back["outer_steps"],
            "swarm_outer_steps": last_epoch,
            "victim_syncs": len(after),
            "rejoined": back["outer_steps"] >= last_epoch - 1 and PEERS in back["group_sizes"][-3:],
        }
    shown = {
        k: figures[k]
        for k in ("utilisation", "outer_steps", "val_loss", "stall", "stall_control")
        if k in figures
    }
    log(f"{mode} {speeds}: {json.dumps(shown)}")
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--speeds", nargs="+", default=["1,1,1,1", "1,1,1,0.25", "1,0.5,0.33,0.25"])
    parser.add_argument("--modes", default="fixed,pace")
    parser.add_argument("--seconds", type=float, default=30.0, help="wall time of each run")
    parser.add_argument("--step-ms", type=float, default=50.0, help="a speed-1 inner step")
    parser.add_argument("--local-steps", type=int, default=20, help="H of mode fixed")
    parser.add_argument("--timeout", type=float, default=30.0, help="averaging_timeout")
    parser.add_argument("--collab-div", type=int, default=4, help="collaborative target divisor")
    parser.add_argument("--stall", type=float, default=0.0, help="SIGSTOP seconds (mode pace)")
    parser.add_argument(
        "--stall-control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --stall: run the all-running control over the same window first",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker()
        return 0
    speed_sets = [[float(s) for s in spec.split(",")] for spec in args.speeds]
    if any(len(s) != PEERS for s in speed_sets):
        raise SystemExit(f"every --speeds entry needs {PEERS} speeds")
    modes = args.modes.split(",")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="unequal-") as tmp:
        daemon_log = open(Path(tmp) / "daemons.log", "w")  # noqa: SIM115 (closed below)
        daemons: list[tuple[Proc, str]] = []
        workers: list[Proc] = []
        try:
            daemons = start_daemons(Path(tmp), PEERS, daemon_log)
            workers = [
                Proc(
                    [*module_command("benchmarks.unequal_speed"), "--worker"],
                    sys.stderr,
                    stdin=True,
                )
                for _ in range(PEERS)
            ]
            index = 0
            for speeds in speed_sets:
                for mode in modes:
                    if args.stall > 0 and mode == "pace" and args.stall_control:
                        # the all-running control first, over the same window, on the
                        # same daemons: the loaded machine's own figure to compare with
                        runs.append(run_one(workers, daemons, speeds, mode, args, index, False))
                        index += 1
                    runs.append(run_one(workers, daemons, speeds, mode, args, index))
                    index += 1
        finally:
            for w in workers:
                w.close()
            for d, _ in daemons:
                d.close()
            daemon_log.close()
    reference = {
        r["mode"]: r["fast_utilisation"]
        for r in runs
        if len(set(r["speeds"])) == 1 and "stall" not in r
    }
    for r in runs:
        ref = reference.get(r["mode"])
        r["fast_vs_all_fastest"] = round(r["fast_utilisation"] / ref, 3) if ref else None
    emit(
        {
            "benchmark": "unequal_speed",
            "seconds": args.seconds,
            "step_ms": args.step_ms,
            "local_steps": args.local_steps,
            "stall": args.stall,
            "compute": "simulated: time.sleep(step_ms / speed) + the real forward/backward",
            "runs": runs,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
