"""The swarm's figures a framework callback reports next to the loss (one flat dict)."""

from __future__ import annotations

from swarmavg.averaging.training.base import SwarmOptimizer


def swarm_metrics(optimizer: SwarmOptimizer) -> dict[str, float]:
    """The wrapper's epoch, the swarm's last known throughput and peers, its round counts.

    Reads only what the wrapper already holds: no DHT lookup, so a logging hook may call it
    every step.
    """
    progress = optimizer.global_progress()
    stats = optimizer.stats
    return {
        "swarm/epoch": float(optimizer.epoch),
        "swarm/samples_per_second": float(progress.samples_per_second),
        "swarm/peers": float(progress.num_peers),
        "swarm/rounds": float(stats.rounds),
        "swarm/rounds_failed": float(stats.failed),
    }
