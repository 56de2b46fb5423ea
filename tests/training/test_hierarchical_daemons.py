"""The hierarchical mode end to end: 2 "machines" x 2 local ranks on loopback.

Each machine is a real ``swarmavg peer`` daemon and two trainer processes
(tests/training/hier_worker.py) in one gloo group (a FileStore of its own); only each
group's rank 0 talks to its daemon. The tests that kill nothing share the daemons and
the four trainer processes, each test running its own scenario (run id, gloo groups,
records) on them. The tests check what a user of a DDP job expects:
every rank ends with the same parameters, equal to the swarm's step on the mean of all
four ranks' contributions weighted by their samples; the swarm sees one process per
machine; and a leader that vanishes makes its follower fail, not hang.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from tests.harness import ProcessPool, SwarmavgProcess  # noqa: E402
from tests.training import hier_machines  # noqa: E402
from tests.training.hier_worker import LR, backward, fixed_batch, make_model  # noqa: E402

pytestmark = pytest.mark.integration
RUN = "hier-test"
BATCHES = {(0, 0): 2, (0, 1): 4, (1, 0): 6, (1, 1): 8}
"""Samples per step of each (machine, rank): unequal, so that the weights matter."""
_TEST_RUNS = itertools.count()


def start_daemons(pool: ProcessPool, n: int) -> list[SwarmavgProcess]:
    return hier_machines.start_daemons(pool, n, RUN)


def status_of(daemon: SwarmavgProcess) -> dict[str, Any]:
    from swarmavg.peer import connect

    with connect(daemon.control) as client:
        return client.status()


@dataclass(frozen=True)
class Machines:
    """The module's two daemons as one test sees them.

    Attributes:
        daemons: the daemons, shared by the tests of this module that kill none of them
            (starting two daemons costs more than most of these tests' training).
        ranks: the trainer ranks on them, shared likewise (starting four torch processes
            costs about ten times a scenario's training).
        run_id: the trainers' run id (their key prefix), this test's own, so that no
            progress record, round or state of an earlier test is seen.
        before: each daemon's status when the test began: the rounds it counts are
            differences from it.
    """

    daemons: list[SwarmavgProcess]
    ranks: hier_machines.ServedRanks
    run_id: str
    before: list[dict[str, Any]]

    def run(self, workdir: Path, timeout: float, **spec: Any) -> hier_machines.Records:
        """This test's scenario on the shared ranks (two per machine), in ``workdir``."""
        return self.ranks.run(
            workdir, timeout, run_id=self.run_id, batch_of=lambda m, r: BATCHES[(m, r)], **spec
        )

    def rounds(self, m: int, field: str) -> int:
        """Rounds of ``field`` (``rounds_done``, ``rounds_failed``) daemon ``m`` counted
        since the test began."""
        return int(status_of(self.daemons[m])[field]) - int(self.before[m][field])


@pytest.fixture(scope="module")
def shared_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SwarmavgProcess]]:
    with ProcessPool(tmp_path_factory.mktemp("hier-daemons")) as pool:
        yield start_daemons(pool, 2)


@pytest.fixture(scope="module")
def shared_ranks(
    shared_daemons: list[SwarmavgProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[hier_machines.ServedRanks]:
    ranks = hier_machines.ServedRanks(tmp_path_factory.mktemp("hier-ranks"), shared_daemons, 2)
    try:
        yield ranks
    finally:
        ranks.close()


@pytest.fixture
def machines(
    shared_daemons: list[SwarmavgProcess], shared_ranks: hier_machines.ServedRanks
) -> Machines:
    for daemon in shared_daemons:  # an earlier test must not have lost one
        assert daemon.proc.poll() is None, daemon.stderr()
    return Machines(
        shared_daemons,
        shared_ranks,
        f"{RUN}-{next(_TEST_RUNS)}",
        [status_of(daemon) for daemon in shared_daemons],
    )


def run_machines(
    workdir: Path,
    daemons: list[SwarmavgProcess],
    ranks: int,
    timeout: float,
    *,
    run_id: str = RUN,
    **spec: Any,
) -> hier_machines.Records:
    return hier_machines.run_machines(
        workdir,
        daemons,
        ranks,
        timeout,
        run_id=run_id,
        batch_of=lambda m, r: BATCHES[(m, r)],
        **spec,
    )


def expected_collaborative(records: dict[tuple[int, int], dict[str, Any]], epochs: int) -> Any:
    """SGD (no momentum) on the samples-weighted mean of all four ranks' accumulated
    gradients, epoch by epoch, from machine 0's leader's initial parameters."""
    model = make_model(0, 3)
    for epoch in range(epochs):
        total = 0.0
        summed = [torch.zeros_like(p) for p in model.parameters()]
        for (m, r), record in records.items():
            steps = record["steps_per_epoch"][epoch]
            samples = steps * BATCHES[(m, r)]
            model.zero_grad()
            backward(model, fixed_batch(10 * m + r, BATCHES[(m, r)], 3))
            for acc, p in zip(summed, model.parameters(), strict=True):
                assert p.grad is not None
                acc += p.grad * samples
            total += samples
        with torch.no_grad():
            for p, acc in zip(model.parameters(), summed, strict=True):
                p -= LR * acc / total
    return [p.detach() for p in model.parameters()]


def assert_one_machine_per_peer(
    records: dict[tuple[int, int], dict[str, Any]], machines: Machines, epochs: int
) -> None:
    for key, record in records.items():
        assert record.get("ok"), (key, record)
    for m, _ in enumerate(machines.daemons):
        leader = records[(m, 0)]
        # the swarm sees one progress record per machine, and each round two members
        assert leader["progress_processes"] == 2
        assert leader["group_sizes"] == [2] * epochs
        assert leader["failed"] == 0
        # the machine's bytes crossed its daemon once per round: one round per epoch
        assert machines.rounds(m, "rounds_done") == epochs
        assert machines.rounds(m, "rounds_failed") == 0


@pytest.mark.timeout(300)
def test_two_machines_of_two_ranks_average_gradients_once_per_machine(
    machines: Machines, tmp_path: Path
) -> None:
    epochs = 2
    records = machines.run(
        tmp_path,
        timeout=240,
        wrapper="collaborative",
        target=48,
        epochs=epochs,
    )
    assert_one_machine_per_peer(records, machines, epochs)
    for m in range(2):  # ranks of one machine step in lockstep
        assert records[(m, 0)]["steps_per_epoch"] == records[(m, 1)]["steps_per_epoch"]
    final = records[(0, 0)]["params"]
    for key, record in records.items():
        for a, b in zip(record["params"], final, strict=True):
            assert torch.equal(a, b), key
    for got, want in zip(final, expected_collaborative(records, epochs), strict=True):
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.timeout(300)
def test_two_machines_of_two_ranks_diloco_takes_the_weighted_mean_of_all_replicas(
    machines: Machines, tmp_path: Path
) -> None:
    local_steps = 3
    records = machines.run(
        tmp_path,
        timeout=240,
        wrapper="diloco",
        local_steps=local_steps,
        epochs=1,
    )
    assert_one_machine_per_peer(records, machines, 1)
    # With outer SGD at lr 1 the outer step lands on the mean of the replicas after H
    # inner steps, weighted by samples (H * batch per rank), all from the leader's start.
    total = 0.0
    summed: list[Any] = []
    for m, r in records:
        replica = make_model(0, 3)
        inner = torch.optim.SGD(replica.parameters(), lr=LR)
        data = fixed_batch(10 * m + r, BATCHES[(m, r)], 3)
        for _ in range(local_steps):
            backward(replica, data)
            inner.step()
            inner.zero_grad()
        weight = float(local_steps * BATCHES[(m, r)])
        params = [p.detach() * weight for p in replica.parameters()]
        summed = params if not summed else [a + b for a, b in zip(summed, params, strict=True)]
        total += weight
    final = records[(0, 0)]["params"]
    for key, record in records.items():
        for a, b in zip(record["params"], final, strict=True):
            assert torch.equal(a, b), key
    for got, want in zip(final, [s / total for s in summed], strict=True):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.timeout(180)
def test_a_vanished_leader_makes_its_follower_fail_instead_of_hanging(
    swarmavg_processes: ProcessPool, tmp_path: Path
) -> None:
    daemons = start_daemons(swarmavg_processes, 1)
    records = run_machines(
        tmp_path,
        daemons,
        2,
        timeout=150,
        wrapper="collaborative",
        target=10_000,
        epochs=1,
        die_after={"00": 3},
        gloo_timeout=30,
        barrier=False,
    )
    assert records[(0, 0)]["returncode"] == 3
    follower = records[(0, 1)]
    assert follower["returncode"] == 0, follower["stderr"]
    assert follower["ok"] is False
    assert follower["error"] == "LocalGroupError", follower


@pytest.mark.timeout(300)
def test_a_failure_of_the_leaders_round_reaches_every_rank_the_same_way(
    machines: Machines, tmp_path: Path
) -> None:
    """Machine 0's follower feeds NaN gradients: its leader's round refuses them (an
    error, re-raised there) and its follower raises the same failure as LocalGroupError.
    Machine 1 then has no partner: its round fails and both its ranks step locally, each
    with the leader's SwarmRoundWarning, and end identical."""
    records = machines.run(
        tmp_path,
        timeout=240,
        wrapper="collaborative",
        target=48,
        epochs=1,
        nan_grad={"01": True},
        # Machine 1 waits for machine 0 (whose record lingers) twice, both by deadline:
        # for its samples (max_wait), then in matchmaking. Neither wait is what this test
        # checks, so both are short; the failure's way to every rank is unchanged.
        max_wait=1.0,
        averaging_timeout=5.0,
    )
    leader, follower = records[(0, 0)], records[(0, 1)]
    assert leader["ok"] is False, leader
    assert follower["ok"] is False, follower
    assert follower["error"] == "LocalGroupError"
    assert leader["error"] in follower["message"]
    assert leader["message"] in follower["message"]
    others = records[(1, 0)], records[(1, 1)]
    for record in others:
        assert record["ok"], record
        assert record["epoch"] == 1
        assert any("SwarmRoundWarning" in w and "failed" in w for w in record["warnings"])
    assert any("(local leader)" in w for w in others[1]["warnings"])
    for a, b in zip(others[0]["params"], others[1]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(300)
def test_two_machines_of_two_ranks_powersgd_compresses_each_machines_gradient_once(
    machines: Machines, tmp_path: Path
) -> None:
    from swarmavg.averaging.training.powersgd import PowerSGDState, orthogonalize

    records = machines.run(
        tmp_path,
        timeout=240,
        wrapper="powersgd",
        target=48,
        epochs=1,
    )
    for key, record in records.items():
        assert record.get("ok"), (key, record)
    for m in range(2):
        leader, follower = records[(m, 0)], records[(m, 1)]
        assert leader["progress_processes"] == 2
        assert leader["group_sizes"] == [2, 2]  # the P round and the Q round
        # the follower holds its machine's error feedback and the swarm's Q
        assert follower["residual"] == leader["residual"]
        assert follower["q"] == records[(0, 0)]["q"]
    assert records[(0, 0)]["residual"] != records[(1, 0)]["residual"]  # each machine's own
    for m in range(2):
        assert machines.rounds(m, "rounds_done") == 2  # the step's rounds (P, Q), once each
        assert machines.rounds(m, "rounds_failed") == 0
    final = records[(0, 0)]["params"]
    for key, record in records.items():
        for a, b in zip(record["params"], final, strict=True):
            assert torch.equal(a, b), key
    # The swarm's step: rank-1 factors of the samples-weighted mean of all four ranks'
    # gradients (PowerSGD is linear in the gradient up to the orthogonalisation).
    model = make_model(0, 3)
    state = PowerSGDState([tuple(p.shape) for p in model.parameters()], rank=1)
    assert state.compressed == [0]  # the 2x3 weight; the bias travels whole
    total = 0.0
    summed = [torch.zeros_like(p) for p in model.parameters()]
    for (m, r), record in records.items():
        samples = record["steps_per_epoch"][0] * BATCHES[(m, r)]
        model.zero_grad()
        backward(model, fixed_batch(10 * m + r, BATCHES[(m, r)], 3))
        for acc, p in zip(summed, model.parameters(), strict=True):
            assert p.grad is not None
            acc += p.grad * samples
        total += samples
    mean = [(s / total).numpy() for s in summed]
    p_hat = orthogonalize(mean[0] @ state.q[0])
    update = [p_hat @ (mean[0].T @ p_hat).T, mean[1]]
    params = list(model.parameters())
    want = [p.detach() - LR * torch.from_numpy(u) for p, u in zip(params, update, strict=True)]
    for got, expected in zip(final, want, strict=True):
        assert torch.allclose(got, expected.float(), atol=1e-5)


@pytest.mark.timeout(300)
def test_two_machines_of_two_ranks_with_delayed_updates_land_each_round_on_every_rank(
    machines: Machines, tmp_path: Path
) -> None:
    """``delay_updates=True``: each leader's round runs in the background while its ranks
    train on, and lands on both ranks at the same later step. The loss is linear in the
    parameters, so the result does not depend on when a round landed: the initial
    parameters minus LR times every epoch's samples-weighted mean gradient."""
    from tests.training.hier_worker import linear_backward

    epochs = 2
    records = machines.run(
        tmp_path,
        timeout=240,
        wrapper="collaborative",
        target=48,
        epochs=epochs,
        delay_updates=True,
        linear_loss=True,
    )
    assert_one_machine_per_peer(records, machines, epochs)
    final = records[(0, 0)]["params"]
    for key, record in records.items():
        for a, b in zip(record["params"], final, strict=True):
            assert torch.equal(a, b), key
    model = make_model(0, 3)
    want = [p.detach().clone() for p in model.parameters()]
    for epoch in range(epochs):
        total = 0.0
        summed = [torch.zeros_like(p) for p in want]
        for (m, r), record in records.items():
            samples = record["steps_per_epoch"][epoch] * BATCHES[(m, r)]
            model.zero_grad()
            linear_backward(model, fixed_batch(10 * m + r, BATCHES[(m, r)], 3))
            for acc, p in zip(summed, model.parameters(), strict=True):
                assert p.grad is not None
                acc += p.grad * samples
            total += samples
        want = [w - LR * s / total for w, s in zip(want, summed, strict=True)]
    for got, expected in zip(final, want, strict=True):
        assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.equal(final[0], next(make_model(0, 3).parameters()).detach())


@pytest.mark.timeout(300)
def test_two_machines_of_two_ranks_streaming_diloco_syncs_each_fragment_once_per_machine(
    machines: Machines, tmp_path: Path
) -> None:
    """``StreamingDiLoCo`` (2 fragments, H = 4, overlap 1): every sync starts from the
    machine's mean of the fragment, runs in the leader's background while both ranks
    train on, and lands on both one step later; every rank of both machines ends with the
    same anchor, and each rank keeps its own progress on top of it (no final round on
    close, which would average that progress away: test_one_swarm.py covers it)."""
    syncs = 4  # two of each fragment
    records = machines.run(
        tmp_path,
        timeout=240,
        wrapper="streaming",
        local_steps=4,
        epochs=syncs,
        final_round=False,
    )
    assert_one_machine_per_peer(records, machines, syncs)
    anchor = records[(0, 0)]["anchor"]
    for key, record in records.items():
        assert record["anchor"] == anchor, key
    initial = [p.detach().tolist() for p in make_model(0, 3).parameters()]
    assert anchor != initial
    # The first sync is of fragment 1 (the bias), after 2 inner steps of every rank from
    # the leader's start: its anchor is the samples-weighted mean of the four replicas'
    # biases then (outer SGD at lr 1), on every rank; the weight's anchor is untouched.
    total, summed = 0.0, torch.zeros(2)
    for m, r in records:
        replica = make_model(0, 3)
        inner = torch.optim.SGD(replica.parameters(), lr=LR)
        for _ in range(2):
            backward(replica, fixed_batch(10 * m + r, BATCHES[(m, r)], 3))
            inner.step()
            inner.zero_grad()
        summed += replica.bias.detach() * 2 * BATCHES[(m, r)]
        total += 2 * BATCHES[(m, r)]
    for key, record in records.items():
        weight, bias = record["anchors"][0]
        assert weight == initial[0], key
        assert torch.allclose(torch.tensor(bias), summed / total, atol=1e-6), key
    for m in range(2):  # the ranks trained on their own batches since the last syncs
        assert not all(
            torch.equal(a, b)
            for a, b in zip(records[(m, 0)]["params"], records[(m, 1)]["params"], strict=True)
        )
