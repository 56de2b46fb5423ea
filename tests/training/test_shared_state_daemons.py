"""One shared state with real ``swarmavg peer`` processes: members that differ from the
group's majority repair from its holders; a trainer restarted from an old checkpoint ends
identical to the others (docs/training.md, "One shared state")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo, SwarmRoundWarning  # noqa: E402
from swarmavg.peer import Client  # noqa: E402
from tests.harness import ProcessPool  # noqa: E402
from tests.training.helpers import (  # noqa: E402
    backward,
    batch,
    linear_model,
    run_in_threads,
    sgd_collaborative,
    train_until,
)
from tests.training.test_collaborative_daemons import (  # noqa: E402
    RUN,
    open_client,
    start_daemons,
)

pytestmark = pytest.mark.integration
LR = 0.1
BATCH = 4

Trainer = tuple[torch.nn.Module, CollaborativeOptimizer]


@pytest.fixture
def clients() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def make_trainer(client: Client, peers: int, **kwargs: object) -> Trainer:
    model = linear_model()
    options: dict[str, object] = {"averaging_timeout": 30.0, "codec": "none", **kwargs}
    opt = sgd_collaborative(
        model,
        client,
        run_id=RUN,
        target_batch_size=BATCH * peers,  # one batch of every trainer per epoch
        batch_size_per_step=BATCH,
        lr=LR,
        **options,
    )
    return model, opt


def train_all(trainers: list[Trainer], epoch: int) -> None:
    run_in_threads(
        *(
            lambda m=m, o=o, i=i: train_until(m, o, 100 * i, epoch)
            for i, (m, o) in enumerate(trainers)
        ),
        timeout=100,
    )


def perturb(model: torch.nn.Module, amount: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


def assert_one_state(trainers: list[Trainer]) -> None:
    (model, opt), *others = trainers
    for other_model, other_opt in others:
        for p, q in zip(model.parameters(), other_model.parameters(), strict=True):
            assert torch.equal(p, q)
        mine, theirs = (
            opt.optimizer.state_dict()["state"],
            other_opt.optimizer.state_dict()["state"],
        )
        for index in mine:
            assert torch.equal(mine[index]["momentum_buffer"], theirs[index]["momentum_buffer"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "offsets",
    [
        pytest.param([0.0, 0.0, 0.5], id="one-off"),
        pytest.param([0.0, 0.0, 0.0, 0.5, -0.25], id="two-off-of-five"),
        pytest.param([0.0, 0.0, 0.5, 0.5], id="tie"),
    ],
)
def test_members_off_the_majority_repair_within_one_round(
    swarmavg_processes: ProcessPool, clients: ExitStack, offsets: list[float]
) -> None:
    n = len(offsets)
    daemons = start_daemons(swarmavg_processes, n)
    trainers = [make_trainer(open_client(clients, d), n) for d in daemons]
    train_all(trainers, 1)
    assert_one_state(trainers)
    for (model, _), amount in zip(trainers, offsets, strict=True):
        if amount:
            perturb(model, amount)
    train_all(trainers, 2)  # the round of epoch 1 finds and repairs them
    assert_one_state(trainers)
    repaired = [o.stats.repairs for _, o in trainers]
    if len(set(offsets)) == 2 and offsets.count(0.0) == offsets.count(0.5):  # the tie
        assert sorted(repaired) == [0, 0, 1, 1]
    else:
        assert repaired == [int(bool(a)) for a in offsets]
    for _, o in trainers:
        assert (o.stats.failed, o.stats.repair_failures) == (0, 0)
        assert o.stats.served == (1 - o.stats.repairs)  # every holder published for them
        assert o.stats.group_sizes == [n, n]
    train_all(trainers, 3)
    assert_one_state(trainers)
    for _, o in trainers:
        o.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("publish_state_every", [1, 0], ids=["catch-up", "repair"])
def test_a_trainer_restarted_from_an_old_checkpoint_ends_identical(
    swarmavg_processes: ProcessPool, clients: ExitStack, publish_state_every: int
) -> None:
    """publish_state_every=1: it loads the newest state when it rejoins. 0: nobody
    publishes, it rejoins with its old parameters, and the first round repairs it."""
    daemons = start_daemons(swarmavg_processes, 3)
    options = {"publish_state_every": publish_state_every}
    trainers = [make_trainer(open_client(clients, d), 3, **options) for d in daemons]
    train_all(trainers, 1)
    model_c, opt_c = trainers[2]
    checkpoint = ({k: v.clone() for k, v in model_c.state_dict().items()}, opt_c.state_dict())
    train_all(trainers, 3)
    opt_c.close()  # the trainer dies ...
    train_all(trainers[:2], 4)  # ... the others go on without it
    # ... and restarts from its checkpoint of epoch 1 on the same daemon
    model = linear_model(seed=5)
    model.load_state_dict(checkpoint[0])
    client = open_client(clients, daemons[2])
    opt = CollaborativeOptimizer(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        client=client,
        run_id=RUN,
        target_batch_size=BATCH * 3,
        batch_size_per_step=BATCH,
        max_wait=10.0,
        averaging_timeout=30.0,
        codec="none",
        load_state_on_start=False,
        publish_state_every=publish_state_every,
    )
    opt.load_state_dict(checkpoint[1])
    assert opt.epoch == 1
    backward(model, batch(7))
    if publish_state_every:
        opt.step()  # behind: it loads the swarm's state
    else:
        with pytest.warns(SwarmRoundWarning, match="no state could be loaded"):
            opt.step()  # behind, nothing published: it goes on with its old parameters
    assert opt.epoch == 4
    opt.zero_grad()
    trainers[2] = (model, opt)
    train_all(trainers, 5)
    assert_one_state(trainers)
    assert opt.stats.repairs == (0 if publish_state_every else 1)
    train_all(trainers, 6)
    assert_one_state(trainers)
    for _, o in trainers:
        o.close()


@pytest.mark.timeout(120)
def test_diloco_member_off_repairs_across_daemons(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 3)
    trainers: list[tuple[torch.nn.Module, DiLoCo]] = []
    for d in daemons:
        model = linear_model()
        opt = DiLoCo(
            model.parameters(),
            torch.optim.SGD(model.parameters(), lr=LR),
            client=open_client(clients, d),
            run_id=RUN,
            local_steps=2,
            batch_size_per_step=BATCH,
            codec="none",
            averaging_timeout=30.0,
        )
        trainers.append((model, opt))

    def train_diloco(epoch: int) -> None:
        run_in_threads(
            *(
                lambda m=m, o=o, i=i: train_until(m, o, 100 * i, epoch)
                for i, (m, o) in enumerate(trainers)
            ),
            timeout=100,
        )

    train_diloco(1)
    with torch.no_grad():
        for a in trainers[2][1].anchor:
            a.add_(0.5)  # c's synchronised parameters drifted
    train_diloco(2)
    for _, o in trainers:
        for x, y in zip(trainers[0][1].anchor, o.anchor, strict=True):
            assert torch.equal(x, y)
    for p, q in zip(trainers[0][0].parameters(), trainers[2][0].parameters(), strict=True):
        assert torch.equal(p, q)
    assert [o.stats.repairs for _, o in trainers] == [0, 0, 1]
    assert [o.stats.served for _, o in trainers] == [1, 1, 0]
    assert all(o.stats.group_sizes == [3, 3] for _, o in trainers)
