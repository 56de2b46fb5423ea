"""DiLoCo trainers of unequal speed with a ``pace`` against the in-memory swarm.

Each trainer's inner step sleeps its own compute time (the seam that stands for a slower
GPU); the pace plans each member's inner steps from the rates in the progress records.
What is asserted is counted, not timed: how many inner steps each member ran per outer
step, the rounds' group sizes and weights, the state digests after every sync, and what
a stalled member did with its work when it came back. The same with real daemons and
trainer processes is ``tests/integration/test_unequal_speed_daemons.py``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import DiLoCo  # noqa: E402
from swarmavg.averaging.training.pace import SwarmPace  # noqa: E402
from tests.training.helpers import backward, batch, linear_model, run_in_threads  # noqa: E402
from tests.training.memswarm import MemorySwarm  # noqa: E402

pytestmark = pytest.mark.timeout(90)

BATCH = 4


def paced(
    swarm: MemorySwarm, name: str, pace: SwarmPace, family: Any = DiLoCo, **options: Any
) -> tuple[Any, Any]:
    """A trainer of ``family`` (``DiLoCo`` or ``StreamingDiLoCo``) with ``pace``."""
    model = linear_model(0)
    opt = family(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.05),
        swarm.client(name),
        run_id="run",
        batch_size_per_step=BATCH,
        pace=pace,
        final_round=False,
        **{"local_steps": 4, **options},
    )
    return model, opt


class Record:
    """Per member: inner steps per epoch, and the shared digest each epoch started with."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.digests: dict[int, dict[str, bytes]] = defaultdict(dict)

    def step(self, name: str, opt: Any, compute: float) -> None:
        epoch = opt.epoch
        time.sleep(compute)  # this member's simulated compute
        opt.step()
        opt.zero_grad()
        with self.lock:
            self.steps[name][epoch] += 1
            if opt.epoch != epoch:
                self.digests[opt.epoch][name] = opt._shared_digest()

    def train_all(
        self, trainers: dict[str, tuple[Any, Any]], computes: dict[str, float], epochs: int
    ) -> None:
        """Every trainer in its own thread, each step costing its compute, to ``epochs``."""

        def train(name: str) -> None:
            model, opt = trainers[name]
            with opt:
                while opt.epoch < epochs:
                    backward(model, batch(opt.epoch * 100 + len(name)))
                    self.step(name, opt, computes[name])

        run_in_threads(*[lambda n=n: train(n) for n in computes], timeout=80)


def test_fast_members_run_more_steps_and_nobody_waits() -> None:
    swarm = MemorySwarm()
    computes = {"fast-a": 0.01, "fast-b": 0.01, "fast-c": 0.01, "slow": 0.04}
    pace = SwarmPace(target_samples=40 * BATCH)
    trainers = {name: paced(swarm, name, pace, averaging_timeout=20.0) for name in computes}
    record = Record()
    epochs = 5
    record.train_all(trainers, computes, epochs)

    # every outer step was one group of all four: nobody was left behind or waited out
    sizes = [trainers[n][1].stats.group_sizes for n in computes]
    assert all(s == [4] * epochs for s in sizes), sizes
    # from the second round on (rates measured), the slow member's share of the work
    # follows its speed: a quarter of a fast member's steps, within a wide margin (the
    # threads' own overheads, shared by all, narrow the ratio on a loaded machine)
    rounds = range(1, epochs)
    fast = min(sum(record.steps[n][e] for e in rounds) for n in ("fast-a", "fast-b", "fast-c"))
    slow = sum(record.steps["slow"][e] for e in rounds)
    assert all(record.steps["slow"][e] >= 1 for e in rounds)
    assert 3 * slow <= 2 * fast, (dict(record.steps["slow"]), dict(record.steps["fast-a"]))
    # and its pseudo-gradient is weighted by the samples behind it
    weights: dict[str, list[float]] = defaultdict(list)
    for peer, key, weight, _ in swarm.calls:
        if key.startswith("run.diloco."):
            weights[peer].append(weight)
    assert weights["slow"][-1] < weights["fast-a"][-1]
    # one shared state after every sync
    for epoch in range(1, epochs + 1):
        assert len(record.digests[epoch]) == 4
        assert len(set(record.digests[epoch].values())) == 1, epoch


@pytest.mark.parametrize(("staleness", "merged"), [(1, True), (0, False)])
def test_a_stalled_member_merges_or_discards_its_work(staleness: int, merged: bool) -> None:
    """One member stops mid-round (a closed lid); the others step on without it after the
    round's timeout; when it resumes, its work is carried onto their anchor (or dropped
    with ``max_staleness=0``) and it is back in their rounds with the same state."""
    swarm = MemorySwarm()
    names = ["a", "b", "c", "lid"]
    pace = SwarmPace(target_samples=24 * BATCH, max_staleness=staleness)
    trainers = {n: paced(swarm, n, pace, averaging_timeout=2.0) for n in names}
    record = Record()
    epochs = 4
    others_past_stall = threading.Event()
    lid_back = threading.Event()

    def train(name: str) -> None:
        model, opt = trainers[name]
        with opt:
            while opt.epoch < epochs:
                if name == "lid" and opt.epoch == 1 and record.steps[name][1] == 1:
                    # the lid closes after one inner step of epoch 1, until the others
                    # have taken epoch 1's outer step without it
                    assert others_past_stall.wait(60)
                if name == "lid" and opt.epoch >= 2:
                    lid_back.set()
                if name != "lid" and opt.epoch >= 2:
                    # the choreography only pins which state the lid finds (epoch 2's):
                    # the others' rounds never wait for it by design
                    others_past_stall.set()
                    assert lid_back.wait(60)
                backward(model, batch(opt.epoch * 100 + len(name)))
                record.step(name, opt, 0.003)

    run_in_threads(*[lambda n=n: train(n) for n in names], timeout=85)

    lid = trainers["lid"][1]
    assert lid.stats.late_merges == (1 if merged else 0)
    assert lid.stats.late_discards == (0 if merged else 1)
    # epoch 1's outer step went on without it; it took part again afterwards
    assert 3 in trainers["a"][1].stats.group_sizes
    assert lid.epoch == epochs
    for epoch in range(2, epochs + 1):
        held = record.digests[epoch]
        assert len(set(held.values())) == 1, (epoch, sorted(held))
    assert "lid" in record.digests[epochs]


def test_streaming_diloco_takes_the_same_pace() -> None:
    """``StreamingDiLoCo`` with a pace: the target is the swarm's samples per fragment sync;
    the slow member runs fewer inner steps between syncs and every sync ends with one
    anchor and outer state on every member."""
    from swarmavg.averaging.optim import StreamingDiLoCo

    swarm = MemorySwarm()
    computes = {"fast-a": 0.01, "fast-b": 0.01, "slow": 0.04}
    pace = SwarmPace(target_samples=30 * BATCH)
    trainers = {
        name: paced(
            swarm,
            name,
            pace,
            StreamingDiLoCo,
            local_steps=8,
            fragments=2,
            overlap_steps=1,
            averaging_timeout=20.0,
        )
        for name in computes
    }
    record = Record()
    syncs = 5
    record.train_all(trainers, computes, syncs)

    for name in computes:
        assert trainers[name][1].stats.group_sizes[: syncs - 1] == [3] * (syncs - 1), name
    fast = sum(record.steps["fast-a"][e] for e in range(2, syncs))
    slow = sum(record.steps["slow"][e] for e in range(2, syncs))
    assert 3 * slow <= 2 * fast, (dict(record.steps["slow"]), dict(record.steps["fast-a"]))
    for epoch in range(1, syncs):
        assert len(set(record.digests[epoch].values())) == 1, epoch


def test_a_late_joiner_plans_the_rest_of_the_round_and_shares_the_state() -> None:
    """A trainer that starts while three paced ones train loads their state, runs what is
    left of the round at its own pace, and every later outer step has one state on all
    four."""
    swarm = MemorySwarm()
    computes = {"a": 0.004, "b": 0.004, "c": 0.004, "late": 0.008}
    pace = SwarmPace(target_samples=30 * BATCH)
    trainers = {n: paced(swarm, n, pace, averaging_timeout=20.0) for n in ("a", "b", "c")}
    record = Record()
    epochs = 5
    first_steps_done = threading.Event()
    joined = threading.Event()

    def train(name: str) -> None:
        if name == "late":
            assert first_steps_done.wait(60)
            trainers[name] = paced(swarm, name, pace, averaging_timeout=20.0)
            joined.set()
        model, opt = trainers[name]
        with opt:
            while opt.epoch < epochs:
                if opt.epoch >= 2 and name != "late":
                    # the choreography pins when it joins: during epoch 2, once published
                    first_steps_done.set()
                    assert joined.wait(60)
                backward(model, batch(opt.epoch * 100 + len(name)))
                record.step(name, opt, computes[name])

    run_in_threads(*[lambda n=n: train(n) for n in computes], timeout=80)

    late = trainers["late"][1]
    assert late.stats.states_loaded >= 1
    assert 4 in late.stats.group_sizes
    assert record.steps["late"][2] >= 1  # it trained in the round it joined
    for epoch in range(3, epochs + 1):
        held = record.digests[epoch]
        assert len(held) == 4, (epoch, sorted(held))
        assert len(set(held.values())) == 1, epoch


@pytest.mark.parametrize("other", [{"local_steps": "auto"}, {"process_group": "auto"}])
def test_pace_refuses_what_sets_the_steps_otherwise(other: dict[str, Any]) -> None:
    """``"auto"`` H and the hierarchical mode each fix every member's or rank's steps: a
    pace would contradict them, so the wrapper refuses the mix when it is built."""
    with pytest.raises(ValueError, match="pace sets each member's inner steps"):
        paced(MemorySwarm(), "a", SwarmPace(target_samples=64), **other)
