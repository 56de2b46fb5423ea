"""A Byzantine trainer against robust aggregation (issue 17's training test).

Four trainers on scikit-learn's digits (the setup of ``benchmarks/training.py``: 64-32-10
MLP, one shard each, global batch 128), each behind its own ``swarmavg peer`` process.
One of them multiplies its gradients by -10 before each step. With ``aggregation="mean"``
the swarm follows it uphill and accuracy collapses; with ``"centered-clip"`` (its default
``reject=3``: copies beyond 3 median distances from the median get no weight) the honest
trainers end within 1 point of a run without the attacker, as issue 17 asks. Clipping
alone (``reject=0``) left them 3-4 points below: a clipped attacker still pulls the
estimate by about the clip radius over the honest members at every step. The training
code and the full-size run, with the trimmed mean too, are ``benchmarks/byzantine.py``
(docs/benchmarks.md, "Byzantine training, session 10").
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from benchmarks.byzantine import ATTACKER, TRAINERS, train  # noqa: E402
from swarmavg.peer import connect  # noqa: E402
from tests.harness import ProcessPool, SwarmavgProcess  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
RUN = "byzantine-test"
STEPS = 45
"""Global steps (5 passes over the train set)."""
CLIP_MARGIN = 1.0
"""Points of test accuracy the attacked centered-clip run may lose against the clean run
(issue 17's bound; measured 0.0 and 0.37 at 45 steps through daemons, 0.1-0.6 over three
data orders in the simulation without daemons, docs/benchmarks.md)."""


def start_daemons(pool: ProcessPool) -> list[SwarmavgProcess]:
    def args(i: int, join: list[str]) -> list[str]:
        control = str(pool.workdir / f"p{i}.sock")
        return ["peer", "--listen", "127.0.0.1:0", *join, "--control", control, "--run-id", RUN]

    first = pool.start(args(0, []))
    return [first, *(pool.start(args(i, ["--join", first.address])) for i in range(1, TRAINERS))]


def test_centered_clip_resists_a_trainer_that_sends_minus_ten_times_its_gradients(
    swarmavg_processes: ProcessPool,
) -> None:
    daemons = start_daemons(swarmavg_processes)
    with ExitStack() as stack:
        clients = [stack.enter_context(connect(d.control)) for d in daemons]
        clean = train(clients, "clean", "mean", False, STEPS)
        dragged = train(clients, "attacked-mean", "mean", True, STEPS)
        clipped = train(clients, "attacked-clip", "centered-clip", True, STEPS)
    honest = [i for i in range(TRAINERS) if i != ATTACKER]
    for run in (clean, dragged, clipped):
        assert all(failed == 0 for _, failed in run), run
    reference = min(clean[i][0] for i in honest)
    assert reference > 85.0, clean  # the clean run learned
    assert all(dragged[i][0] < 50.0 for i in honest), dragged  # the mean followed the attacker
    assert all(clipped[i][0] >= reference - CLIP_MARGIN for i in honest), (clipped, clean)
