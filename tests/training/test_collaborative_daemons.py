"""The training wrappers end to end: real ``swarmavg peer`` processes, one per peer.

Each training "process" runs in a thread of the test with its own client; every client
talks to its own daemon, and the daemons average over the network.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo  # noqa: E402
from swarmavg.peer import Client, connect  # noqa: E402
from tests.harness import ProcessPool, SwarmavgProcess  # noqa: E402
from tests.training import helpers  # noqa: E402
from tests.training.helpers import (  # noqa: E402
    backward,
    batch,
    gradients,
    linear_model,
    run_in_threads,
    sgd_collaborative,
)

pytestmark = pytest.mark.integration
LR = 0.1
RUN = "train-test"


def start_daemons(pool: ProcessPool, n: int) -> list[SwarmavgProcess]:
    first = pool.start(
        [
            "peer",
            "--listen",
            "127.0.0.1:0",
            "--control",
            str(pool.workdir / "p0.sock"),
            "--run-id",
            RUN,
        ]
    )
    daemons = [first]
    for i in range(1, n):
        daemons.append(join_daemon(pool, first, i))
    return daemons


def join_daemon(pool: ProcessPool, first: SwarmavgProcess, i: int) -> SwarmavgProcess:
    return pool.start(
        [
            "peer",
            "--listen",
            "127.0.0.1:0",
            "--join",
            first.address,
            "--control",
            str(pool.workdir / f"p{i}.sock"),
            "--run-id",
            RUN,
        ]
    )


@pytest.fixture
def clients() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def open_client(stack: ExitStack, daemon: SwarmavgProcess) -> Client:
    return stack.enter_context(connect(daemon.control))


def make_peer(client: Client, **kwargs: object) -> tuple[torch.nn.Module, CollaborativeOptimizer]:
    model = linear_model()
    # No final round: the tests close one after another, so a closer whose partner still
    # held other parameters waited out final_timeout and kept its own; what they check
    # is the rounds' own result, which a final round could only average a difference from.
    options: dict[str, object] = {
        "averaging_timeout": 20.0,
        "final_round": False,
        "codec": "none",
        **kwargs,
    }
    opt = sgd_collaborative(model, client, run_id=RUN, target_batch_size=8, lr=LR, **options)
    return model, opt


def train_until(model: torch.nn.Module, opt: CollaborativeOptimizer, seed: int, epoch: int) -> None:
    helpers.train_until(model, opt, seed, epoch, limit=50)


@pytest.mark.timeout(120)
def test_two_daemons_average_gradients_keep_epochs_and_serve_a_late_joiner(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    ca, cb = (open_client(clients, d) for d in daemons)
    (ma, a), (mb, b) = make_peer(ca), make_peer(cb)
    reference = linear_model()
    ga, gb = gradients(reference, batch(10)), gradients(reference, batch(20))

    run_in_threads(lambda: train_until(ma, a, 10, 1), lambda: train_until(mb, b, 20, 1))
    assert a.stats.group_sizes == b.stats.group_sizes == [2]
    for p0, pa, pb, g1, g2 in zip(
        reference.parameters(), ma.parameters(), mb.parameters(), ga, gb, strict=True
    ):
        # the averaged gradient is the mean of the two peers' gradients
        assert torch.allclose(pa.detach(), p0.detach() - LR * (g1 + g2) / 2, atol=1e-6)
        assert torch.equal(pa, pb)

    run_in_threads(lambda: train_until(ma, a, 10, 4), lambda: train_until(mb, b, 20, 4))
    assert a.epoch == b.epoch == 4
    assert a.stats.failed == b.stats.failed == 0
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(pa, pb)

    # a late joiner behind its own daemon loads parameters, optimizer state and epoch
    cc = open_client(clients, join_daemon(swarmavg_processes, daemons[0], 2))
    torch.manual_seed(99)
    mc, c = make_peer(cc)
    assert c.epoch == 4
    assert c.stats.states_loaded == 1
    for pa, pc in zip(ma.parameters(), mc.parameters(), strict=True):
        assert torch.equal(pa, pc)
    sa, sc = a.optimizer.state_dict()["state"], c.optimizer.state_dict()["state"]
    for index in sa:
        assert torch.equal(sa[index]["momentum_buffer"], sc[index]["momentum_buffer"])
    # ... and trains on in step with the others
    run_in_threads(
        lambda: train_until(ma, a, 10, 6),
        lambda: train_until(mb, b, 20, 6),
        lambda: train_until(mc, c, 30, 6),
    )
    assert {a.epoch, b.epoch, c.epoch} == {6}
    assert c.stats.group_sizes[-1] == 3
    for pa, pb, pc in zip(ma.parameters(), mb.parameters(), mc.parameters(), strict=True):
        assert torch.equal(pa, pb)
        assert torch.equal(pa, pc)
    for opt in (a, b, c):
        opt.close()


@pytest.mark.timeout(120)
def test_diloco_across_two_daemons_matches_the_hand_computed_outer_step(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    models, opts = [], []
    for d in daemons:
        model = linear_model()
        models.append(model)
        opts.append(
            DiLoCo(
                model.parameters(),
                torch.optim.SGD(model.parameters(), lr=LR),
                client=open_client(clients, d),
                run_id=RUN,
                local_steps=3,
                batch_size_per_step=4,
                codec="none",
                averaging_timeout=20.0,
            )
        )

    def train(i: int) -> None:
        for step in range(3):
            backward(models[i], batch(10 * (i + 1) + step))
            opts[i].step()
            opts[i].zero_grad()

    deltas = []
    for i in range(2):
        replica = linear_model()
        inner = torch.optim.SGD(replica.parameters(), lr=LR)
        for step in range(3):
            backward(replica, batch(10 * (i + 1) + step))
            inner.step()
            inner.zero_grad()
        deltas.append(
            [
                p0.detach() - p.detach()
                for p0, p in zip(linear_model().parameters(), replica.parameters(), strict=True)
            ]
        )
    run_in_threads(lambda: train(0), lambda: train(1))
    assert [o.epoch for o in opts] == [1, 1]
    assert [o.stats.group_sizes for o in opts] == [[2], [2]]
    for p0, pa, pb, d1, d2 in zip(
        linear_model().parameters(), *(m.parameters() for m in models), *deltas, strict=True
    ):
        expected = p0.detach() - 0.7 * 1.9 * (d1 + d2) / 2  # first Nesterov outer step
        assert torch.allclose(pa.detach(), expected, atol=1e-5)
        assert torch.equal(pa, pb)


@pytest.mark.timeout(120)
def test_overlapped_rounds_across_two_daemons_stay_in_step(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    # delay_updates: the client is used from the training thread and the round thread at once
    daemons = start_daemons(swarmavg_processes, 2)
    (ma, a), (mb, b) = (make_peer(open_client(clients, d), delay_updates=True) for d in daemons)
    reference = linear_model()
    ga, gb = gradients(reference, batch(10)), gradients(reference, batch(20))
    run_in_threads(lambda: train_until(ma, a, 10, 1), lambda: train_until(mb, b, 20, 1))
    a.close()
    b.close()
    for p0, pa, pb, g1, g2 in zip(
        reference.parameters(), ma.parameters(), mb.parameters(), ga, gb, strict=True
    ):
        assert torch.allclose(pa.detach(), p0.detach() - LR * (g1 + g2) / 2, atol=1e-6)
        assert torch.equal(pa, pb)

    (ma, a), (mb, b) = (make_peer(open_client(clients, d), delay_updates=True) for d in daemons)
    assert a.epoch == b.epoch == 1  # the state the first pair published
    run_in_threads(lambda: train_until(ma, a, 10, 5), lambda: train_until(mb, b, 20, 5))
    a.close()
    b.close()
    assert a.stats.failed == b.stats.failed == 0
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(pa, pb)
