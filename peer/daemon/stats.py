"""Counters of one daemon: rounds, bytes, phase durations, failures, per-codec traffic.

Plain Python, updated from the event loop only. ``swarmavg status`` reads them through the
control service and ``swarmavg.peer.daemon.metrics`` exports them to Prometheus, so the counters
exist once and the daemon does not import prometheus-client unless ``--metrics`` is set.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PHASES = ("matchmaking", "transfer", "reduce")


@dataclass
class CodecFigures:
    """Traffic of the rounds that used one codec."""

    rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


@dataclass
class PeerStats:
    """Cumulative figures since the daemon started.

    A round ends one of three ways: complete (``rounds_done - rounds_partial``), partial
    (it returned, but some part kept local values or lost a sender: ``rounds_partial``,
    counted in ``rounds_done`` too) or failed (``rounds_failed``, by reason in
    ``failures``). Repairs of a training state are counted by the training wrappers, in
    the training process (``RoundStats.repairs``), not here.
    """

    rounds_done: int = 0
    rounds_failed: int = 0
    rounds_partial: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    local_calls: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    codecs: dict[str, CodecFigures] = field(default_factory=dict)
    phase_seconds: dict[str, list[float]] = field(default_factory=dict)
    """Recent durations per phase (bounded), for the Prometheus histogram."""
    max_samples: int = 1024

    def record_round(
        self,
        codec: str,
        seconds: float,
        bytes_sent: int,
        bytes_received: int,
        timings: dict[str, float],
        *,
        partial: bool = False,
    ) -> None:
        """Count one successful round (``partial``: it ended partial)."""
        self.rounds_done += 1
        self.rounds_partial += int(partial)
        self.bytes_sent += bytes_sent
        self.bytes_received += bytes_received
        figures = self.codecs.setdefault(codec, CodecFigures())
        figures.rounds += 1
        figures.bytes_sent += bytes_sent
        figures.bytes_received += bytes_received
        figures.seconds += seconds
        for phase, value in timings.items():
            samples = self.phase_seconds.setdefault(phase, [])
            samples.append(float(value))
            if len(samples) > self.max_samples:
                del samples[: len(samples) - self.max_samples]

    def record_failure(self, reason: str) -> None:
        """Count one failed round under ``reason`` (a short code, e.g. ``no_group``)."""
        self.rounds_failed += 1
        self.failures[reason] += 1

    def drain_phase_samples(self) -> dict[str, list[float]]:
        """Take the phase durations recorded since the last call."""
        samples, self.phase_seconds = self.phase_seconds, {}
        return samples
