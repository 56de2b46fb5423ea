"""One shared state, against the in-memory swarm: members that differ from the group's
majority repair themselves, and the holders serve them (docs/training.md).

The same scenarios with real daemons are in ``test_shared_state_daemons.py``.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo, SwarmRoundWarning  # noqa: E402
from swarmavg.averaging.training.consensus import Provenance  # noqa: E402
from swarmavg.peer.client.errors import NoGroupError  # noqa: E402
from tests.training.helpers import (  # noqa: E402
    linear_model,
    run_in_threads,
    sgd_collaborative,
    train_until,
)
from tests.training.memswarm import MemorySwarm, Result  # noqa: E402

LR = 0.1


def make_peer(
    swarm: MemorySwarm, name: str, run_id: str = "run", **kwargs: object
) -> tuple[torch.nn.Module, CollaborativeOptimizer]:
    model = linear_model()
    options: dict[str, object] = {"averaging_timeout": 10.0, **kwargs}
    opt = sgd_collaborative(
        model, swarm.client(name), run_id=run_id, target_batch_size=4 * 3, lr=LR, **options
    )
    return model, opt


def perturb(model: torch.nn.Module, amount: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


def assert_identical(models: list[torch.nn.Module]) -> None:
    first = list(models[0].parameters())
    for other in models[1:]:
        for p, q in zip(first, other.parameters(), strict=True):
            assert torch.equal(p, q)


def momentum(opt: CollaborativeOptimizer) -> list[torch.Tensor]:
    return [s["momentum_buffer"] for s in opt.optimizer.state_dict()["state"].values()]


def train_all(peers: list[tuple[torch.nn.Module, CollaborativeOptimizer]], epoch: int) -> None:
    run_in_threads(
        *(lambda m=m, o=o, i=i: train_until(m, o, 100 * i, epoch) for i, (m, o) in enumerate(peers))
    )


@pytest.mark.parametrize("delay_updates", [False, True])
def test_one_member_off_repairs_from_the_holders(delay_updates: bool) -> None:
    swarm = MemorySwarm()
    # The repair is what makes c one with a and b again, so the final round is left out:
    # it could average a difference away, and, closed one after another with delayed
    # updates, a and b would each wait out its final_timeout for the ones still open.
    peers = [make_peer(swarm, n, delay_updates=delay_updates, final_round=False) for n in "abc"]
    train_all(peers, 2)
    for _, o in peers:
        o._apply_pending(block=True)  # delayed rounds: let every update land first
    perturb(peers[2][0], 0.5)  # c drifts (a local step, a partial round, ...)
    train_all(peers, 4)
    for _, o in peers:
        o.close()
    assert_identical([m for m, _ in peers])
    for a, b in zip(momentum(peers[0][1]), momentum(peers[2][1]), strict=True):
        assert torch.equal(a, b)
    c = peers[2][1].stats
    assert c.diverged >= 1
    assert all(o.stats.diverged == 0 for _, o in peers[:2])
    if c.repair_failures:
        # a and b stepped on without c before its download came (they may group without
        # it); the repair ended at once instead of waiting out state_timeout, and a later
        # round (repair or catch-up) made c one with them again
        assert "moved on" in c.last_repair_error
        return
    assert (c.diverged, c.repairs, c.repair_failures) == (1, 1, 0)
    assert c.repair_seconds > 0
    assert [o.stats.served for _, o in peers] == [1, 1, 0]


def repair_to_epoch_1(opt: CollaborativeOptimizer) -> tuple[object, str, int]:
    """``opt``'s repair to a state of epoch 1 (a provenance nobody published): the state,
    why it failed, and how many downloads it made."""
    downloads = 0
    load = opt.link.client.load_state

    def counted(timeout: float = 60.0) -> object:
        nonlocal downloads
        downloads += 1
        return load(timeout)

    opt.link.client.load_state = counted  # type: ignore[method-assign]
    state, why = opt.link.load_round_state(opt.KIND, opt.params, Provenance(1, b"\0" * 32, "g"))
    return state, why, downloads


def test_a_repair_ends_at_once_when_the_holders_moved_on() -> None:
    """The download gives the freshest state: once it is of a later epoch than the one
    repaired to, that state will not be served again, and the repair stops trying."""
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n, state_timeout=30.0) for n in "ab"]
    for _, o in peers:
        o.tracker.target_batch_size = 8
    train_all(peers, 2)  # type: ignore[arg-type]
    state, why, downloads = repair_to_epoch_1(peers[1][1])
    assert state is None
    assert "epoch 2" in why
    assert "moved on" in why
    assert downloads == 1  # no retry


def test_another_runs_state_on_the_same_daemons_is_neither_repair_nor_catch_up() -> None:
    """Daemons serve one state each, whichever training run published it last. A later
    epoch of another run must not end a repair as "the holders moved on" (the holders of
    this run have only not published yet), nor be loaded to catch up."""
    swarm = MemorySwarm()
    earlier = [make_peer(swarm, n, run_id="earlier") for n in "xy"]
    for _, o in earlier:
        o.tracker.target_batch_size = 8
    train_all(earlier, 3)
    _, opt = make_peer(swarm, "a", state_timeout=0.5)
    state, why, downloads = repair_to_epoch_1(opt)
    assert state is None
    assert "training run 'earlier'" in why
    assert downloads > 1  # retried until state_timeout
    assert opt.link.load(opt.KIND, opt.params) is None
    assert opt.link.stats.states_loaded == 0


def test_two_off_of_five_repair_and_a_tie_is_broken_the_same_everywhere() -> None:
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n) for n in "abcde"]
    for _, o in peers:
        o.tracker.target_batch_size = 4 * 5
    train_all(peers, 1)
    perturb(peers[3][0], 0.5)
    perturb(peers[4][0], -0.25)
    train_all(peers, 3)
    assert_identical([m for m, _ in peers])
    assert [o.stats.repairs for _, o in peers] == [0, 0, 0, 1, 1]
    assert [o.stats.served for _, o in peers] == [1, 1, 1, 0, 0]

    # a tie: two halves of four, each agreeing within itself
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n) for n in "abcd"]
    for _, o in peers:
        o.tracker.target_batch_size = 4 * 4
    train_all(peers, 1)
    perturb(peers[2][0], 0.5)
    perturb(peers[3][0], 0.5)
    train_all(peers, 3)
    assert_identical([m for m, _ in peers])
    repaired = [o.stats.repairs for _, o in peers]
    assert sorted(repaired) == [0, 0, 1, 1]
    assert repaired in ([0, 0, 1, 1], [1, 1, 0, 0])  # one half repairs, the other serves


def test_parameters_mode_a_member_off_is_replaced_by_the_round() -> None:
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n, average="parameters") for n in "abc"]
    train_all(peers, 2)
    # c restores a checkpoint of other parameters: its synchronised state is not theirs
    perturb(peers[2][0], 0.5)
    peers[2][1].load_state_dict(peers[2][1].state_dict())
    train_all(peers, 3)
    assert_identical([m for m, _ in peers])
    c = peers[2][1].stats
    assert (c.diverged, c.repairs, c.states_loaded) == (1, 1, 0)  # nothing downloaded


def make_diloco(swarm: MemorySwarm, name: str) -> tuple[torch.nn.Module, DiLoCo]:
    model = linear_model()
    opt = DiLoCo(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=LR),
        client=swarm.client(name),
        run_id="run",
        local_steps=2,
        batch_size_per_step=4,
        averaging_timeout=10.0,
    )
    return model, opt


def test_diloco_member_off_repairs_its_anchor_and_outer_state() -> None:
    swarm = MemorySwarm()
    peers = [make_diloco(swarm, n) for n in "abc"]
    train_all(peers, 1)  # type: ignore[arg-type]
    with torch.no_grad():
        for a in peers[2][1].anchor:
            a.add_(0.5)  # c's synchronised parameters drifted
    train_all(peers, 3)  # type: ignore[arg-type]
    for _, o in peers:
        for x, y in zip(peers[0][1].anchor, o.anchor, strict=True):
            assert torch.equal(x, y)
        outer = o.outer_optimizer.state_dict()["state"]
        first = peers[0][1].outer_optimizer.state_dict()["state"]
        for index in first:
            assert torch.equal(first[index]["momentum_buffer"], outer[index]["momentum_buffer"])
    assert_identical([m for m, _ in peers])
    assert [o.stats.repairs for _, o in peers] == [0, 0, 1]
    assert [o.stats.served for _, o in peers] == [1, 1, 0]


def test_a_repair_that_finds_no_matching_state_is_counted_and_training_goes_on() -> None:
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n, state_timeout=0.5) for n in "ab"]
    for _, o in peers:
        o.tracker.target_batch_size = 8

    def forged(caller: str, result: Result) -> Result:
        # a hostile leader tells "b" that two others agree on a state nobody holds
        if caller != "b":
            return result
        digests = dict(result.state_digests, x=b"\x00" * 32, y=b"\x00" * 32)
        return dataclasses.replace(result, state_digests=digests)

    swarm.forge = forged
    train_all(peers, 2)  # type: ignore[arg-type]
    b = peers[1][1].stats
    assert b.diverged == 2
    assert b.repair_failures == 2
    assert b.repairs == 0
    assert "provenance" in b.last_repair_error or "NoStateError" in b.last_repair_error
    assert peers[1][1].epoch == 2  # it stepped with the round's result each time
    assert_identical([m for m, _ in peers])  # ... which is what "a" stepped with too


@pytest.mark.parametrize("fault", ["partial", "failed"])
def test_after_a_partial_or_failed_round_the_next_round_makes_them_one_again(fault: str) -> None:
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n) for n in "abc"]

    def faulty(caller: str, result: Result) -> Result:
        if caller != "c" or result.group_id != b"run.grads.1".hex():
            return result
        if fault == "failed":  # c's daemon lost the round after the others finished it
            raise NoGroupError("injected: c's round failed")
        # a reducer died mid-round: c kept its own values for that part
        tensors = [t + 0.25 for t in result.tensors]
        return dataclasses.replace(result, tensors=tensors, partial=True)

    swarm.forge = faulty
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SwarmRoundWarning)  # c's local step, if it takes one
        train_all(peers, 2)
    train_all(peers, 3)
    assert_identical([m for m, _ in peers])
    c = peers[2][1].stats
    if fault == "partial":
        assert (c.partial, c.diverged, c.repairs) == (1, 1, 1)
    else:
        assert c.failed == 1
        assert c.repairs + c.states_loaded >= 1  # repaired, or caught up from their state


def test_a_delayed_round_that_lands_at_a_step_keeps_that_steps_gradient() -> None:
    """The background round of ``delay_updates`` lands at the start of a later ``step()``,
    after the caller's backward: applying it must not drop that step's gradient (its
    samples count toward the next round's weight)."""
    from tests.training.helpers import backward, batch

    swarm = MemorySwarm()
    # No final round: the peers close one after another at the end, and the first would
    # wait out its final_timeout for the other (nothing is checked after the close).
    peers = [make_peer(swarm, n, delay_updates=True, final_round=False) for n in "ab"]
    train_all(peers, 1)  # epoch 0's round runs in the background (a late joiner's did not)
    model, opt = next((m, o) for m, o in peers if o._pending is not None)
    pending = opt._pending
    assert pending is not None
    pending.future.result(timeout=10)  # finished, not applied yet
    backward(model, batch(7))
    want = [p.grad.detach().clone() * 4 for p in model.parameters() if p.grad is not None]
    opt.step()  # applies epoch 0's round, then accumulates this step
    assert opt._pending is None
    assert opt.epoch == 1
    assert opt._grads is not None
    for acc, expected in zip(opt._grads, want, strict=True):
        assert torch.allclose(acc, expected)
    for _, o in peers:
        o.close()
