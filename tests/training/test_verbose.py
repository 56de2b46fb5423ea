"""``verbose=True`` on the wrappers: the epoch, the swarm's samples/s and the
time to the next step, through the library's logger, at most every few seconds and never at
an epoch's empty start."""

from __future__ import annotations

import itertools
import logging
import math
import re
import warnings
from typing import Any

import pytest
import torch

from swarmavg.averaging.training.verbose import ProgressLog, eta_text, progress_line
from tests.training.helpers import backward, batch, linear_model
from tests.training.memswarm import MemorySwarm
from tests.training.test_torch_optimizer import WRAPPERS

pytestmark = pytest.mark.timeout(60)
LOGGER = "swarmavg.averaging.training.verbose"


def test_the_line_names_epoch_progress_throughput_and_eta() -> None:
    assert progress_line(12, 3072, 4096, 512.0, 4, 2.0) == (
        "epoch 12: 3072/4096 samples (75%), swarm 512.0 samples/s from 4 peers, next step in ~2 s"
    )
    assert progress_line(0, 9, 8, 1.0, 1, 0.0).endswith(
        "(100%), swarm 1.0 samples/s from 1 peer, next step due now"
    )
    assert [eta_text(s) for s in (math.inf, -1.0, 0.0, 0.2, 30.0, 600.0, 7200.0)] == [
        "unknown",
        "unknown",
        "due now",
        "<1 s",
        "~30 s",
        "~10 min",
        "~2.0 h",
    ]


def test_a_line_at_most_every_few_seconds_never_at_an_epochs_empty_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    plog = ProgressLog(every=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert plog.update(0, 8, 16, 4.0, 2, 2.0)  # the first update logs
        now[0] = 5.0
        assert not plog.update(1, 0, 16, 4.0, 2, 4.0)  # too soon, new epoch or not
        now[0] = 15.0
        assert not plog.update(2, 0, 16, 4.0, 2, 4.0)  # due, but the epoch just began
        now[0] = 16.0
        assert plog.update(2, 12, 16, 4.0, 2, 1.0)  # the next step shows its progress
        now[0] = 30.0
        assert not plog.update(3, 0, 16, 4.0, 2, 4.0)
        now[0] = 31.0
        assert plog.update(4, 0, 16, 4.0, 2, 4.0)  # one-step epochs still get a line
    assert [r.getMessage() for r in caplog.records] == [
        "epoch 0: 8/16 samples (50%), swarm 4.0 samples/s from 2 peers, next step in ~2 s",
        "epoch 2: 12/16 samples (75%), swarm 4.0 samples/s from 2 peers, next step in ~1 s"
        " (2 global steps since the last line)",
        "epoch 4: 0/16 samples (0%), swarm 4.0 samples/s from 2 peers, next step in ~4 s"
        " (2 global steps since the last line)",
    ]
    with pytest.raises(ValueError, match="positive"):
        ProgressLog(every=0)


def test_the_swarm_rate_is_smoothed_over_the_interval() -> None:
    now = [0.0]
    plog = ProgressLog(every=10.0, clock=lambda: now[0])
    plog.update(0, 0, 256, 1600.0, 2, 1.0)
    rates = []
    for i, jumpy in enumerate([41000.0, 1600.0, 41000.0, 1600.0] * 5):
        now[0] = 0.5 * (i + 1)
        plog.update(0, 0, 256, jumpy, 2, 1.0)
        assert plog.rate is not None
        rates.append(plog.rate)
    # the reported figures jump 25x from one step to the next; the line's moves by less
    # than a tenth of that jump per step, and settles between the two
    assert all(abs(b - a) < 0.1 * 39400 for a, b in itertools.pairwise(rates))
    assert 1600.0 < rates[-1] < 41000.0


@pytest.mark.parametrize("make", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_verbose_wrappers_log_progress_and_quiet_ones_do_not(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for verbose in (False, True):
            model, _, opt = make(MemorySwarm(), verbose=verbose)
            for i in range(4):  # two epochs of either wrapper
                backward(model, batch(i))
                opt.step()
                opt.zero_grad()
            opt.close()
            lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
            if not verbose:
                assert lines == []
    assert opt.verbose
    assert len(lines) >= 1  # the first step logs; later ones at most every 10 s
    assert all(re.match(r"epoch \d+: \d+/\d+ samples \(\d+%\), swarm ", line) for line in lines)
    assert "samples/s from 1 peer, next step" in lines[0]


@pytest.mark.parametrize("make", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_report_metrics_takes_a_loss_straight_from_the_graph(make: Any) -> None:
    model, _, opt = make(MemorySwarm())
    x, y = batch(0)
    loss = torch.nn.functional.mse_loss(model(x), y)
    assert loss.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a graph tensor becomes a number
        opt.report_metrics(loss=loss)
    assert opt.tracker.metrics == (("loss", pytest.approx(loss.item())),)
    opt.close()


def test_a_trainer_far_from_its_target_says_why_no_global_step_happens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A target the swarm takes very long to reach (the HF snippet's 4096 with 2 peers)
    fails nothing; the trainer says how far the swarm is instead of staying silent."""
    from swarmavg.averaging.optim import CollaborativeOptimizer

    model = linear_model()
    opt = CollaborativeOptimizer(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        client=MemorySwarm().client("a"),
        run_id="run",
        target_batch_size=10**9,
        batch_size_per_step=4,
        stalled_after=0.05,
    )
    with caplog.at_level(logging.WARNING, logger="swarmavg.averaging.training.base"):
        for i in range(10_000):  # steps until the (configured) interval has passed
            backward(model, batch(i))
            opt.step()
            opt.zero_grad()
            if any("no global step" in r.getMessage() for r in caplog.records):
                break
    (line,) = [r.getMessage() for r in caplog.records if "no global step" in r.getMessage()]
    assert re.search(
        r"the swarm has \d+/1000000000 samples towards epoch 0 at [\d.]+ samples/s", line
    )
    assert "lower target_batch_size or add trainers" in line
    assert opt.epoch == 0
    opt.close()
