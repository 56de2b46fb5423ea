"""One run id by default, and a trainer that trains alone says so: real ``swarmavg peer``
processes, one client each, trainers in the test's threads."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from swarmavg.peer import Client, connect  # noqa: E402
from swarmavg.peer.cli.peers_table import format_peers  # noqa: E402
from swarmavg.peer.cli.status import format_status  # noqa: E402
from tests.harness import ProcessPool  # noqa: E402
from tests.run_daemons import clients, start_run  # noqa: E402
from tests.training.helpers import (  # noqa: E402
    backward,
    batch,
    linear_model,
    run_in_threads,
    sgd_collaborative,
    train_until,
)

pytestmark = pytest.mark.integration
RUN = "run-ids"
TYPO = "run_ids"
BASE_LOGGER = "swarmavg.averaging.training.base"
__all__ = ["clients"]  # the fixture


def trainer(client: Client, run_id: str | None, **options: Any) -> tuple[Any, Any]:
    model = linear_model()
    opt = sgd_collaborative(
        model,
        client,
        run_id=run_id,
        target_batch_size=8,
        averaging_timeout=20.0,
        final_timeout=2.0,
        codec="none",
        **options,
    )
    return model, opt


@pytest.mark.timeout(120)
def test_trainers_without_a_run_id_take_their_daemons_and_train_together(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    ca, cb = (
        clients.enter_context(connect(d.control)) for d in start_run(swarmavg_processes, RUN, 2)
    )
    (ma, a), (mb, b) = trainer(ca, None), trainer(cb, None)
    assert a.link.run_id == b.link.run_id == RUN
    run_in_threads(lambda: train_until(ma, a, 10, 2), lambda: train_until(mb, b, 20, 2))
    assert a.stats.group_sizes == b.stats.group_sizes == [2, 2]
    a.close()
    b.close()


@pytest.mark.timeout(120)
def test_a_trainer_of_another_run_says_it_is_alone_and_names_the_runs_it_sees(
    swarmavg_processes: ProcessPool, clients: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    ca, cb = (
        clients.enter_context(connect(d.control)) for d in start_run(swarmavg_processes, RUN, 2)
    )
    # one trainer takes the daemons' run, the other was given a mistyped one
    (ma, a), (mb, b) = trainer(ca, None, alone_after=1.0), trainer(cb, TYPO, alone_after=1.0)
    with caplog.at_level(logging.WARNING, logger=BASE_LOGGER):
        for i in range(5000):  # each steps alone (no round), so a step is quick
            for model, opt in ((ma, a), (mb, b)):
                backward(model, batch(i))
                opt.step()
                opt.zero_grad()
            if sum("trains alone" in r.getMessage() for r in caplog.records) >= 2:
                break
    warnings = [r.getMessage() for r in caplog.records if "trains alone" in r.getMessage()]
    typo = next(w for w in warnings if w.startswith(f"run {TYPO!r}"))
    assert "no other trainer of this run seen for" in typo
    assert f"the daemons' run {RUN!r}: {RUN!r} (1 trainer)" in typo
    assert "run_id=None takes the daemon's" in typo
    assert any(w.startswith(f"run {RUN!r}") and f"{TYPO!r} (1 trainer)" in w for w in warnings)
    assert len(warnings) == 2  # once each, however long they keep stepping alone

    # swarmavg peers lists both training runs; swarmavg status says which trainer is alone
    view = ca.peers()
    runs = {r["run"]: (r["trainers"], r["alone"]) for r in view["training_runs"]}
    assert runs == {RUN: (1, 1), TYPO: (1, 1)}
    assert f"training runs: '{RUN}' (collaborative): 1 trainer, 1 alone" in format_peers(view)
    status = cb.status()
    assert [t["run"] for t in status["trainers"]] == [TYPO]
    assert status["trainers"][0]["alone"] > 0
    assert f"run {TYPO!r} (collaborative), alone for" in format_status(status)
    a.close()
    b.close()
