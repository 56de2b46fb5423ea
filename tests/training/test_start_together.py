"""DiLoCo and StreamingDiLoCo trainers started apart, with and without the start barrier,
against the in-memory swarm.

The second trainer is built only once the first one says it waits (an event, not a sleep);
in the control, once the first one has taken an outer step. What is asserted is counted:
the rounds' group sizes, the states loaded, and the shared digest every member holds after
every sync. The barrier's waiting rule itself is ``CompanyLink.await_start``'s, shared with
``CollaborativeOptimizer`` (``test_start_barrier_daemons.py`` runs it behind real daemons).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import DiLoCo, StreamingDiLoCo  # noqa: E402
from tests.training.helpers import (  # noqa: E402
    Said,
    backward,
    batch,
    first_waits,
    linear_model,
    run_in_threads,
)
from tests.training.memswarm import MemorySwarm  # noqa: E402
from tests.training.test_unequal_speed import Record  # noqa: E402

pytestmark = pytest.mark.timeout(90)
__all__ = ["first_waits"]  # the fixture

SYNCS = 4
FAMILIES = {
    "diloco": (DiLoCo, {"local_steps": 4}),
    "streaming": (StreamingDiLoCo, {"local_steps": 8, "fragments": 2, "overlap_steps": 1}),
}


def trainer(swarm: MemorySwarm, name: str, family: str, **options: Any) -> tuple[Any, Any]:
    kind, schedule = FAMILIES[family]
    model = linear_model(0)
    opt = kind(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.05),
        swarm.client(name),
        run_id="run",
        batch_size_per_step=4,
        averaging_timeout=20.0,
        final_round=False,
        **schedule,
        **options,
    )
    return model, opt


def first_then_second(
    swarm: MemorySwarm, family: str, second_may_start: threading.Event, **options: Any
) -> tuple[Any, Any, Record]:
    """The first trainer trains from the start; the second is built once
    ``second_may_start`` is set; both train to ``SYNCS`` syncs."""
    trainers = {"first": trainer(swarm, "first", family, **options)}
    record = Record()
    built = threading.Event()

    def train(name: str) -> None:
        if name == "second":
            assert second_may_start.wait(60), "the first trainer never got there"
            trainers[name] = trainer(swarm, name, family, **options)
            built.set()
        model, opt = trainers[name]
        with opt:
            while opt.epoch < SYNCS:
                if name == "first" and opt.epoch >= 1 and not built.is_set():
                    # the control: it stepped alone; once the swarm's progress says so (the
                    # new epoch's record is stored in the background), the second starts
                    opt.tracker.report()
                    second_may_start.set()
                    assert built.wait(60)
                backward(model, batch(opt.epoch * 100 + len(name)))
                record.step(name, opt, 0.002)

    run_in_threads(lambda: train("first"), lambda: train("second"), timeout=85)
    return trainers["first"][1], trainers["second"][1], record


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trainers_started_apart_take_every_outer_step_together(
    family: str, first_waits: Said
) -> None:
    swarm = MemorySwarm()
    first, second, record = first_then_second(
        swarm, family, first_waits.event, min_peers=2, start_timeout=60.0
    )
    # every sync was one group of both, from one anchor: nobody stepped alone, nobody
    # needed a download to join
    for opt in (first, second):
        assert opt.stats.group_sizes[: SYNCS - 1] == [2] * (SYNCS - 1), opt.stats.group_sizes
        assert opt.stats.states_loaded == 0
        assert opt.stats.repairs == 0
    for epoch in range(1, SYNCS + 1):
        held = record.digests[epoch]
        assert sorted(held) == ["first", "second"], (epoch, sorted(held))
        assert len(set(held.values())) == 1, epoch


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_without_the_barrier_the_first_trainer_steps_alone(family: str) -> None:
    """The control: ``start_timeout=0`` (and ``min_peers`` at its default) lets the first
    trainer take the run's first outer step alone; the second then joins by downloading
    its state."""
    swarm = MemorySwarm()
    never = threading.Event()
    first, second, record = first_then_second(swarm, family, never, start_timeout=0.0)
    assert record.digests[1].keys() == {"first"}  # the first sync was the first's alone
    assert len(first.stats.group_sizes) < first.epoch
    assert second.stats.states_loaded >= 1


def test_a_joiner_behind_waits_for_the_state_its_leader_is_still_publishing() -> None:
    """StreamingDiLoCo reports its new epoch while its state is still being published in
    the background: a trainer built in that window sees the swarm ahead and nothing
    published yet. It waits for the state due (within ``state_timeout``) instead of
    going on alone from its own initial parameters."""
    swarm = MemorySwarm()
    gate = swarm.publish_gate = threading.Event()  # the leader's publish of epoch 1 is held
    model, first = trainer(swarm, "first", "streaming", start_timeout=0.0)
    with first:
        while first.epoch < 1:
            backward(model, batch(first.epoch))
            first.step()
        first.tracker.report()  # the swarm's progress says epoch 1 ...
        assert not swarm.states  # ... and nothing is published yet
        swarm.on_no_state = lambda _caller: gate.set()  # let it land once a load missed it
        _, second = trainer(swarm, "second", "streaming", start_timeout=0.0)
        with second:
            assert gate.is_set()  # the joiner found nothing at first
            assert second.epoch == 1
            assert second.stats.states_loaded == 1
            for mine, theirs in zip(second.anchor, first.anchor, strict=True):
                assert torch.equal(mine, theirs)  # the leader's anchor, not its own start
