"""The pure rules of the volunteer mode: how long a round lasts, each member's steps, the
fate of late work, and the weighted outer step keeping every member's anchor identical."""

from __future__ import annotations

import math

import pytest
import torch

from swarmavg.averaging.training.diloco import default_outer_optimizer, outer_step, pseudo_gradient
from swarmavg.averaging.training.late_work import LateWork, late_work_fate, rebased
from swarmavg.averaging.training.pace import (
    MAX_RATE_RATIO,
    SwarmPace,
    planned_steps,
    round_seconds,
    swarm_rate,
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"target_samples": 10, "target_seconds": 1.0},
        {"target_samples": 0},
        {"target_seconds": -1.0},
        {"target_seconds": math.inf},
        {"target_samples": 10, "min_steps": 0},
        {"target_samples": 10, "min_steps": 5, "max_steps": 4},
        {"target_samples": 10, "max_staleness": -1},
    ],
)
def test_pace_refuses_bad_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"must|give exactly|need"):
        SwarmPace(**kwargs)  # type: ignore[arg-type]


def test_swarm_rate_counts_unknown_members_at_own_rate() -> None:
    assert swarm_rate(100.0, [50.0, 25.0]) == 175.0
    # a member that has not measured yet (0), and a malformed record (nan), count as ours
    assert swarm_rate(100.0, [0.0, math.nan, 50.0]) == 350.0
    assert swarm_rate(0.0, [0.0]) == 0.0


def test_a_forged_rate_cannot_shrink_the_rounds_to_one_step() -> None:
    """A record claiming an absurd rate counts as MAX_RATE_RATIO times the reader's own, so
    the honest member still plans a round of several steps."""
    assert swarm_rate(100.0, [1e12]) == 100.0 + MAX_RATE_RATIO * 100.0
    pace = SwarmPace(target_samples=100 * 4 * 32)
    honest = planned_steps(pace, 640.0, swarm_rate(640.0, [640.0] * 3), 32, fallback=1)
    attacked = planned_steps(pace, 640.0, swarm_rate(640.0, [640.0] * 3 + [1e12]), 32, fallback=1)
    assert honest == 100
    assert attacked > 1


def test_round_seconds_from_target_and_work_done() -> None:
    pace = SwarmPace(target_samples=1000)
    assert round_seconds(pace, 250.0) == 4.0
    assert round_seconds(pace, 250.0, done=500) == 2.0
    assert round_seconds(pace, 250.0, done=5000) == 0.0
    assert round_seconds(pace, 0.0) is None
    timed = SwarmPace(target_seconds=3.0)
    assert round_seconds(timed, 0.0) == 3.0
    assert round_seconds(timed, 100.0, done=100) == 2.0
    assert round_seconds(timed, 0.0, done=100) is None


@pytest.mark.parametrize(
    "speeds",
    [(1.0, 1.0, 1.0, 0.25), (1.0, 0.5, 1 / 3, 0.25), (1.0, 1.0, 1.0, 1.0), (8.0, 0.2)],
)
def test_every_member_arrives_at_the_same_round_length(speeds: tuple[float, ...]) -> None:
    """Members plan their own step counts from the same records; the round's length in
    seconds is each one's steps at its own speed, and equal to within one step."""
    batch, step_rate = 32, 20.0  # a speed-1 member: 20 steps/s
    rates = [s * step_rate * batch for s in speeds]
    pace = SwarmPace(target_samples=4000)
    total = swarm_rate(rates[0], rates[1:])
    lengths = []
    samples = 0
    for i, own in enumerate(rates):
        others = rates[:i] + rates[i + 1 :]
        assert swarm_rate(own, others) == pytest.approx(total)
        steps = planned_steps(pace, own, swarm_rate(own, others), batch, fallback=20)
        lengths.append(steps * batch / own)
        samples += steps * batch
    slowest_step = batch / min(rates)
    assert max(lengths) - min(lengths) <= slowest_step
    # together they process the target, to within one step each
    assert abs(samples - 4000) <= batch * len(rates)


def test_planned_steps_bounds_and_fallback() -> None:
    pace = SwarmPace(target_samples=1000, min_steps=2, max_steps=50)
    assert planned_steps(pace, 0.0, 0.0, 10, fallback=20) == 20  # nothing measured
    assert planned_steps(pace, 0.0, 0.0, 10, fallback=100) == 50
    assert planned_steps(pace, 1.0, 1e9, 10, fallback=20) == 2  # far slower than the swarm
    assert planned_steps(pace, 1e9, 1e9, 1, fallback=20) == 50
    assert planned_steps(SwarmPace(target_seconds=2.0), 100.0, 400.0, 10, fallback=1) == 20
    with pytest.raises(ValueError, match="batch must be positive"):
        planned_steps(pace, 1.0, 1.0, 0, fallback=1)


@pytest.mark.parametrize(
    ("own", "swarm", "samples", "staleness", "fate"),
    [
        (3, 4, 100, 1, LateWork.MERGE),
        (3, 5, 100, 1, LateWork.DISCARD),  # two outer steps stale
        (3, 5, 100, 2, LateWork.MERGE),
        (3, 4, 0, 1, LateWork.DISCARD),  # nothing to merge
        (3, 4, 100, 0, LateWork.DISCARD),  # merging turned off
        (5, 4, 100, 1, LateWork.DISCARD),  # ahead of the swarm: steps taken alone
        (4, 4, 100, 1, LateWork.DISCARD),  # missed by a round, not by an outer step
    ],
)
def test_late_work_fate(own: int, swarm: int, samples: int, staleness: int, fate: LateWork) -> None:
    assert late_work_fate(own, swarm, samples, staleness) is fate


def test_rebased_carries_the_displacement_onto_the_new_anchor() -> None:
    old = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    params = [torch.tensor([0.5, 2.5]), torch.tensor([[2.0]])]
    new = [torch.tensor([10.0, 20.0]), torch.tensor([[30.0]])]
    moved = rebased(params, old, new)
    assert torch.equal(moved[0], torch.tensor([9.5, 20.5]))
    assert torch.equal(moved[1], torch.tensor([[29.0]]))
    # the pseudo-gradient against the new anchor is the one taken against the old
    for a, b in zip(pseudo_gradient(new, moved), pseudo_gradient(old, params), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="same length"):
        rebased(params, old, new[:1])


def test_weighted_pseudo_gradients_keep_every_anchor_identical() -> None:
    """Members of unequal work: the sample-weighted mean of their pseudo-gradients, applied
    by each to the same anchor, gives bit-identical anchors and outer states."""
    torch.manual_seed(0)
    start = [torch.randn(4, 3), torch.randn(3)]
    steps = [20, 20, 20, 5]  # three fast members, one four times slower
    deltas, weights = [], []
    for member, n in enumerate(steps):
        gen = torch.Generator().manual_seed(member)
        local = [t.clone() for t in start]
        for _ in range(n):
            for t in local:
                t.sub_(0.01 * torch.randn(t.shape, generator=gen))
        deltas.append(pseudo_gradient(start, local))
        weights.append(float(n * 32))
    total = sum(weights)
    mean = [sum(w * d[i] for w, d in zip(weights, deltas, strict=True)) / total for i in range(2)]
    anchors, states = [], []
    for _ in steps:
        params = [torch.nn.Parameter(t.clone()) for t in start]
        anchor = [t.clone() for t in start]
        opt = default_outer_optimizer(list(params))
        outer_step(params, anchor, mean, opt)
        anchors.append(anchor)
        states.append(opt.state_dict())
    for anchor in anchors[1:]:
        for a, b in zip(anchors[0], anchor, strict=True):
            assert torch.equal(a, b)
    # the slow member's pull is a quarter of a fast one's weight, not an equal vote
    assert weights[3] / weights[0] == pytest.approx(0.25)
