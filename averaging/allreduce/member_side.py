"""One member's side of one round: what its sending and its receiving halves share."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from swarmavg.averaging.allreduce.partition import PartPlan
from swarmavg.averaging.group import GroupInfo
from swarmavg.compression import Codec

__all__ = ["MemberSide"]


@dataclass(frozen=True)
class MemberSide:
    """What a member knows of its round once it prepared it; fixed for the round.

    Attributes:
        group: the formed group.
        my_index: this member's position in ``group.members``.
        plan: the group's parts and chunks.
        codec: the group's codec.
        vector: this member's values, flattened in the reduction dtype.
        executor: where the coding runs (``None``: inline).
    """

    group: GroupInfo
    my_index: int
    plan: PartPlan
    codec: Codec
    vector: np.ndarray
    executor: ThreadPoolExecutor | None
