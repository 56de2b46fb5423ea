"""The DiLoCo-family methods end to end: real ``swarmavg peer`` processes, one per peer.

As in test_collaborative_daemons.py, each training "process" is a thread of the test with
its own client talking to its own daemon.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import (  # noqa: E402
    DiLoCo,
    PowerSGDOptimizer,
    StreamingDiLoCo,
    sgd_outer_optimizer,
)
from swarmavg.averaging.training.powersgd import PowerSGDState, orthogonalize  # noqa: E402
from swarmavg.peer import connect  # noqa: E402
from tests.harness import ProcessPool  # noqa: E402
from tests.training.helpers import batch, run_in_threads  # noqa: E402
from tests.training.test_collaborative_daemons import start_daemons  # noqa: E402

pytestmark = pytest.mark.integration
RUN = "train-test"  # the run id start_daemons gives the daemons


@pytest.fixture
def clients() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@pytest.mark.timeout(120)
def test_diloco_with_sparseloco_across_two_daemons_ends_bit_identical(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    models = [torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Linear(64, 2)) for _ in daemons]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    start = [p.detach().clone() for p in models[0].parameters()]
    opts = [
        DiLoCo(
            m.parameters(),
            torch.optim.SGD(m.parameters(), lr=0.05),
            client=clients.enter_context(connect(d.control)),
            run_id=RUN,
            local_steps=3,
            batch_size_per_step=4,
            outer_optimizer=sgd_outer_optimizer,
            codec="sparseloco:fraction=0.05,block=64",
            averaging_timeout=20.0,
            final_timeout=0.5,  # closers that stop one after another wait this
        )
        for m, d in zip(models, daemons, strict=True)
    ]

    def train(i: int) -> None:
        for step in range(9):
            x, y = batch(10 * (i + 1) + step)
            torch.nn.functional.mse_loss(models[i](x), y).backward()
            opts[i].step()
            opts[i].zero_grad()

    run_in_threads(lambda: train(0), lambda: train(1))
    assert [o.epoch for o in opts] == [3, 3]
    assert [o.stats.group_sizes for o in opts] == [[2, 2, 2], [2, 2, 2]]
    for pa, pb in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(pa, pb)
    # Each outer step moved only the coordinates some member sent: 5% of every block of
    # 64 per member, so after three steps most of the 322 parameters are still at start.
    moved = sum(
        int((p.detach() != s).sum()) for p, s in zip(models[0].parameters(), start, strict=True)
    )
    total = sum(s.numel() for s in start)
    assert 0 < moved <= 3 * 2 * total * 0.05 + 3 * 2 * 6  # + the blocks' rounding up


def _streaming(model: torch.nn.Module, client: object, **kwargs: object) -> StreamingDiLoCo:
    options: dict[str, object] = {
        "local_steps": 4,
        "batch_size_per_step": 4,
        "fragments": 2,
        "overlap_steps": 1,
        "codec": "uint4-blockwise",
        "averaging_timeout": 20.0,
        "final_timeout": 0.5,
        **kwargs,
    }
    return StreamingDiLoCo(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        client=client,  # type: ignore[arg-type]
        run_id=RUN,
        **options,  # type: ignore[arg-type]
    )


def _two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 2))


def _train_to(model: torch.nn.Module, opt: StreamingDiLoCo, seed: int, epoch: int) -> None:
    for step in range(200):
        if opt.epoch >= epoch:
            return
        x, y = batch(seed + step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    raise AssertionError(f"sync {epoch} not reached (at {opt.epoch})")


@pytest.mark.timeout(300)
def test_streaming_diloco_across_daemons_keeps_one_anchor_and_a_late_joiner_takes_it(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    models = [_two_layers() for _ in daemons]
    opts = [
        _streaming(m, clients.enter_context(connect(d.control)))
        for m, d in zip(models, daemons, strict=True)
    ]
    # Six fragment syncs: each of the two fragments three times, every round overlapped.
    run_in_threads(*(lambda i=i: _train_to(models[i], opts[i], 100 * i, 6) for i in range(2)))
    assert [o.epoch for o in opts] == [6, 6]
    assert [o.stats.group_sizes for o in opts] == [[2] * 6, [2] * 6]
    for a, b in zip(opts[0].anchor, opts[1].anchor, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(opts[0].anchor[0], _two_layers()[0].weight.detach())
    # A third member joins in the middle of the schedule (sync 6 of fragment 1 is next):
    # it loads the published anchor and outer state, and from then on all three agree.
    args = ["peer", "--listen", "127.0.0.1:0", "--join", daemons[0].address, "--run-id", RUN]
    joiner_daemon = swarmavg_processes.start(
        [*args, "--control", str(swarmavg_processes.workdir / "p2.sock")],
        ready_timeout=90.0,  # a deadline for a loaded machine, not a measurement
    )
    models.append(_two_layers())
    opts.append(_streaming(models[2], clients.enter_context(connect(joiner_daemon.control))))
    assert opts[2].epoch == 6
    assert opts[2].stats.states_loaded == 1
    for a, b in zip(opts[0].anchor, opts[2].anchor, strict=True):
        assert torch.equal(a, b)
    run_in_threads(*(lambda i=i: _train_to(models[i], opts[i], 100 * i + 50, 10) for i in range(3)))
    for o in opts:
        o.close()
    assert [o.epoch for o in opts] == [10, 10, 10]
    for other in opts[1:]:
        for a, b in zip(opts[0].anchor, other.anchor, strict=True):
            assert torch.equal(a, b)
    assert 3 in opts[2].stats.group_sizes


@pytest.mark.timeout(180)
def test_powersgd_across_two_daemons_steps_on_the_factors_of_the_mean_gradient(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Linear(16, 2))

    models = [model() for _ in daemons]
    opts = [
        PowerSGDOptimizer(
            m.parameters(),
            torch.optim.SGD(m.parameters(), lr=0.1),
            clients.enter_context(connect(d.control)),
            RUN,
            target_batch_size=8,
            batch_size_per_step=4,
            codec="none",
            rank=1,
            averaging_timeout=20.0,
            final_timeout=0.5,  # closers that stop one after another wait this
            max_wait=10.0,
        )
        for m, d in zip(models, daemons, strict=True)
    ]
    assert opts[0].powersgd.compressed == [0, 2]  # the weights; the biases travel whole

    def grads_of(i: int, m: torch.nn.Module) -> list[np.ndarray]:
        x, y = batch(10 * (i + 1))
        m.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        return [p.grad.detach().numpy().copy() for p in m.parameters()]  # type: ignore[union-attr]

    # Expected first step, by the pure math: mean gradient, rank-1 factors of the weight's.
    local = [grads_of(i, model()) for i in range(2)]
    state = PowerSGDState([tuple(p.shape) for p in model().parameters()], rank=1)
    mean = [(a + b) / 2 for a, b in zip(*local, strict=True)]
    expected = list(mean)
    for i in state.compressed:
        p_hat = orthogonalize(mean[i] @ state.q[i])
        expected[i] = p_hat @ (mean[i].T @ p_hat).T

    # The initial parameters, built here: model() seeds torch's global generator, which
    # the two threads would share (one's seeding could land in the middle of the other's
    # draws, giving it other initial values for the later layers).
    initial = [p.detach().clone() for p in model().parameters()]

    def train(i: int) -> None:
        # Until epoch 4, not for 4 steps: after the first epoch (whose wait has no
        # throughput to go by) a peer may stop waiting and take a second batch in an
        # epoch when the other's measured throughput looks slower (_wait_for_swarm).
        for step in range(40):
            if opts[i].epoch >= 4:
                return
            x, y = batch(10 * (i + 1) + step)
            torch.nn.functional.mse_loss(models[i](x), y).backward()
            opts[i].step()
            opts[i].zero_grad()
            if step == 0:
                stepped = zip(initial, models[i].parameters(), expected, strict=True)
                for p0, p1, e in stepped:
                    got = ((p0 - p1.detach()) / 0.1).numpy()
                    np.testing.assert_allclose(got, e, atol=1e-5)

    run_in_threads(lambda: train(0), lambda: train(1))
    for o in opts:
        o.close()
    assert [o.epoch for o in opts] == [4, 4]
    assert opts[0].stats.group_sizes == [2] * 8  # two rounds per step
    for pa, pb in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(pa, pb)
    assert np.array_equal(opts[0].powersgd.q[0], opts[1].powersgd.q[0])
    assert not np.array_equal(opts[0].powersgd.residual[0], opts[1].powersgd.residual[0])
