"""A DiLoCo member that its sync's round closed without, against the in-memory swarm.

The late member comes to the first sync only after the others' round closed; its round
fails at once (``RoundClosedError``) while the others still hold their result, so the
swarm's epoch has not moved yet when it looks. It must wait for their step and take the
late-member path (their anchor), not step alone with its own pseudo-gradient. The
choreography is pinned by events on the late member's client (when it joins, when it
reads the progress records after failing) and on the others' results: nothing is timed.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import DiLoCo, StreamingDiLoCo  # noqa: E402
from swarmavg.averaging.training.pace import SwarmPace  # noqa: E402
from swarmavg.peer.client.errors import NoGroupError, RoundClosedError  # noqa: E402
from tests.training.helpers import backward, batch, linear_model, run_in_threads  # noqa: E402
from tests.training.memswarm import MemoryClient, MemorySwarm, Result  # noqa: E402
from tests.training.test_unequal_speed import Record  # noqa: E402

pytestmark = pytest.mark.timeout(90)

BATCH = 4
FIRST_SYNC = "run.diloco.0"


class LateClient:
    """The late member's client: joins the first sync only once the others' round closed,
    and says when it failed and when it next read the progress records."""

    def __init__(self, inner: MemoryClient, closed: threading.Event) -> None:
        self.inner = inner
        self.peer_id = inner.peer_id
        self.closed = closed
        self.failed = threading.Event()
        self.looked = threading.Event()
        self.dht = _WatchedDHT(self)

    def average(self, tensors: Any, key: str, **options: Any) -> Any:
        if key == FIRST_SYNC:
            assert self.closed.wait(60)
        try:
            return self.inner.average(tensors, key, **options)
        except NoGroupError:
            self.failed.set()
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _WatchedDHT:
    def __init__(self, client: LateClient) -> None:
        self.client = client

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: Any = None) -> bool:
        return self.client.inner.dht.store(key, value, ttl=ttl, subkey=subkey)

    def get(self, key: str) -> Any:
        value = self.client.inner.dht.get(key)
        if self.client.failed.is_set():
            self.client.looked.set()  # read while the others still hold their result
        return value


FAMILIES = {
    "fixed": (DiLoCo, {"local_steps": 3}),
    "pace": (DiLoCo, {"local_steps": 3, "pace": SwarmPace(target_samples=9 * BATCH)}),
    "streaming": (StreamingDiLoCo, {"local_steps": 6, "fragments": 2, "overlap_steps": 1}),
}


def trainer(client: Any, family: Any, timeout: float, **options: Any) -> tuple[Any, Any]:
    model = linear_model(0)
    opt = family(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.05),
        client,
        run_id="run",
        batch_size_per_step=BATCH,
        final_round=False,
        averaging_timeout=timeout,
        **options,
    )
    return model, opt


def wait_for_late(late_epoch: threading.Condition, late: Any, epoch: int) -> None:
    with late_epoch:
        assert late_epoch.wait_for(lambda: late.epoch >= epoch, 60), (late.epoch, epoch)


@pytest.mark.parametrize("mode", list(FAMILIES))
def test_a_member_left_out_of_a_sync_ends_it_with_the_others_anchor(mode: str) -> None:
    swarm = MemorySwarm()
    family, options = FAMILIES[mode]
    closed = threading.Event()
    late_client = LateClient(swarm.client("late"), closed)

    def hold_first_result(caller: str, result: Result) -> Result:
        # the others' round closed without the late member; they apply it only once it
        # failed and looked at the records (which then still say the first epoch)
        if result.group_id == FIRST_SYNC.encode().hex():
            closed.set()
            assert late_client.looked.wait(60)
        return result

    swarm.forge = hold_first_result
    trainers = {
        # the others close their round without the late member at their timeout
        "a": trainer(swarm.client("a"), family, 2.0, **options),
        "b": trainer(swarm.client("b"), family, 2.0, **options),
        # its own timeout bounds its wait for their step: long enough to see it
        "late": trainer(late_client, family, 30.0, **options),
    }
    record = Record()
    epochs = 3
    late_epoch = threading.Condition()

    def train(name: str) -> None:
        model, opt = trainers[name]
        with opt:
            while opt.epoch < epochs:
                if name == "late":
                    with late_epoch:
                        late_epoch.notify_all()
                else:
                    # the choreography pins only that the others do not run away: each
                    # epoch (and their exit, which withdraws their state) waits until the
                    # late member has reached it; their records already say it
                    wait_for_late(late_epoch, trainers["late"][1], opt.epoch)
                backward(model, batch(opt.epoch * 100 + len(name)))
                record.step(name, opt, 0.0)
            if name == "late":
                with late_epoch:
                    late_epoch.notify_all()
            else:
                wait_for_late(late_epoch, trainers["late"][1], epochs)

    run_in_threads(*[lambda n=n: train(n) for n in trainers], timeout=85)

    late = trainers["late"][1]
    assert late.stats.left_out == 1
    assert 2 in trainers["a"][1].stats.group_sizes  # the first sync went on without it
    # it ended the sync it missed with the others' anchor and outer state, and every
    # later one too
    for epoch in range(1, epochs + 1):
        held = record.digests[epoch]
        assert set(held) == {"a", "b", "late"}, (epoch, sorted(held))
        assert len(set(held.values())) == 1, epoch


def test_a_member_left_out_steps_alone_when_nobody_steps() -> None:
    """The round says it closed without this member, but nobody's step follows (the
    others stopped): after waiting one round's timeout it steps alone, as a failed round
    does, rather than hanging."""
    swarm = MemorySwarm()
    swarm.raise_for[FIRST_SYNC] = RoundClosedError("the round closed before this peer joined")
    model, opt = trainer(swarm.client("late"), DiLoCo, 0.2, local_steps=2)
    # a second member that reported once and then stopped: the round expects it
    _, gone = trainer(swarm.client("gone"), DiLoCo, 0.2, local_steps=2)
    anchor = [a.clone() for a in opt.anchor]
    with gone, opt:
        backward(model, batch(0))
        opt.step()
        opt.zero_grad()
        backward(model, batch(1))
        with pytest.warns(UserWarning, match="stepping with the local pseudo-gradient"):
            opt.step()  # the second inner step ends the round: its sync
    assert opt.epoch == 1
    assert opt.stats.left_out == 1
    assert gone.epoch == 0
    # its own pseudo-gradient moved the anchor
    assert any(not torch.equal(a, b) for a, b in zip(anchor, opt.anchor, strict=True))
