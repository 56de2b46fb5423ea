"""Streaming DiLoCo through faults in the middle of its fragment schedule, with real
``swarmavg peer`` daemons: a member killed (SIGKILL, its own process) and a member that
joins while the others train. Every member that is left ends on the swarm's parameters
(the anchor), bit for bit.

The tests share the module's three daemons (each test its own trainers' run id): neither
fault is a daemon's, and a daemon's start is most of what each test would otherwise wait
for."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import StreamingDiLoCo  # noqa: E402
from swarmavg.peer import connect  # noqa: E402
from tests.harness import ProcessPool, SwarmavgProcess  # noqa: E402
from tests.training.helpers import batch, run_in_threads  # noqa: E402
from tests.training.streaming_setup import (  # noqa: E402
    DAEMON_READY,
    make_model,
    make_streaming,
    start_daemons,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shared_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SwarmavgProcess]]:
    with ProcessPool(tmp_path_factory.mktemp("stream-daemons")) as pool:
        yield start_daemons(pool, 3)


@pytest.fixture
def daemons(shared_daemons: list[SwarmavgProcess]) -> list[SwarmavgProcess]:
    for daemon in shared_daemons:  # an earlier test must not have lost one
        assert daemon.proc.poll() is None, daemon.stderr()
    return shared_daemons


@pytest.fixture
def clients() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _train_to(
    model: torch.nn.Module,
    opt: StreamingDiLoCo,
    seed: int,
    epoch: int,
    at: dict[int, Callable[[], None]] | None = None,
) -> None:
    """Train until ``opt.epoch`` reaches ``epoch``, calling ``at[e]`` once epoch ``e`` is
    reached (the fault, from inside the schedule)."""
    pending = dict(at or {})
    for step in range(5000):
        for e in [e for e in pending if opt.epoch >= e]:
            pending.pop(e)()
        if opt.epoch >= epoch:
            return
        x, y = batch(seed + step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    raise AssertionError(f"sync {epoch} not reached (at {opt.epoch})")


def _same_anchor(opts: list[StreamingDiLoCo]) -> bool:
    return all(
        torch.equal(a, b)
        for other in opts[1:]
        for a, b in zip(opts[0].anchor, other.anchor, strict=True)
    )


@pytest.mark.timeout(600)
def test_a_trainer_killed_mid_schedule_leaves_the_others_on_one_anchor_and_its_restart_rejoins(
    swarmavg_processes: ProcessPool, daemons: list[SwarmavgProcess], clients: ExitStack
) -> None:
    run_id = "stream-killed"
    # Member 2 trains in its own process, so that it can be killed outright; it starts
    # training once the two members below have announced themselves.
    doomed = swarmavg_processes.start(
        [daemons[2].control, "200", "3", run_id],
        executable=[sys.executable, "-m", "tests.training.stream_trainer"],
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        ready_timeout=DAEMON_READY,  # it imports torch: a deadline for a loaded machine
    )
    models = [make_model() for _ in range(2)]
    opts = [
        make_streaming(m, clients.enter_context(connect(d.control)), run_id)
        for m, d in zip(models, daemons[:2], strict=True)
    ]
    # Sync 5 is the second fragment's third: killed there, member 2 leaves in the middle
    # of a cycle, with the next round possibly in flight.
    run_in_threads(
        lambda: _train_to(models[0], opts[0], 0, 12, at={5: lambda: doomed.signal(signal.SIGKILL)}),
        lambda: _train_to(models[1], opts[1], 100, 12),
        timeout=250.0,
    )
    assert doomed.wait(timeout=10) != 0
    assert any('"epoch": 4' in line for line in doomed.stdout_lines)  # it took part
    assert [o.epoch for o in opts] == [12, 12]
    assert _same_anchor(opts)
    assert 3 in opts[0].stats.group_sizes
    assert opts[0].stats.group_sizes[-1] == 2
    # Its restart (same daemon, fresh process state) takes the swarm's anchor and trains on.
    # The survivors publish epoch 12's state in the background after they report the epoch:
    # a restart that came first would take epoch 11's and leave the difference to the next
    # round's repair (docs/training.md, "Staying in one swarm"); here it must find 12's.
    for opt in opts:
        assert opt._publisher.settle(60.0)
    models.append(make_model())
    opts.append(
        make_streaming(models[2], clients.enter_context(connect(daemons[2].control)), run_id)
    )
    assert opts[2].epoch == 12
    assert opts[2].stats.states_loaded == 1
    assert _same_anchor(opts)
    run_in_threads(
        *(lambda i=i: _train_to(models[i], opts[i], 300 + 100 * i, 16) for i in range(3)),
        timeout=250.0,
    )
    for o in opts:
        o.close()
    assert [o.epoch for o in opts] == [16, 16, 16]
    assert _same_anchor(opts)
    assert 3 in opts[2].stats.group_sizes


@pytest.mark.timeout(600)
def test_a_member_joining_while_the_others_train_ends_on_their_anchor(
    daemons: list[SwarmavgProcess], clients: ExitStack
) -> None:
    run_id = "stream-joining"
    models = [make_model() for _ in range(3)]
    opts: list[StreamingDiLoCo] = [
        make_streaming(m, clients.enter_context(connect(d.control)), run_id)
        for m, d in zip(models[:2], daemons[:2], strict=True)
    ]
    joined = threading.Event()
    join_at = threading.Event()

    def joiner() -> None:
        # Sync 3 is the middle of the second cycle (fragment 0's turn next): the other two
        # keep training while this member loads the anchor and catches up.
        assert join_at.wait(200)
        client = clients.enter_context(connect(daemons[2].control))
        opts.append(make_streaming(models[2], client, run_id))
        joined.set()
        _train_to(models[2], opts[2], 200, 10)

    run_in_threads(
        lambda: _train_to(models[0], opts[0], 0, 10, at={3: join_at.set}),
        lambda: _train_to(models[1], opts[1], 100, 10),
        joiner,
        timeout=250.0,
    )
    assert joined.is_set()
    for o in opts:
        o.close()
    assert [o.epoch for o in opts] == [10, 10, 10]
    # It loaded the anchor on joining; when it arrives at a round the others have already
    # formed, that round fails for it and it loads the next state again (catch-up).
    assert opts[2].stats.states_loaded >= 1
    assert _same_anchor(opts)
    assert 3 in opts[2].stats.group_sizes
