"""Remote input never crashes training, with real ``swarmavg peer`` processes: a peer that
trains another model under the same run, and more forged progress records than a group
holds."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.group import MAX_GROUP_SIZE  # noqa: E402
from swarmavg.averaging.optim import CollaborativeOptimizer, SwarmRoundWarning  # noqa: E402
from swarmavg.peer import Client, ValidationError  # noqa: E402
from tests.harness import ProcessPool  # noqa: E402
from tests.training.helpers import batch, run_in_threads  # noqa: E402
from tests.training.test_collaborative_daemons import RUN, open_client, start_daemons  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture
def clients() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def trainer(
    client: Client, outputs: int = 2, **kwargs: object
) -> tuple[torch.nn.Module, CollaborativeOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, outputs)
    options: dict[str, object] = {"max_wait": 10.0, "averaging_timeout": 4.0, "codec": "none"}
    options.update(kwargs)
    opt = CollaborativeOptimizer(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        client=client,
        run_id=RUN,
        target_batch_size=8,
        batch_size_per_step=4,
        **options,  # type: ignore[arg-type]
    )
    return model, opt


def train(model: torch.nn.Module, opt: CollaborativeOptimizer, seed: int, epoch: int) -> None:
    for _ in range(20):
        if opt.epoch >= epoch:
            return
        x, _ = batch(seed + opt.epoch)
        torch.nn.functional.mse_loss(model(x), torch.zeros(len(x), model.out_features)).backward()
        opt.step()
        opt.zero_grad()
    raise AssertionError(f"epoch {epoch} not reached (at {opt.epoch})")


@pytest.mark.timeout(120)
def test_a_peer_training_another_model_fails_rounds_but_never_the_step(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    (ma, a), (mb, b) = (
        trainer(open_client(clients, daemons[0]), outputs=2),
        trainer(open_client(clients, daemons[1]), outputs=3),  # another layout, same run
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SwarmRoundWarning)
        run_in_threads(lambda: train(ma, a, 1, 2), lambda: train(mb, b, 2, 2), timeout=100)
    assert a.epoch >= 2
    assert b.epoch >= 2
    assert a.stats.failed >= 1
    assert b.stats.failed >= 1
    assert a.stats.group_sizes == b.stats.group_sizes == []
    assert any(issubclass(w.category, SwarmRoundWarning) for w in caught)
    errors = a.stats.last_error + b.stats.last_error
    assert "SchemaMismatchError" in errors or "NoGroupError" in errors, errors


@pytest.mark.timeout(120)
def test_forged_progress_records_beyond_a_group_do_not_stop_two_real_peers(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    daemons = start_daemons(swarmavg_processes, 2)
    ca = open_client(clients, daemons[0])
    # The leader waits for the peers it expects until matchmaking_time (5 s), well before
    # the round gives up (half of the timeout), then closes with the two that came.
    (ma, a), (mb, b) = (
        trainer(c, averaging_timeout=30.0) for c in (ca, open_client(clients, daemons[1]))
    )
    record = {"epoch": 0, "samples": 0, "sps": 1.0, "time": time.time()}
    # Progress records are owner-signed (averaging/protocol_keys.py): one daemon cannot
    # write records that name other peers, so the forgery is refused where it is made.
    # (The clamp to MAX_GROUP_SIZE for records that got in anyway is tested in memory.)
    for i in range(MAX_GROUP_SIZE + 1):  # forged peers at the current epoch
        with pytest.raises(ValidationError):
            ca.dht.store(f"{RUN}.progress", {**record, "peer": f"{i:040x}"}, subkey=f"f.{i}")
    assert a.tracker.refresh().num_peers == 2
    run_in_threads(lambda: train(ma, a, 1, 1), lambda: train(mb, b, 2, 1), timeout=100)
    assert (a.epoch, b.epoch) == (1, 1)
    assert a.stats.group_sizes == b.stats.group_sizes == [2]  # the forgers never came
    for p, q in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(p, q)
