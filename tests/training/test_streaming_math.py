"""Streaming DiLoCo's schedule, fragments and delayed update, by hand (no daemon)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.training.streaming import (  # noqa: E402
    StreamingDiLoCo,
    fragment_of_sync,
    fragment_outer_step,
    split_fragments,
)
from tests.training.memswarm import MemorySwarm  # noqa: E402


def test_each_fragment_syncs_where_the_paper_says_once_per_h_steps() -> None:
    h, f = 12, 4
    period = h // f
    syncs: dict[int, list[int]] = {i: [] for i in range(f)}
    for sync in range(3 * f):
        step = (sync + 1) * period  # sync `sync` starts after this inner step
        fragment = fragment_of_sync(sync, f)
        assert (step + fragment * h // f) % h == 0
        syncs[fragment].append(step)
    assert syncs == {3: [3, 15, 27], 2: [6, 18, 30], 1: [9, 21, 33], 0: [12, 24, 36]}


def test_fragments_are_contiguous_balanced_and_never_empty() -> None:
    assert split_fragments([10, 1, 10, 1, 10, 1, 10, 1], 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_fragments([100, 1, 1, 1], 4) == [[0], [1], [2], [3]]
    assert split_fragments([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="cannot make"):
        split_fragments([1, 2], 3)


def test_the_outer_step_of_one_fragment_leaves_the_others_and_their_gradients() -> None:
    params = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([5.0]))]
    anchor = [p.detach().clone() for p in params]
    outer = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    params[1].grad = torch.tensor([7.0])  # an inner gradient the outer step must not use
    with torch.no_grad():
        params[0].copy_(torch.tensor([0.0, 3.0]))
        params[1].copy_(torch.tensor([4.0]))
    fragment_outer_step(params, anchor, [0], [torch.tensor([1.0, -1.0])], outer)
    assert torch.equal(params[0].detach(), torch.tensor([0.5, 2.5]))  # anchor - 0.5 * delta
    assert torch.equal(anchor[0], params[0].detach())
    assert torch.equal(params[1].detach(), torch.tensor([4.0]))  # its local value, untouched
    assert torch.equal(anchor[1], torch.tensor([5.0]))
    assert torch.equal(params[1].grad, torch.tensor([7.0]))
    assert params[1] not in outer.state or "momentum_buffer" not in outer.state[params[1]]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False))


def test_a_sync_is_applied_overlap_steps_later_and_keeps_the_steps_taken_meanwhile() -> None:
    # One member alone (its round is local): H = 4, F = 2, overlap 1, inner SGD lr 0.1 on
    # a constant gradient g, outer SGD lr 1 (no momentum).
    model = _model()
    grads = [torch.ones(2, 2), torch.full((1, 2), 2.0)]
    start = [p.detach().clone() for p in model.parameters()]
    opt = StreamingDiLoCo(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        MemorySwarm().client("a"),
        "run",
        local_steps=4,
        outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        fragments=2,
        overlap_steps=1,
        min_group_size=1,
    )
    assert opt.fragments == [[0], [1]]
    w0, w1 = model[0].weight, model[1].weight

    def inner_step() -> None:
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad()

    inner_step()
    inner_step()  # after step 2: sync 0 (fragment 1, the second layer) starts
    assert opt.epoch == 0
    assert opt._pending is not None
    assert opt._pending.fragment == 1
    inner_step()  # step 3: sync 0 is applied: anchor_1 = start_1 - 1.0 * (2 * 0.1 * g_1)
    assert opt.epoch == 1
    assert opt._pending is None
    expected_anchor = start[1] - 2 * 0.1 * grads[1]
    assert torch.allclose(opt.anchor[1], expected_anchor)
    # ... and the parameters keep the one step taken during the overlap.
    assert torch.allclose(w1.detach(), expected_anchor - 0.1 * grads[1])
    assert torch.equal(opt.anchor[0], start[0])  # fragment 0 not synced yet
    assert torch.allclose(w0.detach(), start[0] - 3 * 0.1 * grads[0])
    inner_step()  # step 4: sync 1 (fragment 0) starts: its delta covers 4 inner steps
    inner_step()  # step 5: applied
    assert opt.epoch == 2
    assert torch.allclose(opt.anchor[0], start[0] - 4 * 0.1 * grads[0])
    assert torch.allclose(w0.detach(), start[0] - 5 * 0.1 * grads[0])
    assert torch.allclose(opt.anchor[1], expected_anchor)  # untouched by sync 1
    opt.close()


def test_bad_schedules_fail_at_construction() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    client = MemorySwarm().client("a")
    with pytest.raises(ValueError, match="multiple of fragments"):
        StreamingDiLoCo(model.parameters(), inner, client, "r", local_steps=5, fragments=2)
    with pytest.raises(ValueError, match="overlap_steps"):
        StreamingDiLoCo(
            model.parameters(), inner, client, "r", local_steps=4, fragments=2, overlap_steps=2
        )
