"""The wrappers' state machine against an in-memory swarm (fault seam; no daemon).

The same claims against real daemons live in ``test_collaborative_daemons.py``; here the
swarm is a test double so failures, stale epochs and missing state can be injected.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import (  # noqa: E402
    CollaborativeOptimizer,
    DiLoCo,
    SwarmRoundWarning,
)
from tests.training import helpers  # noqa: E402
from tests.training.helpers import (  # noqa: E402
    backward,
    batch,
    gradients,
    linear_model,
    run_in_threads,
    sgd_collaborative,
)
from tests.training.memswarm import MemorySwarm  # noqa: E402

LR = 0.1


def make_peer(
    swarm: MemorySwarm, name: str, **kwargs: object
) -> tuple[torch.nn.Module, CollaborativeOptimizer]:
    model = linear_model()
    options: dict[str, object] = {"averaging_timeout": 10.0, **kwargs}
    opt = sgd_collaborative(
        model, swarm.client(name), run_id="run", target_batch_size=8, lr=LR, **options
    )
    return model, opt


def train_until(
    model: torch.nn.Module, opt: CollaborativeOptimizer, seed: int, epoch: int, limit: int = 50
) -> None:
    helpers.train_until(model, opt, seed, epoch, limit)


def test_two_peers_step_with_the_mean_gradient() -> None:
    swarm = MemorySwarm()
    (ma, a), (mb, b) = make_peer(swarm, "a"), make_peer(swarm, "b")
    reference = linear_model()
    ga, gb = gradients(reference, batch(10)), gradients(reference, batch(20))
    run_in_threads(lambda: train_until(ma, a, 10, 1), lambda: train_until(mb, b, 20, 1))
    # one batch each, equal weights: one SGD step (no momentum yet) with the mean gradient
    assert [(c[0], c[1], c[2], c[3]) for c in sorted(swarm.calls)] == [
        ("a", "run.grads.0", 4.0, 2),
        ("b", "run.grads.0", 4.0, 2),
    ]
    for p0, pa, pb, g1, g2 in zip(
        reference.parameters(), ma.parameters(), mb.parameters(), ga, gb, strict=True
    ):
        expected = p0.detach() - LR * (g1 + g2) / 2
        assert torch.allclose(pa.detach(), expected, atol=1e-6)
        assert torch.equal(pa.detach(), pb.detach())
    assert a.epoch == b.epoch == 1
    a.close()
    assert b.tracker.refresh().num_peers == 1  # a left: nobody waits for it
    b.close()


def test_three_peers_stay_in_step_for_several_epochs() -> None:
    swarm = MemorySwarm()
    peers = [make_peer(swarm, name) for name in "abc"]
    run_in_threads(
        *(lambda m=m, o=o, i=i: train_until(m, o, 100 * i, 5) for i, (m, o) in enumerate(peers))
    )
    assert {o.epoch for _, o in peers} == {5}
    first = list(peers[0][0].parameters())
    for model, _ in peers[1:]:
        for p, q in zip(first, model.parameters(), strict=True):
            assert torch.equal(p, q)
    for e in range(5):
        members = [c for c in swarm.calls if c[1] == f"run.grads.{e}"]
        assert sorted(c[0] for c in members) == ["a", "b", "c"]


def test_failed_round_is_a_local_step_with_a_warning() -> None:
    swarm = MemorySwarm()
    model, opt = make_peer(swarm, "a", max_wait=0.0)
    # another peer's record: it has delivered half of the epoch, so the swarm is ready
    swarm.client("b").dht.store(
        "run.progress",
        {"peer": "b", "epoch": 0, "samples": 4, "sps": 1.0, "time": 0.0},
        subkey="b.1[owner:b]",
    )
    swarm.fail_keys.add("run.grads.0")
    reference = linear_model()
    g = gradients(reference, batch(1))
    backward(model, batch(1))
    with pytest.warns(SwarmRoundWarning, match="stepping with local values"):
        opt.step()
    assert opt.epoch == 1
    assert opt.stats.failed == 1
    for p0, p, gi in zip(reference.parameters(), model.parameters(), g, strict=True):
        assert torch.allclose(p.detach(), p0.detach() - LR * gi, atol=1e-6)


def test_a_round_the_others_finished_without_us_is_replaced_by_their_state() -> None:
    swarm = MemorySwarm()
    model, opt = make_peer(swarm, "a", max_wait=0.0)
    other = swarm.client("b")
    other.dht.store(
        "run.progress",
        {"peer": "b", "epoch": 0, "samples": 4, "sps": 1.0, "time": 0.0},
        subkey="b.1[owner:b]",
    )
    theirs = linear_model(seed=5)

    def others_step_without_a(key: str) -> None:
        # "b" averaged without "a", stepped, published its state and moved to epoch 1
        helper = CollaborativeOptimizer(
            theirs.parameters(),
            torch.optim.SGD(theirs.parameters(), lr=LR),
            client=other,
            run_id="run",
            target_batch_size=8,
            batch_size_per_step=4,
            load_state_on_start=False,
        )
        helper.tracker.set_epoch(1)
        helper._maybe_publish(1)
        helper.tracker.report()

    swarm.before_failure = others_step_without_a
    swarm.fail_keys.add("run.grads.0")
    backward(model, batch(1))
    opt.step()  # no warning: it neither stepped alone nor lost track
    assert opt.epoch == 1
    assert opt.stats.states_loaded == 1
    for p, q in zip(model.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q)


def test_late_joiner_and_laggard_load_the_newest_state() -> None:
    swarm = MemorySwarm()
    (ma, a), (mb, b) = make_peer(swarm, "a"), make_peer(swarm, "b")
    run_in_threads(lambda: train_until(ma, a, 1, 3), lambda: train_until(mb, b, 2, 3))
    torch.manual_seed(123)
    mc, c = make_peer(swarm, "c")  # a different init: it must take the swarm's
    assert c.epoch == 3
    for p, q in zip(ma.parameters(), mc.parameters(), strict=True):
        assert torch.equal(p, q)
    sa, sc = a.optimizer.state_dict()["state"], c.optimizer.state_dict()["state"]
    for index in sa:
        assert torch.equal(sa[index]["momentum_buffer"], sc[index]["momentum_buffer"])
    # a laggard: the swarm moves on without it (its record expired while it was away)
    del swarm.dht["run.progress"][c.tracker.subkey]
    run_in_threads(lambda: train_until(ma, a, 1, 5), lambda: train_until(mb, b, 2, 5))
    backward(mc, batch(7))
    c.step()
    assert c.epoch == 5
    assert swarm.calls[-1][0] != "c"  # it loaded state instead of averaging stale gradients
    for p, q in zip(ma.parameters(), mc.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_dict_round_trip() -> None:
    swarm = MemorySwarm()
    model, opt = make_peer(swarm, "a")
    for i in range(5):  # alone: every second step is a local global step
        backward(model, batch(i))
        opt.step()
        opt.zero_grad()
    assert opt.epoch == 2
    state = opt.state_dict()
    _, opt2 = make_peer(MemorySwarm(), "x")
    opt2.load_state_dict(state)
    assert (opt2.epoch, opt2.tracker.samples) == (2, 4)
    restored = opt2.state_dict()
    for acc, acc2 in zip(state["accumulators"], restored["accumulators"], strict=True):
        assert torch.equal(acc, acc2)
    for index, values in state["optimizer"]["state"].items():
        assert torch.equal(
            values["momentum_buffer"], restored["optimizer"]["state"][index]["momentum_buffer"]
        )
    with pytest.raises(ValueError, match="kind"):
        opt2.load_state_dict({"kind": "diloco"})


def test_parameters_mode_averages_locally_updated_parameters() -> None:
    swarm = MemorySwarm()
    (ma, a), (mb, b) = (make_peer(swarm, n, average="parameters") for n in "ab")
    reference = linear_model()
    ga, gb = gradients(reference, batch(10)), gradients(reference, batch(20))
    run_in_threads(lambda: train_until(ma, a, 10, 1), lambda: train_until(mb, b, 20, 1))
    for p0, pa, pb, g1, g2 in zip(
        reference.parameters(), ma.parameters(), mb.parameters(), ga, gb, strict=True
    ):
        # mean of (p0 - lr g1) and (p0 - lr g2)
        assert torch.allclose(pa.detach(), p0.detach() - LR * (g1 + g2) / 2, atol=1e-6)
        assert torch.equal(pa, pb)


def test_delayed_updates_apply_one_step_late() -> None:
    swarm = MemorySwarm()
    # No final round: a and b close one after another, so the first would wait out its
    # final_timeout for the other; and what is checked is the delayed updates' own result,
    # which the final round could average a difference away from.
    (ma, a), (mb, b) = (make_peer(swarm, n, delay_updates=True, final_round=False) for n in "ab")
    reference = linear_model()
    ga, gb = gradients(reference, batch(10)), gradients(reference, batch(20))
    run_in_threads(lambda: train_until(ma, a, 10, 1), lambda: train_until(mb, b, 20, 1))
    assert a.epoch == b.epoch == 1
    a.close()  # waits for the background round and applies it
    b.close()
    for p0, pa, pb, g1, g2 in zip(
        reference.parameters(), ma.parameters(), mb.parameters(), ga, gb, strict=True
    ):
        assert torch.allclose(pa.detach(), p0.detach() - LR * (g1 + g2) / 2, atol=1e-6)
        assert torch.equal(pa, pb)
    with pytest.raises(RuntimeError, match="closed"):
        a.step()


def test_delayed_updates_keep_training_in_step_over_epochs() -> None:
    swarm = MemorySwarm()
    # No final round: a and b close one after another, so the first would wait out its
    # final_timeout for the other; and what is checked is the delayed updates' own result,
    # which the final round could average a difference away from.
    peers = [make_peer(swarm, n, delay_updates=True, final_round=False) for n in "ab"]
    run_in_threads(
        *(lambda m=m, o=o, i=i: train_until(m, o, 50 * i, 4) for i, (m, o) in enumerate(peers))
    )
    for _, o in peers:
        o.close()
    for p, q in zip(peers[0][0].parameters(), peers[1][0].parameters(), strict=True):
        assert torch.equal(p, q)


def make_diloco(swarm: MemorySwarm, name: str, steps: int = 3) -> tuple[torch.nn.Module, DiLoCo]:
    model = linear_model()
    opt = DiLoCo(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=LR),
        client=swarm.client(name),
        run_id="run",
        local_steps=steps,
        batch_size_per_step=4,
        averaging_timeout=10.0,
    )
    return model, opt


def test_diloco_failed_round_is_a_local_outer_step_with_a_warning() -> None:
    swarm = MemorySwarm()
    model, opt = make_diloco(swarm, "a", steps=1)
    swarm.client("b").dht.store(
        "run.diloco.progress",
        {"peer": "b", "epoch": 0, "samples": 0, "sps": 1.0, "time": 0.0},
        subkey="b.1[owner:b]",
    )
    swarm.fail_keys.add("run.diloco.0")
    start = [p.detach().clone() for p in model.parameters()]
    g = gradients(linear_model(), batch(3))
    backward(model, batch(3))
    with pytest.warns(SwarmRoundWarning, match="local pseudo-gradient"):
        opt.step()
    assert opt.epoch == 1
    for p, p0, gi in zip(model.parameters(), start, g, strict=True):
        # one inner SGD step moved it by lr*g; the outer step applies 0.7 * 1.9 * that
        assert torch.allclose(p.detach(), p0 - 0.7 * 1.9 * LR * gi, atol=1e-6)


def test_diloco_outer_step_uses_the_mean_pseudo_gradient() -> None:
    swarm = MemorySwarm()
    (ma, a), (mb, b) = make_diloco(swarm, "a"), make_diloco(swarm, "b")

    def train(model: torch.nn.Module, opt: DiLoCo, seed: int) -> None:
        for i in range(3):
            backward(model, batch(seed + i))
            opt.step()
            opt.zero_grad()

    # what each replica's 3 inner SGD steps give, computed apart
    deltas = []
    for seed in (10, 20):
        replica = linear_model()
        inner = torch.optim.SGD(replica.parameters(), lr=LR)
        for i in range(3):
            backward(replica, batch(seed + i))
            inner.step()
            inner.zero_grad()
        deltas.append(
            [
                p0.detach() - p.detach()
                for p0, p in zip(linear_model().parameters(), replica.parameters(), strict=True)
            ]
        )
    run_in_threads(lambda: train(ma, a, 10), lambda: train(mb, b, 20))
    assert a.epoch == b.epoch == 1
    for p0, pa, pb, d1, d2 in zip(
        linear_model().parameters(), ma.parameters(), mb.parameters(), *deltas, strict=True
    ):
        # first Nesterov step: p = p0 - 0.7 * (1 + 0.9) * mean_delta
        expected = p0.detach() - 0.7 * 1.9 * (d1 + d2) / 2
        assert torch.allclose(pa.detach(), expected, atol=1e-5)
        assert torch.equal(pa, pb)

    mc, c = make_diloco(swarm, "c")  # late joiner: the synchronised parameters, epoch 1
    assert c.epoch == 1
    for p, q in zip(a.anchor, mc.parameters(), strict=True):
        assert torch.equal(p, q)
