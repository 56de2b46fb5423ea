"""Streaming DiLoCo's fragments: which tensors a sync covers, and its outer step.

Pure functions of the schedule and the tensors (no swarm, no threads), shared by
:class:`~swarmavg.averaging.training.streaming.StreamingDiLoCo` and its hand-checked tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from swarmavg.averaging.training.diloco import outer_step

if TYPE_CHECKING:
    import torch


def fragment_of_sync(sync: int, fragments: int) -> int:
    """The fragment that sync number ``sync`` covers.

    Sync ``e`` starts after inner step ``(e + 1) * H / F``; fragment ``f`` must sync where
    ``(t + f * H / F) % H == 0``, so the order runs F-1, F-2, ..., 0, then again.
    """
    return (fragments - 1 - sync) % fragments


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Split tensors (by their element counts, in order) into ``fragments`` contiguous,
    non-empty groups of about equal size; returns each group's tensor indices.

    Groups fill in order up to an equal share of the elements each (so consecutive
    layers stay together, as in the paper).

    Raises:
        ValueError: fewer tensors than fragments, or ``fragments`` < 1.
    """
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    if len(sizes) < fragments:
        raise ValueError(f"{len(sizes)} parameter tensors cannot make {fragments} fragments")
    share = sum(sizes) / fragments
    groups: list[list[int]] = [[]]
    filled = 0
    for i, size in enumerate(sizes):
        # Open the next group once this one holds its share, or when every tensor left
        # is needed to give each remaining group one.
        full = filled >= len(groups) * share or len(sizes) - i <= fragments - len(groups)
        if groups[-1] and len(groups) < fragments and full:
            groups.append([])
        groups[-1].append(i)
        filled += size
    return groups


def fragment_outer_step(
    params: Sequence[torch.Tensor],
    anchor: Sequence[torch.Tensor],
    indices: Sequence[int],
    delta: Sequence[Any],
    outer_optimizer: torch.optim.Optimizer,
) -> None:
    """DiLoCo's outer step on the tensors ``indices`` only.

    torch optimizers skip parameters whose ``.grad`` is None, so the other tensors'
    gradients are set aside during the step (their momentum is not touched) and put back.
    """
    chosen = set(indices)
    saved = {i: params[i].grad for i in range(len(params)) if i not in chosen}
    for i in saved:
        params[i].grad = None
    try:
        outer_step(
            [params[i] for i in indices], [anchor[i] for i in indices], delta, outer_optimizer
        )
    finally:
        for i, grad in saved.items():
            params[i].grad = grad


__all__ = ["fragment_of_sync", "fragment_outer_step", "split_fragments"]
