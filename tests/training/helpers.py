"""Small models and thread helpers shared by the training tests."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.harness import logged_to


def run_in_threads(*functions: Callable[[], Any], timeout: float = 60.0) -> list[Any]:
    """Run the functions concurrently; return their results, re-raising the first error."""
    results: list[Any] = [None] * len(functions)
    errors: list[BaseException] = []

    def runner(i: int, fn: Callable[[], Any]) -> None:
        try:
            results[i] = fn()
        except BaseException as exc:  # re-raised in the calling thread below
            errors.append(exc)

    threads = [
        threading.Thread(target=runner, args=(i, fn), daemon=True) for i, fn in enumerate(functions)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a thread did not finish within {timeout}s")
    if errors:
        raise errors[0]
    return results


def linear_model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def batch(seed: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, generator=g), torch.randn(size, 2, generator=g)


def gradients(
    model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]
) -> list[torch.Tensor]:
    """The gradient of the MSE loss on ``data`` at the model's current parameters."""
    model.zero_grad()
    x, y = data
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


def backward(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = data
    torch.nn.functional.mse_loss(model(x), y).backward()


def sgd_collaborative(
    model: torch.nn.Module,
    client: Any,
    *,
    run_id: str | None,
    target_batch_size: int,
    batch_size_per_step: int = 4,
    lr: float = 0.1,
    momentum: float = 0.9,
    **options: Any,
) -> Any:
    """A ``CollaborativeOptimizer`` over SGD on ``model`` (``max_wait`` 10 s unless given)."""
    from swarmavg.averaging.optim import CollaborativeOptimizer

    return CollaborativeOptimizer(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        client=client,
        run_id=run_id,
        target_batch_size=target_batch_size,
        batch_size_per_step=batch_size_per_step,
        **{"max_wait": 10.0, **options},
    )


def train_until(model: torch.nn.Module, opt: Any, seed: int, epoch: int, limit: int = 60) -> None:
    """Step ``opt`` on seeded batches until it reaches ``epoch``; fail after ``limit`` steps."""
    for _ in range(limit):
        if opt.epoch >= epoch:
            return
        backward(model, batch(seed + opt.epoch))
        opt.step()
        opt.zero_grad()
    raise AssertionError(f"epoch {epoch} not reached in {limit} steps (at {opt.epoch})")


class Said(logging.Handler):
    """Sets an event when a log line contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@pytest.fixture
def first_waits() -> Iterator[Said]:
    """Set once a trainer logs that its start barrier waits."""
    said = Said("waiting up to")
    with logged_to(said, "swarmavg.averaging.training.base", logging.INFO):
        yield said
