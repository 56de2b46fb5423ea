"""What ``swarmavg monitor`` records about a run over time (pure; no I/O).

Each poll turns the run's view (``view_to_dict`` of a ``PeersResponse``) into one
:class:`Sample`: a flat map of series name -> number. :class:`History` keeps the newest
samples in a ring buffer, so a monitor left running for weeks holds a bounded amount of
memory, and renders them as the columns the dashboard plots.

Series names: ``peers`` (daemons seen: routing table and progress records), ``trainers``
(training processes reporting), ``epoch``, ``samples_per_second``, ``eta`` (seconds to the
next global step, absent when unknown), ``ignored_records``, ``rounds_done``,
``rounds_partial`` and ``rounds_failed`` (the daemons' round reports summed:
:mod:`swarmavg.peer.daemon.round_reports`), and ``metric/NAME`` for each user metric (the mean
over the peers that report it; ``opt.report_metrics``). ``epoch``, ``samples_per_second``
and ``eta`` are absent while no trainer reports: the records of trainers that left still
name their last figures, which would otherwise read as a live run (the dashboard shows the
last value as stale instead).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_HISTORY = 2048
"""Samples a monitor keeps for the dashboard (at the default 5 s interval: about 2.8 h)."""
BASE_SERIES = (
    "peers",
    "trainers",
    "epoch",
    "samples_per_second",
    "eta",
    "rounds_done",
    "rounds_partial",
    "rounds_failed",
    "ignored_records",
)
"""The series every sample may carry, in the dashboard's order (metrics follow)."""
METRIC_PREFIX = "metric/"


@dataclass(frozen=True)
class Sample:
    """The run at one poll.

    Attributes:
        time: the monitor's wall clock (``time.time()``) at the poll.
        values: series name -> value; a series the run did not say is absent.
    """

    time: float
    values: Mapping[str, float]


def sample_from_view(view: Mapping[str, Any], now: float) -> Sample:
    """One sample of the run from its view (``swarmavg peers --json``'s object).

    The run's figures are summed over training methods (a run has one in practice); the
    ETA is the nearest one known. The monitor itself (``this_peer``, a client-mode node
    with no trainer) is not counted as a peer.
    """
    rows = [r for r in view["peers"] if not r["this_peer"]]
    progress = view["progress"]
    values: dict[str, float] = {
        "peers": float(len({r["peer_id"] for r in rows})),
        "trainers": float(sum(r["processes"] for r in rows if r["method"] is not None)),
        "ignored_records": float(view["ignored_records"]),
    }
    if progress and values["trainers"] > 0:
        values["epoch"] = float(max(p["epoch"] for p in progress))
        values["samples_per_second"] = float(sum(p["samples_per_second"] for p in progress))
        etas = [p["eta"] for p in progress if p["eta"] is not None]
        if etas:
            values["eta"] = float(min(etas))
    reported: dict[str, list[float]] = {}
    for row in rows:
        for name, value in row["metrics"].items():
            if isinstance(value, int | float) and math.isfinite(value):
                reported.setdefault(name, []).append(float(value))
    for name, numbers in sorted(reported.items()):
        values[METRIC_PREFIX + name] = sum(numbers) / len(numbers)
    return Sample(now, values)


class History:
    """The newest ``capacity`` samples of a run (a ring buffer) and a count of all polls.

    Raises:
        ValueError: ``capacity`` below 2 (a plot needs two points).
    """

    def __init__(self, run_id: str, capacity: int = DEFAULT_HISTORY) -> None:
        if capacity < 2:
            raise ValueError(f"the history must hold at least 2 samples, got {capacity}")
        self.run_id = run_id
        self.capacity = capacity
        self.total = 0  # samples ever added (the ones evicted included)
        self._samples: collections.deque[Sample] = collections.deque(maxlen=capacity)

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)
        self.total += 1

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self._samples)

    def names(self) -> list[str]:
        """Every series some kept sample carries: the base ones, then metrics by name."""
        seen = {name for s in self._samples for name in s.values}
        metrics = sorted(n for n in seen if n not in BASE_SERIES)
        return [n for n in BASE_SERIES if n in seen] + metrics

    def to_json(self) -> dict[str, Any]:
        """The columns the dashboard plots: ``t`` (wall-clock seconds) and one list per
        series, ``None`` where a sample did not carry it; ``updated``: per series, the time
        of the newest sample that carried it (the page greys a series whose newest value
        is older than the newest poll)."""
        names = self.names()
        updated: dict[str, float] = {}
        for s in self._samples:
            for name in s.values:
                updated[name] = s.time
        return {
            "run_id": self.run_id,
            "points": len(self._samples),
            "total": self.total,
            "t": [s.time for s in self._samples],
            "series": {
                name: [_finite(s.values.get(name)) for s in self._samples] for name in names
            },
            "updated": {name: updated[name] for name in names},
        }


def _finite(value: float | None) -> float | None:
    """JSON has no infinities: an unknown or infinite value is a gap in the plot."""
    return value if value is not None and math.isfinite(value) else None
