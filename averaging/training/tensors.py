"""torch <-> numpy helpers of the training wrappers (torch imported inside the functions)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def collect_params(params: Iterable[Any]) -> list[torch.Tensor]:
    """Flatten ``model.parameters()`` or a list of param-group dicts into a list of tensors.

    Raises:
        ValueError: no parameters, a non-tensor entry, or the same tensor twice.
    """
    import torch

    out: list[torch.Tensor] = []
    for item in params:
        group = item["params"] if isinstance(item, dict) else [item]
        if isinstance(group, torch.Tensor):
            group = [group]
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"expected torch tensors as parameters, got {type(p).__name__}")
            out.append(p)
    if not out:
        raise ValueError("no parameters to train")
    if len({id(p) for p in out}) != len(out):
        raise ValueError("the same parameter appears twice")
    return out


def to_arrays(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """float32 copies on the CPU (what crosses the control socket)."""
    import torch

    return [t.detach().to(device="cpu", dtype=torch.float32).numpy().copy() for t in tensors]


def copy_into(targets: Sequence[torch.Tensor], values: Sequence[Any]) -> None:
    """``target.copy_(value)`` for every pair, on the target's device and dtype."""
    import torch

    if len(targets) != len(values):
        raise ValueError(f"expected {len(targets)} tensors, got {len(values)}")
    with torch.no_grad():
        for target, value in zip(targets, values, strict=True):
            source = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
            target.copy_(source.reshape(target.shape))


__all__ = ["collect_params", "copy_into", "to_arrays"]
