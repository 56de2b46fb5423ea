"""DiLoCo's outer step against hand computation (no daemon)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.training.diloco import (  # noqa: E402
    OUTER_LR,
    OUTER_MOMENTUM,
    default_outer_optimizer,
    outer_step,
    pseudo_gradient,
)


def test_pseudo_gradient_is_anchor_minus_current() -> None:
    anchor = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    current = [torch.tensor([0.5, 2.5]), torch.tensor([[1.0]])]
    delta = pseudo_gradient(anchor, current)
    assert torch.equal(delta[0], torch.tensor([0.5, -0.5]))
    assert torch.equal(delta[1], torch.tensor([[2.0]]))


def test_default_outer_optimizer_is_the_papers() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = default_outer_optimizer([p])
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.SGD)
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    assert (OUTER_LR, OUTER_MOMENTUM) == (0.7, 0.9)


def test_two_outer_steps_match_hand_computed_nesterov() -> None:
    # Nesterov SGD (torch's form): buf = mu*buf + g (buf = g at first); p -= lr*(g + mu*buf).
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    anchor = [p.detach().clone()]
    outer = default_outer_optimizer([p])

    with torch.no_grad():
        p.copy_(torch.tensor([0.5, 2.5]))  # where H inner steps took this replica
    delta = pseudo_gradient(anchor, [p])  # [0.5, -0.5]
    outer_step([p], anchor, delta, outer)
    # buf = [0.5, -0.5]; update = g + 0.9*buf = [0.95, -0.95]; p = [1, 2] - 0.7*update
    expected = torch.tensor([1.0 - 0.665, 2.0 + 0.665])
    assert torch.allclose(p.detach(), expected, atol=1e-6)
    assert torch.equal(anchor[0], p.detach())
    assert p.grad is None

    with torch.no_grad():
        p.add_(torch.tensor([-0.2, 0.1]))
    delta = pseudo_gradient(anchor, [p])  # [0.2, -0.1]
    outer_step([p], anchor, delta, outer)
    # buf = 0.9*[0.5, -0.5] + [0.2, -0.1] = [0.65, -0.55]
    # update = [0.2, -0.1] + 0.9*buf = [0.785, -0.595]
    expected = expected - 0.7 * torch.tensor([0.785, -0.595])
    assert torch.allclose(p.detach(), expected, atol=1e-6)


def test_outer_step_on_averaged_pseudo_gradients_of_a_toy_problem() -> None:
    # Two replicas minimise (w - t_i)^2 with plain SGD for H steps from the same anchor;
    # the outer step applies Nesterov SGD to the mean of their pseudo-gradients.
    targets, lr, steps = (torch.tensor([4.0]), torch.tensor([-2.0])), 0.1, 3
    anchor_value = torch.tensor([1.0])
    deltas = []
    for t in targets:
        w = torch.nn.Parameter(anchor_value.clone())
        inner = torch.optim.SGD([w], lr=lr)
        for _ in range(steps):
            inner.zero_grad()
            ((w - t) ** 2).sum().backward()
            inner.step()
        # closed form: w_H - t = (1 - 2*lr)^H (w_0 - t)
        assert torch.allclose(w.detach(), t + 0.8**steps * (anchor_value - t))
        deltas.append(pseudo_gradient([anchor_value], [w])[0])
    mean_delta = (deltas[0] + deltas[1]) / 2
    # delta_i = (1 - 0.8^3) * (w0 - t_i) = 0.488 * (1 - t_i): [-1.464, 1.464] -> mean 0
    assert torch.allclose(mean_delta, torch.tensor([0.0]), atol=1e-6)

    p = torch.nn.Parameter(anchor_value.clone())
    anchor = [anchor_value.clone()]
    outer = default_outer_optimizer([p])
    outer_step([p], anchor, [mean_delta + 0.5], outer)  # shift: a non-zero averaged delta
    assert torch.allclose(p.detach(), torch.tensor([1.0 - 0.7 * 1.9 * 0.5]), atol=1e-6)


def test_outer_step_accepts_numpy_and_checks_lengths() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0]))
    anchor = [torch.tensor([1.0])]
    outer = torch.optim.SGD([p], lr=1.0)
    outer_step([p], anchor, [torch.tensor([0.25]).numpy()], outer)
    assert p.item() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="same length"):
        outer_step([p], anchor, [], outer)
