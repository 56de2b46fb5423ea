"""The start barrier: a trainer's first global step (DiLoCo: its first inner step) waits for
the other trainers of its run instead of taking the run's first steps alone. Real
``swarmavg peer`` processes; the second trainer starts only once the first one says it
waits (an event, not a sleep)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.run_records.trainers import AVERAGERS_SUFFIX  # noqa: E402
from swarmavg.averaging.training.base import SwarmOptimizer  # noqa: E402
from swarmavg.peer import connect  # noqa: E402
from tests.harness import ProcessPool  # noqa: E402
from tests.run_daemons import clients, run_daemon  # noqa: E402
from tests.training.helpers import (  # noqa: E402
    Said,
    first_waits,
    linear_model,
    run_in_threads,
    sgd_collaborative,
    train_until,
)

pytestmark = pytest.mark.integration
RUN = "start-barrier"
__all__ = ["clients", "first_waits"]  # the fixtures


def trainer(client: Any, **options: Any) -> tuple[Any, SwarmOptimizer]:
    model = linear_model()
    opt = sgd_collaborative(
        model,
        client,
        run_id=None,
        target_batch_size=8,
        averaging_timeout=20.0,
        final_timeout=2.0,
        codec="none",
        start_timeout=90.0,
        **options,
    )
    return model, opt


def diloco_trainer(client: Any, **options: Any) -> tuple[Any, SwarmOptimizer]:
    from swarmavg.averaging.optim import DiLoCo

    model = linear_model()
    opt = DiLoCo(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.05),
        client,
        run_id=None,
        local_steps=3,
        batch_size_per_step=4,
        averaging_timeout=20.0,
        final_timeout=2.0,
        codec="none",
        start_timeout=90.0,
        **options,
    )
    return model, opt


def first_then_second(
    first: tuple[Any, SwarmOptimizer], first_waits: Said, make_second: Any
) -> None:
    """Train ``first`` to epoch 2; once it says it waits, make the second trainer and train
    it to epoch 2 too; both must have taken every global step together (no step alone),
    from one shared state (digests equal after each)."""
    seconds: list[tuple[Any, SwarmOptimizer]] = []
    digests: dict[str, list[bytes]] = {"a": [], "b": []}

    def train(name: str, model: Any, opt: SwarmOptimizer, seed: int) -> None:
        for epoch in (1, 2):
            train_until(model, opt, seed, epoch)
            digests[name].append(opt._shared_digest())

    def second() -> None:
        assert first_waits.event.wait(60), "the first trainer never waited"
        seconds.append(make_second())
        train("b", *seconds[0], 20)

    run_in_threads(lambda: train("a", *first, 10), second, timeout=100)
    a, b = first[1], seconds[0][1]
    assert a.stats.group_sizes == b.stats.group_sizes == [2, 2]
    assert digests["a"] == digests["b"]
    assert a.stats.states_loaded == b.stats.states_loaded == 0
    a.close()
    b.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [trainer, diloco_trainer], ids=["collaborative", "diloco"])
def test_the_first_global_step_waits_for_the_trainer_of_a_daemon_already_up(
    swarmavg_processes: ProcessPool, clients: ExitStack, first_waits: Said, make: Any
) -> None:
    first_daemon = run_daemon(swarmavg_processes, RUN, 0)
    second_daemon = run_daemon(swarmavg_processes, RUN, 1, first_daemon)
    ca = clients.enter_context(connect(first_daemon.control))
    cb = clients.enter_context(connect(second_daemon.control))
    # the daemons' presence entries are what tells the first trainer to wait
    for _ in range(200):
        if len(ca.dht.get(f"{RUN}{AVERAGERS_SUFFIX}") or {}) >= 2:
            break
    ma, a = make(ca)
    first_then_second((ma, a), first_waits, lambda: make(cb))


@pytest.mark.timeout(120)
def test_min_peers_waits_for_a_trainer_whose_daemon_is_not_up_yet(
    swarmavg_processes: ProcessPool, clients: ExitStack, first_waits: Said
) -> None:
    first_daemon = run_daemon(swarmavg_processes, RUN, 0)
    ma, a = trainer(clients.enter_context(connect(first_daemon.control)), min_peers=2)

    def make_second() -> tuple[Any, SwarmOptimizer]:
        late = run_daemon(swarmavg_processes, RUN, 1, first_daemon)
        return trainer(clients.enter_context(connect(late.control)), min_peers=2)

    first_then_second((ma, a), first_waits, make_second)


@pytest.mark.timeout(60)
def test_a_lone_daemons_trainer_does_not_wait(
    swarmavg_processes: ProcessPool, clients: ExitStack, first_waits: Said
) -> None:
    ca = clients.enter_context(connect(run_daemon(swarmavg_processes, RUN, 0).control))
    ma, a = trainer(ca)
    train_until(ma, a, 10, 2)
    assert not first_waits.event.is_set()
    a.close()
