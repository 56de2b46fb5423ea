"""The issue-18 methods end to end: real ``swarmavg peer`` processes, one per peer.

As in test_collaborative_daemons.py, each training "process" is a thread of the test with
its own client talking to its own daemon.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import DiLoCo, sgd_outer_optimizer  # noqa: E402
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
