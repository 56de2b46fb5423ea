"""The wrappers are real ``torch.optim.Optimizer`` objects: schedulers, hooks,
checkpoints, and a misspelt codec refused when the wrapper is built."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo, PowerSGDOptimizer
from tests.training.helpers import backward, batch, linear_model
from tests.training.memswarm import MemorySwarm

pytestmark = pytest.mark.timeout(60)


def collaborative(swarm: MemorySwarm, **kwargs: Any) -> tuple[torch.nn.Module, Any, Any]:
    model = linear_model()
    local = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = CollaborativeOptimizer(
        model.parameters(),
        local,
        client=swarm.client("a"),
        run_id="run",
        target_batch_size=4,
        batch_size_per_step=4,
        min_group_size=1,
        **kwargs,
    )
    return model, local, opt


def diloco(swarm: MemorySwarm, **kwargs: Any) -> tuple[torch.nn.Module, Any, Any]:
    model = linear_model()
    local = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DiLoCo(
        model.parameters(),
        local,
        client=swarm.client("a"),
        run_id="run",
        local_steps=2,
        batch_size_per_step=4,
        min_group_size=1,
        **kwargs,
    )
    return model, local, opt


def powersgd(swarm: MemorySwarm, **kwargs: Any) -> tuple[torch.nn.Module, Any, Any]:
    model = linear_model()
    local = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = PowerSGDOptimizer(
        model.parameters(),
        local,
        client=swarm.client("a"),
        run_id="run",
        target_batch_size=4,
        batch_size_per_step=4,
        rank=1,
        min_group_size=1,
        **kwargs,
    )
    return model, local, opt


WRAPPERS = {"collaborative": collaborative, "diloco": diloco, "powersgd": powersgd}


@pytest.mark.parametrize("make", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_a_scheduler_drives_the_local_optimizers_learning_rate(make: Any) -> None:
    model, local, opt = make(MemorySwarm())
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is local.param_groups
    assert opt.state is local.state
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for i in range(3):
        backward(model, batch(i))
        opt.step()
        opt.zero_grad()
        scheduler.step()
    assert local.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert scheduler.get_last_lr() == [pytest.approx(0.1 * 0.5**3)]


@pytest.mark.parametrize("make", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_step_hooks_run_and_checkpoints_round_trip(make: Any) -> None:
    model, _, opt = make(MemorySwarm())
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    backward(model, batch(0))
    opt.step()
    assert calls == ["pre", "post"]
    state = opt.state_dict()
    _, _, other = make(MemorySwarm())
    other.load_state_dict(state)
    assert other.epoch == opt.epoch


@pytest.mark.parametrize("make", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_parameter_groups_are_fixed_once_wrapped(make: Any) -> None:
    _, _, opt = make(MemorySwarm())
    with pytest.raises(ValueError, match="fixed set of parameters"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


@pytest.mark.parametrize("make", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_a_misspelt_codec_fails_when_the_wrapper_is_built(make: Any) -> None:
    with pytest.raises(ValueError, match="fp16"):
        make(MemorySwarm(), codec="fp16")


@pytest.mark.parametrize("make", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_reported_metrics_travel_with_the_progress_record(make: Any) -> None:
    swarm = MemorySwarm()
    model, _, opt = make(swarm)
    backward(model, batch(0))
    opt.report_metrics(loss=torch.tensor(0.5), accuracy=0.75)
    opt.step()
    # DiLoCo's inner steps report in the background (ProgressTracker.report_soon): wait
    # for that store to land before reading the DHT
    assert opt.tracker._reporter.settle(10.0)
    records = [value for values in swarm.dht.values() for value, _ in values.values()]
    assert {"loss": 0.5, "accuracy": 0.75} in [r.get("metrics") for r in records]
    with pytest.raises(ValueError, match="'loss' must be a finite number"):
        opt.report_metrics(loss=float("inf"))


def test_powersgd_refuses_delayed_updates_and_says_what_to_use_instead() -> None:
    swarm = MemorySwarm()
    with pytest.raises(ValueError, match=r"cannot delay its updates.*delay_updates=True"):
        powersgd(swarm, delay_updates=True)
