"""Collaborative training on real data: 4 peers, each behind its own daemon, vs one process.

The data set is scikit-learn's handwritten digits (1797 8x8 images, shipped inside the
package: nothing is downloaded). 70% train / 30% test, stratified. The train set is cut
into 4 disjoint shards, one per peer. Every peer runs its own ``swarmavg peer`` process and
its own training process (this script with ``--worker``). The model is a 64-32-10 MLP.

Reference: one process trains on all the data with the same global batch (128) and the same
number of samples (``--data-epochs`` passes, 9 steps each), SGD lr 0.1 momentum 0.9 with a
cosine schedule; its accuracy is the median over 5 data orders. Scenarios:

* ``grad-<codec>``: ``CollaborativeOptimizer``, 4 x 32 samples per global step, gradient
  averaging every step with codec none, float16, uint8-blockwise;
* ``diloco``: ``DiLoCo`` with H=20 inner SGD steps per peer, uint8-blockwise pseudo-gradients
  (outer Nesterov SGD lr 0.7; momentum 0.5, and the paper's 0.9 as ``diloco-paper``);
* ``streaming``: ``StreamingDiLoCo``, H=20 in 2 fragments (a sync every 10 inner steps, each
  overlapped with 2 inner steps), ``uint4-blockwise`` outer gradients, outer Nesterov SGD lr 0.7
  momentum 0.5; the figures are the anchor's (the swarm's model);
* ``sparseloco``: ``DiLoCo`` H=20 with codec ``sparseloco`` (chunked top-k, 2-bit values, error
  feedback) and the plain SGD outer step it pairs with (``sgd_outer_optimizer``);
* ``powersgd``: ``PowerSGDOptimizer``, rank-4 factors of every gradient matrix every step
  (codec none), the same inner SGD on the result;
* ``churn``: gradient averaging (uint8-blockwise); at half of the run one peer's trainer and
  daemon are killed (SIGKILL); the three survivors go on for 10 global steps, then a new
  peer with a fresh daemon joins (loading the swarm's state) and takes the dead one's shard;
* ``chaos``: gradient averaging (uint8-blockwise) through three faults, in this order:
  (a) the trainer of shard 1 saves a checkpoint (model ``state_dict`` and the wrapper's
  ``state_dict``: optimizer state, epoch) at global step 20, is SIGKILLed at step 40 and
  restarted from that checkpoint on its (still running) daemon: it rejoins with the stale
  parameters, optimizer state and epoch 20, as a restarted program that loads its last
  checkpoint after building the wrapper does; (b) 15 steps after that restart, the daemon
  of shard 2 and its trainer are SIGKILLed together and a fresh daemon plus trainer
  replaces them at once (a newcomer that joins and loads the swarm's state); (c) at 3/4 of
  the run the trainer of shard 3 fails its rounds of 3 consecutive global steps on purpose
  (its client's ``average`` raises the round error before reaching the daemon, as a round
  that timed out does), so it steps alone on its local gradients and its parameters leave
  the others'. Nothing in the benchmark fixes state: only the wrappers' catch-up path and
  the shared-state repair can. The figure reports which fault happened at which global
  step (``faults``, ``faults_in_order``), the accuracy, ``parameters_identical`` (sha256 of
  the parameters of every live trainer at the end), ``distinct_parameter_sets``, repairs
  (count, seconds), repair failures, failed rounds, states loaded. Counters of the killed
  processes die with them: the totals are those of the trainers alive at the end.
  ``--disable-repair`` is the control: trainers ignore the round digests, and the run must
  then end with differing parameters.

``--unsync`` starts the trainers the way real ones start, seconds apart,
instead of all at one go: trainer 0 on the first daemon at once, then for each next one a
seeded pause of up to ``UNSYNC_STAGGER`` (2 s), a fresh daemon that joins the first, and
the trainer once that daemon is up; nobody waits, so the first trainer steps alone
meanwhile. Each scenario (not churn or chaos) then reports, besides the usual figures,
``distinct_parameter_sets`` at the end, every trainer's rounds attempted and failed, its
rejoins (``stats.rejoins``: times it adopted the swarm's epoch), its final agreement on
``close()`` (``stats.final_agreement``), the epoch it started at, the pauses and where the
first trainer was when each next one started. ``--min-peers N`` gives the grad scenarios'
trainers the start barrier's ``min_peers`` (the first trainer's first global step waits for
N daemons' trainers, ``--start-timeout`` seconds at most); ``--start-timeout 0`` is the
control without any barrier. ``--last-late S`` starts the last trainer S seconds after the
one before it, into a run in progress.

Prints one JSON line: per scenario the final test accuracy (mean over the peers alive at
the end), its distance to the reference, bytes sent per peer (from the daemons' status),
rounds and failures, repairs, whether every trainer ends with bit-identical parameters
(sha256), seconds. With ``--swarm-seeds N`` every scenario runs N times, seed ``s`` giving
the model init (``torch.manual_seed(s)``) and the trainers' data orders; the scenario's
figure then lists every run's accuracy, their mean and median, the gap of the mean to the
reference, ``parameters_identical_every_run`` and repairs per run, and keeps every run's
full figures under ``runs``. The reference stays the median over ``--seeds`` data orders
from init seed 0. ``python -m benchmarks.training --help`` for options.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .common import Proc, emit, module_command, parameters_sha256
from .common import start_daemons as start_loopback_daemons

GLOBAL_BATCH = 128
PEERS = 4
LOCAL_BATCH = GLOBAL_BATCH // PEERS
HIDDEN = 32
LR = 0.1
DILOCO_H = 20
STREAMING_FRAGMENTS = 2
"""The MLP's 4 tensors in 2 fragments of about equal size: a sync every 10 inner steps."""
POWERSGD_RANK = 4
CHURN_GAP = 10
"""Global steps the three survivors take between the kill and the newcomer's start."""
CHAOS_CHECKPOINT_AT = 20
"""chaos: the global step at which the restarted trainer saved the checkpoint it restarts from."""
CHAOS_RESTART_AT = 40
"""chaos: fault (a), the checkpointing trainer is killed once it reaches this global step."""
CHAOS_GAP = 15
"""chaos: global steps between one fault and the next."""
CHAOS_FAILED_ROUNDS = 3
"""chaos: fault (c), consecutive rounds one trainer fails on purpose."""
KILLS = {"churn": 1, "chaos": 2}
"""Trainer processes a scenario kills (spares replace them)."""
SEED_STRIDE = 1000
"""Run seed ``s`` shifts every data-order seed by ``s * SEED_STRIDE`` (seed 0: the default run)."""
RUN_ID = "digits"


# ---------------------------------------------------------------- data and model


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Standardised digits: (x_train, y_train, x_test, y_test)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def shard_indices(n_train: int, peers: int = PEERS) -> list[np.ndarray]:
    """Disjoint shards of the train set (a fixed random split)."""
    return np.array_split(np.random.default_rng(1).permutation(n_train), peers)


def total_steps(n_train: int, data_epochs: int) -> int:
    return data_epochs * (n_train // GLOBAL_BATCH)


_MODEL_INIT = threading.Lock()
"""Held while a model is seeded and built: torch's default generator is one per process,
so trainers in threads (tests, benchmarks/byzantine.py) that seed and build at once would
draw each other's numbers and start from different parameters."""


def make_model(seed: int = 0) -> Any:
    import torch

    with _MODEL_INIT:
        torch.manual_seed(seed)  # every peer of a run starts from the same parameters
        return torch.nn.Sequential(
            torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10)
        )


def cosine_lr(step: int, total: int, base: float = LR) -> float:
    return base * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(1).numpy()
    return float((predicted == y).mean() * 100)


class BatchStream:
    """Endless batches from a set of indices, reshuffled every pass."""

    def __init__(self, indices: np.ndarray, batch: int, seed: int) -> None:
        self.indices, self.batch = indices, batch
        self.rng = np.random.default_rng(seed)
        self.queue = np.empty(0, dtype=np.int64)

    def next(self) -> np.ndarray:
        while len(self.queue) < self.batch:
            self.queue = np.concatenate([self.queue, self.rng.permutation(self.indices)])
        out, self.queue = self.queue[: self.batch], self.queue[self.batch :]
        return out


def train_single(seed: int, data_epochs: int, init: int = 0) -> float:
    """The reference: one process, all the data, global batch 128 (model init ``init``)."""
    import torch

    x_tr, y_tr, x_te, y_te = load_data()
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    model = make_model(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    steps = total_steps(len(x_tr), data_epochs)
    stream = BatchStream(np.arange(len(x_tr)), GLOBAL_BATCH, seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps)
        idx = stream.next()
        loss = torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return accuracy(model, x_te, y_te)


# ---------------------------------------------------------------- one peer's trainer


@dataclass(frozen=True)
class Scenario:
    """What one trainer runs; sent to it as one JSON line on stdin."""

    name: str
    control: str
    shard: int
    mode: str  # "grad", "diloco", "streaming", "sparseloco" or "powersgd"
    codec: str
    data_epochs: int
    timeout: float
    ttl: float
    outer_momentum: float = 0.9
    wait_for_go: bool = True
    seed: int = 0
    """The run's seed: model init and data orders (0: the documented single run)."""
    checkpoint_at: int = -1
    """Save model + optimizer state to ``checkpoint_path`` at this global step (-1: never)."""
    checkpoint_path: str = ""
    restore_from: str = ""
    """Restart from this checkpoint (stale parameters, optimizer state and epoch)."""
    fail_rounds: tuple[int, ...] = ()
    """Global steps whose round this trainer fails on purpose (its step becomes local)."""
    disable_repair: bool = False
    """A control: every member steps whatever the digests say (no shared-state repair)."""
    min_peers: int = 1
    """The start barrier's ``min_peers`` (``CollaborativeOptimizer``; grad scenarios)."""
    start_timeout: float = 60.0
    """The start barrier's ``start_timeout`` (0: no barrier, the control)."""


class FaultyClient:
    """A client whose ``average`` fails for the rounds of chosen global steps.

    A trainer-side fault: the call raises the swarm's round error before it reaches the
    daemon, as a round that timed out does, so the wrapper steps with its local gradients
    and its parameters leave the others' until the shared-state repair brings it back.
    Everything else goes to the real client.
    """

    def __init__(self, client: Any, fail_rounds: tuple[int, ...]) -> None:
        self._client, self._fail = client, set(fail_rounds)
        self.injected: list[int] = []

    def average(self, tensors: Any, *, key: str, **kwargs: Any) -> Any:
        from swarmavg.averaging.errors import AveragingError

        head, _, tail = key.rpartition(".")
        if head.endswith(".grads") and tail.isdigit() and int(tail) in self._fail:
            self.injected.append(int(tail))
            raise AveragingError(f"injected fault: round {key} failed on purpose")
        return self._client.average(tensors, key=key, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def train_peer(scenario: Scenario) -> dict[str, Any]:
    """Train one peer through its daemon until the run's last global step."""
    if not scenario.disable_repair:
        return _train_peer(scenario)
    from swarmavg.averaging.training import base
    from swarmavg.averaging.training.consensus import Role, Verdict

    judge = base.judge
    base.judge = lambda digests, mine: Verdict(Role.STEP, b"")  # type: ignore[assignment]
    try:
        return _train_peer(scenario)
    finally:
        base.judge = judge  # the trainer process lives on to the next scenario


def _train_peer(scenario: Scenario) -> dict[str, Any]:
    import torch

    from swarmavg.averaging.optim import (
        CollaborativeOptimizer,
        DiLoCo,
        PowerSGDOptimizer,
        StreamingDiLoCo,
        sgd_outer_optimizer,
    )
    from swarmavg.peer import connect

    x_tr, y_tr, x_te, y_te = load_data()
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    steps = total_steps(len(x_tr), scenario.data_epochs)
    shard = shard_indices(len(x_tr))[scenario.shard]
    stream = BatchStream(shard, LOCAL_BATCH, 100 + scenario.shard + SEED_STRIDE * scenario.seed)
    model = make_model(scenario.seed)
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    checkpoint: dict[str, Any] | None = None
    if scenario.restore_from:
        checkpoint = torch.load(scenario.restore_from, weights_only=False)
        model.load_state_dict(checkpoint["model"])
    started = time.monotonic()
    with connect(scenario.control) as real_client:
        client = FaultyClient(real_client, scenario.fail_rounds)
        sent_before = int(client.status()["bytes_sent"])
        opt: Any
        if scenario.mode in ("diloco", "streaming", "sparseloco"):
            momentum = scenario.outer_momentum

            def outer_factory(params: list[Any]) -> Any:
                return torch.optim.SGD(params, lr=0.7, momentum=momentum, nesterov=True)

            family: Any = DiLoCo
            extra: dict[str, Any] = {"outer_optimizer": outer_factory}
            if scenario.mode == "streaming":
                family = StreamingDiLoCo
                extra.update(fragments=STREAMING_FRAGMENTS, overlap_steps=2)
            elif scenario.mode == "sparseloco":
                extra["outer_optimizer"] = sgd_outer_optimizer
            opt = family(
                model.parameters(),
                inner,
                client,
                scenario.name,
                local_steps=DILOCO_H,
                batch_size_per_step=LOCAL_BATCH,
                codec=scenario.codec,
                averaging_timeout=scenario.timeout,
                progress_ttl=scenario.ttl,
                **extra,
            )
            # Inner steps per "outer step" (per fragment sync for streaming).
            period = int(opt.local_steps)

            def position() -> int:
                return int(opt.epoch * period + opt.inner_steps)
        else:
            wrapper: Any = (
                PowerSGDOptimizer if scenario.mode == "powersgd" else CollaborativeOptimizer
            )
            powersgd: dict[str, Any] = (
                {"rank": POWERSGD_RANK}
                if scenario.mode == "powersgd"
                else {"min_peers": scenario.min_peers, "start_timeout": scenario.start_timeout}
            )
            opt = wrapper(
                model.parameters(),
                inner,
                client,
                scenario.name,
                target_batch_size=GLOBAL_BATCH,
                batch_size_per_step=LOCAL_BATCH,
                codec=scenario.codec,
                averaging_timeout=scenario.timeout,
                progress_ttl=scenario.ttl,
                max_wait=scenario.timeout,
                **powersgd,
            )

            def position() -> int:
                return int(opt.epoch)

        if checkpoint is not None:
            # As a restarted program does: the stale optimizer state and epoch override
            # whatever the wrapper loaded from the swarm when it joined.
            opt.load_state_dict(checkpoint["optimizer"])
            emit({"event": "restored", "position": position()})
        start_epoch = int(opt.epoch)
        emit({"event": "started", "position": position()})
        if scenario.wait_for_go:
            sys.stdin.readline()  # every peer starts training at the same moment
        train_started = time.monotonic()
        last = -1
        while position() < steps:
            for group in inner.param_groups:
                group["lr"] = cosine_lr(position(), steps)
            idx = stream.next()
            torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
            opt.zero_grad()
            if position() != last:
                last = position()
                if 0 <= scenario.checkpoint_at <= last and checkpoint is None:
                    checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                    torch.save(checkpoint, scenario.checkpoint_path)
                    emit({"event": "checkpoint", "position": last})
                emit({"event": "progress", "position": last})
        opt.close()
        sent = int(client.status()["bytes_sent"]) - sent_before
    if scenario.mode == "streaming":
        # The swarm's model is the anchor (each member's parameters add its own progress
        # since each fragment's last sync).
        with torch.no_grad():
            for p, a in zip(model.parameters(), opt.anchor, strict=True):
                p.copy_(a)
    stats = opt.stats
    return {
        "event": "done",
        "shard": scenario.shard,
        "accuracy": accuracy(model, x_te, y_te),
        "bytes_sent": sent,
        "rounds": stats.rounds,
        "failed": stats.failed,
        "partial": stats.partial,
        "states_loaded": stats.states_loaded,
        "diverged": stats.diverged,
        "repairs": stats.repairs,
        "repair_failures": stats.repair_failures,
        "repair_seconds": stats.repair_seconds,
        "served": stats.served,
        "group_sizes": stats.group_sizes,
        "train_seconds": time.monotonic() - train_started,
        "seconds": time.monotonic() - started,
        "round_seconds": stats.seconds,
        "rejoins": getattr(stats, "rejoins", 0),
        "final_agreement": getattr(stats, "final_agreement", ""),
        "start_epoch": start_epoch,
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
        "sha256": parameters_sha256(model),
        "injected_failures": client.injected,
    }


def worker() -> None:
    """A trainer process: runs the scenarios it reads from stdin, one JSON line each.

    It lives across scenarios so torch is imported once (that import takes longer than
    a whole scenario's training on a loaded machine).
    """
    import torch

    for module in ("swarmavg.averaging.optim", "swarmavg.peer"):  # warm: no skew at the start
        importlib.import_module(module)
    torch.set_num_threads(1)
    load_data()
    emit({"event": "idle"})
    for line in sys.stdin:
        if line.strip():
            emit(train_peer(Scenario(**json.loads(line))))


# ---------------------------------------------------------------- the swarm


UNSYNC_STAGGER = 2.0
"""``--unsync``: most seconds (seeded, uniform) between one trainer's start and the next
daemon's start."""


def start_unsync(
    workers: list[Proc],
    daemons: list[tuple[Proc, str]],
    scenario: Any,
    workdir: Path,
    log: Any,
    seed: int,
    last_late: float = 0.0,
) -> tuple[list[int], dict[str, Any]]:
    """``--unsync``: the trainers start one by one, as real ones do. Trainer 0 starts on the
    first daemon at once; then, for each next trainer, a seeded pause of up to
    ``UNSYNC_STAGGER`` seconds, a fresh daemon that joins the first, and the trainer once
    that daemon is up. Nobody waits for a go: the first trainer trains alone meanwhile.
    ``last_late`` > 0: the last trainer's pause is that many seconds instead (a trainer that
    joins a run in progress). ``daemons`` (holding the first) gets the new daemons appended.

    Returns:
        each trainer's output mark, and the figures of the start: the pauses, and the
        global step each trainer found the first one at when it started.
    """
    rng = np.random.default_rng(7 + SEED_STRIDE * seed)
    pauses = [round(float(rng.uniform(0.0, UNSYNC_STAGGER)), 3) for _ in workers[1:]]
    if last_late > 0:
        pauses[-1] = last_late
    marks = [workers[0].send(scenario(0, daemons[0][1], wait_for_go=False))]
    workers[0].wait_for(lambda r: r.get("event") == "started", 120, marks[0])
    first_at = []
    for i, pause in enumerate(pauses, start=1):
        time.sleep(pause)
        (daemon,) = start_daemons(workdir, 1, log, join=daemon_address(daemons[0][0]))
        daemons.append(daemon)
        first_at.append(workers[0].position(marks[0]))
        marks.append(workers[i].send(scenario(i, daemon[1], wait_for_go=False)))
        workers[i].wait_for(lambda r: r.get("event") == "started", 120, marks[i])
    return marks, {"pauses": pauses, "first_trainer_at_each_start": first_at}


def start_daemons(
    workdir: Path, count: int, log: Any, join: str = "", ready_timeout: float = 60.0
) -> list[tuple[Proc, str]]:
    """``count`` loopback daemons of the digits run (the first founds it unless ``join``)."""
    return start_loopback_daemons(workdir, count, log, RUN_ID, join, ready_timeout)


def daemon_address(proc: Proc) -> str:
    return str(proc.wait_for(lambda r: r.get("event") == "ready", 1)["address"])


def start_worker(log: Any) -> Proc:
    proc = Proc([*module_command("benchmarks.training"), "--worker"], log, stdin=True)
    return proc


def run_scenario(
    name: str,
    opts: argparse.Namespace,
    workers: list[Proc],
    log: Any,
    workdir: Path,
    mode: str,
    codec: str,
    churn: bool = False,
    chaos: bool = False,
    outer_momentum: float = 0.9,
    seed: int = 0,
) -> dict[str, Any]:
    """Run one scenario on fresh daemons with the (long-lived) trainers ``workers``.

    With ``churn`` (``chaos``), ``workers`` holds one (two) spare trainer(s) that replace
    the victims; the victims are removed from ``workers``, the spares take their place.
    """
    started = time.monotonic()
    unsync = bool(getattr(opts, "unsync", False)) and not (churn or chaos)
    daemons = start_daemons(workdir, 1 if unsync else PEERS, log)
    steps = total_steps(len(load_data()[0]), opts.data_epochs)

    def scenario(shard: int, control: str, wait_for_go: bool = True, **more: Any) -> dict[str, Any]:
        return asdict(
            Scenario(
                f"{name}-{os.getpid()}-{seed}",
                control,
                shard,
                mode,
                codec,
                opts.data_epochs,
                opts.timeout,
                opts.ttl,
                outer_momentum,
                wait_for_go,
                seed,
                disable_repair=opts.disable_repair,
                min_peers=opts.min_peers,
                start_timeout=opts.start_timeout,
                **more,
            )
        )

    def send(worker: Proc, record: dict[str, Any]) -> int:
        return worker.send(record)

    def kill(victim: Proc) -> None:
        victim.signal(signal.SIGKILL)
        victim.close(terminate=False)
        workers.remove(victim)

    fail_rounds = tuple(range(steps * 3 // 4, steps * 3 // 4 + CHAOS_FAILED_ROUNDS))
    checkpoint = str(workdir / f"checkpoint-{seed}.pt")
    spares = workers[PEERS:]
    try:
        active = workers[:PEERS]
        plans: list[dict[str, Any]] = [{} for _ in range(PEERS)]
        if chaos:
            plans[1] = {"checkpoint_at": CHAOS_CHECKPOINT_AT, "checkpoint_path": checkpoint}
            plans[3] = {"fail_rounds": fail_rounds}
        extra: dict[str, Any] = {}
        if unsync:
            marks, extra["unsync"] = start_unsync(
                active, daemons, scenario, workdir, log, seed, opts.last_late
            )
        else:
            marks = [
                send(w, scenario(i, control, **plans[i]))
                for i, (w, (_, control)) in enumerate(zip(active, daemons, strict=True))
            ]
            for w, m in zip(active, marks, strict=True):
                w.wait_for(lambda r: r.get("event") == "started", 120, m)
            for w in active:
                w.send({"go": True})
        if churn:
            victim = active[-1]
            victim.wait_for(lambda r: r.get("position", -1) >= steps // 2, opts.budget, marks[-1])
            victim.signal(signal.SIGKILL)
            daemons[-1][0].signal(signal.SIGKILL)
            extra["killed_at"] = killed_at = victim.position(marks[-1])
            kill(victim)
            # The survivors go on alone for a while (their first rounds still wait for the
            # dead peer until its progress record expires), then a newcomer joins.
            survivor = active[0]
            survivor.wait_for(
                lambda r: r.get("position", -1) >= killed_at + CHURN_GAP, opts.budget, marks[0]
            )
            (new_daemon,) = start_daemons(workdir, 1, log, join=daemon_address(daemons[0][0]))
            daemons.append(new_daemon)
            spare = spares.pop(0)
            mark = send(spare, scenario(PEERS - 1, new_daemon[1], wait_for_go=False))
            joined = spare.wait_for(lambda r: r.get("event") == "started", 120, mark)
            extra["joined_at"] = joined["position"]
            active = [*active[:-1], spare]
            marks = [*marks[:-1], mark]
        if chaos:
            extra["faults"] = faults = []
            survivor = active[0]
            # (a) a trainer killed and restarted from its own checkpoint of step 20.
            victim = active[1]
            victim.wait_for(lambda r: r.get("event") == "checkpoint", opts.budget, marks[1])
            victim.wait_for(
                lambda r: r.get("position", -1) >= CHAOS_RESTART_AT, opts.budget, marks[1]
            )
            killed_at = victim.position(marks[1])
            saved_at = victim.wait_for(lambda r: r.get("event") == "checkpoint", 1, marks[1])
            kill(victim)
            spare = spares.pop(0)
            mark = send(spare, scenario(1, daemons[1][1], False, restore_from=checkpoint))
            restored = spare.wait_for(lambda r: r.get("event") == "restored", 120, mark)
            faults.append(
                {
                    "fault": "trainer SIGKILLed, restarted from its checkpoint",
                    "shard": 1,
                    "killed_at_step": killed_at,
                    "checkpoint_step": saved_at["position"],
                    "restarted_at_step": survivor.position(marks[0]),
                    "restored_epoch": restored["position"],
                }
            )
            active[1], marks[1] = spare, mark
            # (b) a daemon and its trainer killed; a fresh pair joins and loads the state.
            survivor.wait_for(
                lambda r: r.get("position", -1) >= faults[0]["restarted_at_step"] + CHAOS_GAP,
                opts.budget,
                marks[0],
            )
            victim = active[2]
            victim.signal(signal.SIGKILL)
            daemons[2][0].signal(signal.SIGKILL)
            killed_at = survivor.position(marks[0])
            kill(victim)
            (new_daemon,) = start_daemons(workdir, 1, log, join=daemon_address(daemons[0][0]))
            daemons.append(new_daemon)
            spare = spares.pop(0)
            mark = send(spare, scenario(2, new_daemon[1], wait_for_go=False))
            joined = spare.wait_for(lambda r: r.get("event") == "started", 120, mark)
            faults.append(
                {
                    "fault": "daemon and trainer SIGKILLed, a fresh pair joins",
                    "shard": 2,
                    "killed_at_step": killed_at,
                    "joined_at_step": joined["position"],
                }
            )
            active[2], marks[2] = spare, mark
        results = [
            w.wait_for(lambda r: r.get("event") == "done", opts.budget, m)
            for w, m in zip(active, marks, strict=True)
        ]
        if chaos:
            # (c) planned at the start (the trainer fails these rounds by itself).
            faults.append(
                {
                    "fault": "rounds failed on purpose (trainer-side), steps local",
                    "shard": 3,
                    "planned_steps": list(fail_rounds),
                    "failed_steps": results[3]["injected_failures"],
                }
            )
            extra["faults_in_order"] = (
                faults[0]["killed_at_step"]
                < faults[1]["killed_at_step"]
                <= faults[1]["joined_at_step"]
                < fail_rounds[0]
            )
    finally:
        for proc, _ in daemons:
            proc.signal(signal.SIGTERM)
        for proc, _ in daemons:
            proc.close(terminate=False)
    sizes = [size for r in results for size in r["group_sizes"]]
    out: dict[str, Any] = {
        "accuracy": round(float(np.mean([r["accuracy"] for r in results])), 3),
        "peer_accuracies": [round(r["accuracy"], 3) for r in results],
        "bytes_sent_per_peer": int(np.mean([r["bytes_sent"] for r in results])),
        "rounds_per_peer": float(np.mean([r["rounds"] for r in results])),
        "failed_rounds": sum(r["failed"] for r in results),
        "partial_rounds": sum(r["partial"] for r in results),
        "repairs": sum(r["repairs"] for r in results),
        "repair_failures": sum(r["repair_failures"] for r in results),
        "repair_seconds": round(sum(r["repair_seconds"] for r in results), 3),
        "mean_group_size": round(float(np.mean(sizes)), 2) if sizes else 0.0,
        "smallest_group": min(sizes, default=0),
        "parameter_checksum": round(results[0]["checksum"], 6),
        "parameters_identical": len({r["sha256"] for r in results}) == 1,
        "train_seconds": round(max(r["train_seconds"] for r in results), 1),
        "round_seconds_per_peer": round(float(np.mean([r["round_seconds"] for r in results])), 1),
        "seconds": round(time.monotonic() - started, 1),
    }
    extra["distinct_parameter_sets"] = len({r["sha256"] for r in results})
    extra["rounds_per_trainer"] = [r["rounds"] for r in results]
    extra["failed_rounds_per_trainer"] = [r["failed"] for r in results]
    extra["rejoins_per_trainer"] = [r["rejoins"] for r in results]
    extra["final_agreement_per_trainer"] = [r["final_agreement"] or "-" for r in results]
    extra["start_epoch_per_trainer"] = [r["start_epoch"] for r in results]
    if churn:
        extra["joiner_states_loaded"] = results[-1]["states_loaded"]
    if chaos:
        extra["diverged"] = sum(r["diverged"] for r in results)
        extra["states_loaded"] = sum(r["states_loaded"] for r in results)
        extra["served"] = sum(r["served"] for r in results)
        extra["failed_rounds_per_peer"] = [r["failed"] for r in results]
        extra["repairs_per_peer"] = [r["repairs"] for r in results]
    out.update(extra)
    return out


SCENARIOS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "grad-none": ("grad", "none", {}),
    "grad-float16": ("grad", "float16", {}),
    "grad-uint8-blockwise": ("grad", "uint8-blockwise", {}),
    "diloco": ("diloco", "uint8-blockwise", {"outer_momentum": 0.5}),
    "diloco-paper": ("diloco", "uint8-blockwise", {"outer_momentum": 0.9}),
    "streaming": ("streaming", "uint4-blockwise", {"outer_momentum": 0.5}),
    "sparseloco": ("sparseloco", "sparseloco", {}),
    "powersgd": ("powersgd", "none", {}),
    "churn": ("grad", "uint8-blockwise", {"churn": True}),
    "chaos": ("grad", "uint8-blockwise", {"chaos": True}),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-epochs", type=int, default=20, help="passes over the train set")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds per averaging round")
    parser.add_argument("--ttl", type=float, default=20.0, help="seconds a progress record lives")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds per scenario")
    parser.add_argument("--seeds", type=int, default=5, help="data orders of the reference")
    parser.add_argument(
        "--swarm-seeds",
        type=int,
        default=0,
        help="run each scenario this many times (seeds 0..N-1: model init and data orders) "
        "and report every run, their mean and median (0: one run of seed 0, the default)",
    )
    parser.add_argument(
        "--disable-repair",
        action="store_true",
        help="a control: trainers ignore the round digests (no shared-state repair), to "
        "show that parameters_identical can fail",
    )
    parser.add_argument(
        "--unsync",
        action="store_true",
        help="start the trainers one by one: each after a seeded pause of up to "
        f"{UNSYNC_STAGGER:.0f} s and once its own fresh daemon is up, not all at one go "
        "(not for churn and chaos)",
    )
    parser.add_argument(
        "--last-late",
        type=float,
        default=0.0,
        help="with --unsync: the last trainer starts this many seconds after the one before "
        "it (a trainer joining a run in progress; give --min-peers one less than the swarm)",
    )
    parser.add_argument(
        "--min-peers",
        type=int,
        default=1,
        help="the grad scenarios' start barrier: daemons whose trainers must report before "
        "a trainer's first global step (CollaborativeOptimizer min_peers)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=60.0,
        help="seconds the start barrier waits at most (0: no barrier, the control)",
    )
    parser.add_argument("--log", help="append the daemons' and trainers' stderr to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker()
        return
    names = opts.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    if opts.swarm_seeds < 0:
        parser.error("--swarm-seeds must not be negative")

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="swarmavg-train-") as tmp:
        log_path = Path(opts.log) if opts.log else Path(tmp) / "stderr.log"
        with open(log_path, "ab") as log:
            spares = max(KILLS.get(n, 0) for n in names)
            workers = [start_worker(log) for _ in range(PEERS + spares)]
            try:
                single = [train_single(seed, opts.data_epochs) for seed in range(opts.seeds)]
                # With --swarm-seeds: one process from each run's model init too (data
                # order = the run's seed), so that init luck is not counted as a gap.
                matched = [
                    train_single(SEED_STRIDE * s, opts.data_epochs, init=s)
                    for s in range(opts.swarm_seeds)
                ]
                for w in workers:
                    w.wait_for(lambda r: r.get("event") == "idle", 300)
                figures = run_all(opts, names, workers, log, Path(tmp), single, matched)
            except (RuntimeError, TimeoutError) as exc:
                raise SystemExit(f"{exc}\n{log_path.read_text(errors='replace')[-4000:]}") from exc
            finally:
                for w in workers:
                    w.close()
    print(json.dumps(figures))


def run_all(
    opts: argparse.Namespace,
    names: list[str],
    workers: list[Proc],
    log: Any,
    workdir: Path,
    single: list[float],
    matched: list[float],
) -> dict[str, Any]:
    reference = float(np.median(single))
    n_train = len(load_data()[0])
    figures: dict[str, Any] = {
        "benchmark": "training",
        "dataset": f"sklearn digits ({n_train} train / {1797 - n_train} test)",
        "peers": PEERS,
        "global_batch": GLOBAL_BATCH,
        "global_steps": total_steps(n_train, opts.data_epochs),
        "diloco_local_steps": DILOCO_H,
        "parameters": sum(p.numel() for p in make_model().parameters()),
        "single_process_accuracy": round(reference, 3),
        "single_process_runs": [round(a, 3) for a in single],
    }
    if opts.swarm_seeds:
        figures["swarm_seeds"] = opts.swarm_seeds
        figures["single_process_same_init_runs"] = [round(a, 3) for a in matched]
        figures["single_process_same_init_mean"] = round(float(np.mean(matched)), 3)
    if opts.disable_repair:
        figures["repair_disabled"] = True
    if opts.unsync:
        figures["unsync"] = True
    figures["min_peers"] = opts.min_peers
    figures["last_late"] = opts.last_late
    figures["start_timeout"] = opts.start_timeout
    for name in names:
        mode, codec, extra = SCENARIOS[name]
        runs = []
        for seed in range(max(opts.swarm_seeds, 1)):
            top_up(workers, PEERS + KILLS.get(name, 0), log)
            result = run_scenario(
                name, opts, workers, log, workdir, mode, codec, seed=seed, **extra
            )
            result["gap_points"] = round(result["accuracy"] - reference, 3)
            runs.append(result)
            print(f"{name} seed {seed}: {json.dumps(result)}", file=sys.stderr, flush=True)
        figures[name] = runs[0] if not opts.swarm_seeds else over_seeds(runs, reference, matched)
    diloco = figures.get("diloco")
    for base in ("grad-uint8-blockwise", "grad-none"):
        if opts.swarm_seeds:
            break  # per-seed figures: compare the runs themselves
        if base in figures and diloco and diloco["bytes_sent_per_peer"]:
            ratio = figures[base]["bytes_sent_per_peer"] / diloco["bytes_sent_per_peer"]
            figures[f"diloco_bytes_reduction_vs_{base}"] = round(ratio, 1)
    return figures


def top_up(workers: list[Proc], count: int, log: Any) -> None:
    """Start trainers until ``workers`` holds ``count`` live ones (spares for the kills)."""
    fresh = [start_worker(log) for _ in range(count - len(workers))]
    for w in fresh:
        w.wait_for(lambda r: r.get("event") == "idle", 300)
    workers.extend(fresh)


def over_seeds(
    runs: list[dict[str, Any]], reference: float, matched: list[float]
) -> dict[str, Any]:
    """One scenario over its seeds: every run's figures and their summary.

    ``gap_points_mean`` is the issue's figure (mean over the runs minus the reference);
    ``gap_points_mean_same_init`` compares with one process started from each run's init.
    """
    accuracies = [r["accuracy"] for r in runs]
    mean = float(np.mean(accuracies))
    return {
        "accuracies": accuracies,
        "accuracy_mean": round(mean, 3),
        "accuracy_median": round(float(np.median(accuracies)), 3),
        "gap_points_mean": round(mean - reference, 3),
        "gap_points_mean_same_init": round(mean - float(np.mean(matched)), 3),
        "parameters_identical_every_run": all(r["parameters_identical"] for r in runs),
        "parameters_identical_per_run": [r["parameters_identical"] for r in runs],
        "distinct_parameter_sets_per_run": [r["distinct_parameter_sets"] for r in runs],
        "repairs_per_run": [r["repairs"] for r in runs],
        "repair_failures_per_run": [r["repair_failures"] for r in runs],
        "failed_rounds_per_run": [r["failed_rounds"] for r in runs],
        "smallest_group_per_run": [r["smallest_group"] for r in runs],
        "seconds_per_run": [r["seconds"] for r in runs],
        "runs": runs,
    }


if __name__ == "__main__":
    main()
