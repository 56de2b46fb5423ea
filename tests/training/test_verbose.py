"""``verbose=True`` on the wrappers: the epoch, the swarm's samples/s and the
time to the next step, through the library's logger, on a new epoch and otherwise at most
every few seconds."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import pytest

from swarmavg.averaging.training.verbose import ProgressLog, eta_text, progress_line
from tests.training.helpers import backward, batch
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


def test_a_line_on_each_new_epoch_and_otherwise_at_most_every_few_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    plog = ProgressLog(every=10.0, clock=lambda: now[0])
    figures = (8, 16, 4.0, 2, 2.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert plog.update(0, *figures)
        now[0] = 5.0
        assert not plog.update(0, *figures)  # same epoch, too soon
        assert plog.update(1, *figures)  # a new epoch always logs
        now[0] = 14.9
        assert not plog.update(1, *figures)
        now[0] = 15.0
        assert plog.update(1, *figures)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "epoch 0",
        "epoch 1",
        "epoch 1",
    ]
    with pytest.raises(ValueError, match="positive"):
        ProgressLog(every=0)


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
    assert len(lines) >= 2  # one per epoch at least
    assert all(re.match(r"epoch \d+: \d+/\d+ samples \(\d+%\), swarm ", line) for line in lines)
    assert "samples/s from 1 peer, next step" in lines[0]
    assert lines[-1].startswith(f"epoch {opt.epoch}:")  # the newest epoch is logged
