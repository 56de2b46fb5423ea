"""Training wrappers (docs/training.md): the public import path ``swarmavg.averaging.optim``.

The code lives in :mod:`swarmavg.averaging.training`; this module only names what users import.
"""

from swarmavg.averaging.run_records.progress import GlobalProgress
from swarmavg.averaging.training.collaborative import CollaborativeOptimizer
from swarmavg.averaging.training.diloco import (
    DiLoCo,
    outer_step,
    pseudo_gradient,
    sgd_outer_optimizer,
)
from swarmavg.averaging.training.pace import SwarmPace
from swarmavg.averaging.training.powersgd import PowerSGDOptimizer
from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.averaging.training.streaming import StreamingDiLoCo
from swarmavg.averaging.training.swarm import RoundStats, SwarmRoundWarning

__all__ = [
    "CollaborativeOptimizer",
    "DiLoCo",
    "GlobalProgress",
    "PowerSGDOptimizer",
    "ProgressTracker",
    "RoundStats",
    "StreamingDiLoCo",
    "SwarmPace",
    "SwarmRoundWarning",
    "outer_step",
    "pseudo_gradient",
    "sgd_outer_optimizer",
]
