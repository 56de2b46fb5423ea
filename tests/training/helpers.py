"""Small models and thread helpers shared by the training tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


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
