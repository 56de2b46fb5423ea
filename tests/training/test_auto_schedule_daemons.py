"""``local_steps="auto"`` through real ``swarmavg peer`` daemons: every member measures,
all of them pick the same H (and streaming schedule), and a late joiner takes it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import DiLoCo, StreamingDiLoCo  # noqa: E402
from swarmavg.averaging.training.schedule import (  # noqa: E402
    diloco_local_steps,
    streaming_schedule,
)
from swarmavg.peer import connect  # noqa: E402
from tests.harness import ProcessPool  # noqa: E402
from tests.training.helpers import batch, run_in_threads  # noqa: E402
from tests.training.streaming_setup import join_daemon, start_daemons  # noqa: E402

pytestmark = pytest.mark.integration
RUN = "train-test"  # the run id start_daemons gives the daemons
DILOCO_BOUNDS = (2, 40)
STREAMING_BOUNDS = (4, 40)


@pytest.fixture
def clients() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 2))


def _train_to(
    model: torch.nn.Module, opt: Any, seed: int, epoch: int, schedules: list[tuple[int, int]]
) -> None:
    """Train until ``opt.epoch`` reaches ``epoch``; record (H, overlap) at each new epoch."""
    last = opt.epoch
    for step in range(2000):
        if opt.epoch >= epoch:
            return
        x, y = batch(seed + step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if opt.epoch != last:
            last = opt.epoch
            schedules.append((opt.local_steps, getattr(opt, "overlap_steps", 0)))
    raise AssertionError(f"epoch {epoch} not reached (at {opt.epoch})")


@pytest.mark.timeout(180)
def test_diloco_auto_picks_one_h_on_every_member_from_the_measured_times(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    models = [_model() for _ in daemons]
    opts = [
        DiLoCo(
            m.parameters(),
            torch.optim.SGD(m.parameters(), lr=0.05),
            client=clients.enter_context(connect(d.control)),
            run_id=RUN,
            local_steps="auto",
            local_steps_bounds=DILOCO_BOUNDS,
            auto_overhead=0.5,
            batch_size_per_step=4,
            averaging_timeout=20.0,
            final_timeout=0.5,  # closers that stop one after another wait this
        )
        for m, d in zip(models, daemons, strict=True)
    ]
    assert [o.local_steps for o in opts] == [2, 2]  # nothing measured: the lowest bound
    schedules: list[list[tuple[int, int]]] = [[], []]
    run_in_threads(
        *(lambda i=i: _train_to(models[i], opts[i], 100 * i, 4, schedules[i]) for i in range(2)),
        timeout=150.0,
    )
    for o in opts:
        o.close()
    assert [o.epoch for o in opts] == [4, 4]
    assert [o.stats.group_sizes for o in opts] == [[2] * 4, [2] * 4]
    # The first round carried no measured round time (none had run); from the second on
    # the swarm agreed on a ratio and both members took the same H from it.
    assert schedules[0] == schedules[1]
    assert opts[0].agreed_ratio == opts[1].agreed_ratio
    ratio = opts[0].agreed_ratio
    assert ratio is not None
    assert ratio > 0
    h = diloco_local_steps(ratio, overhead=0.5, bounds=DILOCO_BOUNDS)
    assert opts[0].local_steps == opts[1].local_steps == h
    assert all(DILOCO_BOUNDS[0] <= s <= DILOCO_BOUNDS[1] for s, _ in schedules[0])
    for pa, pb in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(pa, pb)
    # A checkpoint carries H.
    state = opts[0].state_dict()
    assert state["local_steps"] == h


def _streaming(model: torch.nn.Module, client: Any) -> StreamingDiLoCo:
    return StreamingDiLoCo(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.05),
        client=client,
        run_id=RUN,
        local_steps="auto",
        local_steps_bounds=STREAMING_BOUNDS,
        fragments=2,
        batch_size_per_step=4,
        averaging_timeout=20.0,
        final_timeout=0.5,  # closers that stop one after another wait this
    )


@pytest.mark.timeout(300)
def test_streaming_auto_agrees_on_the_schedule_and_a_late_joiner_takes_it(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    models = [_model() for _ in daemons]
    opts = [
        _streaming(m, clients.enter_context(connect(d.control)))
        for m, d in zip(models, daemons, strict=True)
    ]
    assert [(o.cycle_steps, o.overlap_steps) for o in opts] == [(4, 1), (4, 1)]
    schedules: list[list[tuple[int, int]]] = [[], [], []]
    run_in_threads(
        *(lambda i=i: _train_to(models[i], opts[i], 100 * i, 6, schedules[i]) for i in range(2)),
        timeout=250.0,
    )
    assert [o.epoch for o in opts] == [6, 6]
    assert schedules[0] == schedules[1]
    ratio = opts[0].agreed_ratio
    assert ratio is not None
    assert ratio == opts[1].agreed_ratio
    want = streaming_schedule(ratio, 2, bounds=STREAMING_BOUNDS)
    for o in opts:
        assert (o.cycle_steps, o.overlap_steps) == (want.local_steps, want.overlap_steps)
        assert o.local_steps == want.local_steps // 2
    for a, b in zip(opts[0].anchor, opts[1].anchor, strict=True):
        assert torch.equal(a, b)
    # A third member joins between two fragment syncs: it loads the anchor and the
    # swarm's schedule with it, not its own first guess.
    joiner = join_daemon(swarmavg_processes, daemons[0], 2)
    models.append(_model())
    opts.append(_streaming(models[2], clients.enter_context(connect(joiner.control))))
    assert opts[2].epoch == 6
    assert opts[2].stats.states_loaded == 1
    assert (opts[2].cycle_steps, opts[2].overlap_steps) == (
        opts[0].cycle_steps,
        opts[0].overlap_steps,
    )
    run_in_threads(
        *(
            lambda i=i: _train_to(models[i], opts[i], 100 * i + 50, 9, schedules[i])
            for i in range(3)
        ),
        timeout=250.0,
    )
    for o in opts:
        o.close()
    assert [o.epoch for o in opts] == [9, 9, 9]
    assert len({(o.cycle_steps, o.overlap_steps) for o in opts}) == 1
    for other in opts[1:]:
        for a, b in zip(opts[0].anchor, other.anchor, strict=True):
            assert torch.equal(a, b)
    assert 3 in opts[2].stats.group_sizes
