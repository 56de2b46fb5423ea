"""What happens to the inner work of a member that missed the swarm's outer step.

A member that was too slow for a sync, or stalled (a laptop's lid closed), finds the swarm
one or more outer steps ahead when it comes to its own sync. Its inner steps are real
samples; throwing them away wastes them, applying them as if nothing happened would
apply a pseudo-gradient twice-removed from the state it was computed on.

The rule (:func:`late_work_fate`): work that missed at most ``max_staleness`` outer steps
is **merged**: the member loads the swarm's anchor and outer state, moves its parameters
to ``new_anchor - (old_anchor - params)`` (its pseudo-gradient, taken against the anchor
it started from, carried onto the swarm's newest anchor: :func:`rebased`), keeps its
sample count, and goes on with its inner steps; its next sync then averages the old and
new work together, weighted by all the samples behind them. This is the one-step-delayed
pseudo-gradient that the asynchronous DiLoCo variants of torchft and PCCL apply. Work
older than that is **discarded**: it
was computed against a state the swarm left several outer steps ago, and a member that
far behind is better served by the swarm's state alone. A member that ran *ahead* of the
swarm's majority (outer steps taken alone) discards too: its steps are not the swarm's.

Pure: the caller decides with :func:`late_work_fate` and moves tensors with :func:`rebased`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class LateWork(enum.Enum):
    """The fate of a late member's inner work."""

    MERGE = "merge"
    DISCARD = "discard"


def late_work_fate(own_epoch: int, swarm_epoch: int, samples: int, max_staleness: int) -> LateWork:
    """Merge or discard the work of a member at ``own_epoch`` that finds the swarm at
    ``swarm_epoch`` (see the module docstring for why).

    Args:
        own_epoch: the outer step this member's work was for.
        swarm_epoch: the swarm's outer step now.
        samples: samples behind the work (none: nothing to merge).
        max_staleness: the most outer steps the work may have missed to be merged.
    """
    missed = swarm_epoch - own_epoch
    if samples > 0 and 1 <= missed <= max_staleness:
        return LateWork.MERGE
    return LateWork.DISCARD


def rebased(
    params: Sequence[torch.Tensor],
    old_anchor: Sequence[torch.Tensor],
    new_anchor: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """``new_anchor - (old_anchor - params)`` per tensor: the inner steps' displacement
    from the anchor they started from, carried onto the newest anchor (in the
    parameters' dtype)."""
    if not len(params) == len(old_anchor) == len(new_anchor):
        raise ValueError("params, old_anchor and new_anchor must have the same length")
    return [
        (n.detach().float() - (o.detach().float() - p.detach().float())).to(p.dtype)
        for p, o, n in zip(params, old_anchor, new_anchor, strict=True)
    ]


__all__ = ["LateWork", "late_work_fate", "rebased"]
