"""Which training runs a daemon's run holds: one small entry per trainer (usable on its own).

A trainer's run id (the namespace of its progress records and rounds) may differ from its
daemon's run id: a typo, or a second run on the same daemons on purpose. Trainers of
different runs never meet, and nothing else tells them so. Every trainer therefore writes
one owner-signed entry under ``{daemon run}.trainers`` naming its training run, its method
and whether it has seen another trainer of that run; reading that key back lists every
training run of the daemons' run (``swarmavg peers``) and, for a trainer alone, the runs it
could have meant (its warning names them).

Entries come from other peers: :meth:`TrainerEntry.from_record` validates them and the DHT
accepts nothing else under the key (averaging/protocol_keys.py). An entry is only ever
shown, never acted on: a forged one can make a listing longer, nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from swarmavg.averaging.run_records.progress import owner_of

TRAINERS_SUFFIX = ".trainers"
"""``{daemon run}.trainers``: the training runs of a daemons' run, one entry per trainer."""
AVERAGERS_SUFFIX = ".averagers"
"""``{daemon run}.averagers``: the run's averaging daemons, one owner-signed presence entry
each, written by the daemons' matchmaking (``roster.PRESENCE_SUFFIX`` is this name) and
read by trainers (the start barrier) without loading matchmaking."""
MAX_RUN_CHARS = 128
"""Longest training run id an entry may name."""
MAX_METHOD_CHARS = 32
"""Longest method name an entry may carry."""


def other_daemons(raw: object, own: str) -> set[str]:
    """The daemons (hex ids) other than ``own`` with a presence entry in a
    ``{daemon run}.averagers`` value (``client.dht.get``): the run's averaging daemons."""
    if not isinstance(raw, Mapping):
        return set()
    return {o for o in map(owner_of, raw) if o is not None and o != own}


def trainers_key(daemon_run: str) -> str:
    """The DHT key of the trainer entries of daemons' run ``daemon_run``."""
    return f"{daemon_run}{TRAINERS_SUFFIX}"


@dataclass(frozen=True)
class TrainerEntry:
    """One trainer's entry.

    Attributes:
        run: the training run it reports progress and averages under.
        method: ``"collaborative"`` or ``"diloco"`` (what ``swarmavg peers`` calls it).
        alone: seconds it has seen no other trainer of ``run`` (0: it has company).
        time: the writer's wall clock when it wrote the entry.
    """

    run: str
    method: str
    alone: float
    time: float

    def to_record(self) -> dict[str, Any]:
        """The msgpack-able DHT value."""
        return {"run": self.run, "method": self.method, "alone": self.alone, "time": self.time}

    @classmethod
    def from_record(cls, record: object) -> TrainerEntry | None:
        """Parse a DHT value written by another peer; None when it is malformed."""
        if not isinstance(record, Mapping):
            return None
        run, method = record.get("run"), record.get("method")
        alone, when = record.get("alone"), record.get("time")
        if not (isinstance(run, str) and 0 < len(run) <= MAX_RUN_CHARS):
            return None
        if not (isinstance(method, str) and 0 < len(method) <= MAX_METHOD_CHARS):
            return None
        if not (_finite(alone) and _finite(when) and alone >= 0):
            return None
        return cls(run, method, float(alone), float(when))


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class TrainingRun:
    """A training run as the entries under one daemons' run describe it.

    Attributes:
        run: its id.
        method: the method its newest entry names.
        trainers: how many trainer entries name it.
        alone: how many of those have seen no other trainer of it.
    """

    run: str
    method: str
    trainers: int
    alone: int


def training_runs(raw: object) -> list[TrainingRun]:
    """The training runs of a ``{daemon run}.trainers`` value (``client.dht.get``), the
    run with the most trainers first; malformed entries are skipped."""
    if not isinstance(raw, Mapping):
        return []
    newest: dict[str, TrainerEntry] = {}
    trainers: dict[str, int] = {}
    alone: dict[str, int] = {}
    for value in raw.values():
        entry = TrainerEntry.from_record(value)
        if entry is None:
            continue
        if entry.run not in newest or entry.time > newest[entry.run].time:
            newest[entry.run] = entry
        trainers[entry.run] = trainers.get(entry.run, 0) + 1
        alone[entry.run] = alone.get(entry.run, 0) + (entry.alone > 0)
    runs = [TrainingRun(r, newest[r].method, trainers[r], alone[r]) for r in newest]
    return sorted(runs, key=lambda r: (-r.trainers, r.run))


def runs_by_daemon(raw: object) -> dict[str, set[str]]:
    """The training runs each daemon's trainers name in a ``{daemon run}.trainers`` value
    (the daemon is the owner its entry's subkey names)."""
    runs: dict[str, set[str]] = {}
    if not isinstance(raw, Mapping):
        return runs
    for subkey, value in raw.items():
        entry, owner = TrainerEntry.from_record(value), owner_of(subkey)
        if entry is not None and owner is not None:
            runs.setdefault(owner, set()).add(entry.run)
    return runs


def describe_runs(runs: list[TrainingRun]) -> str:
    """``'my-run' (3 trainers), 'my_run' (1 trainer)``, or ``none``."""
    if not runs:
        return "none"
    return ", ".join(
        f"{r.run!r} ({r.trainers} trainer{'s' if r.trainers != 1 else ''})" for r in runs
    )


class LocalTrainers:
    """The trainer entries a daemon's own training processes stored through it, for its
    status (``swarmavg status``): the daemon sees them pass, no DHT read is needed.

    Args:
        limit: the most entries kept (the newest replace the oldest): the control
            endpoint is local, but a buggy loop must not grow the daemon's memory.
    """

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._entries: dict[object, tuple[TrainerEntry, float]] = {}

    def remember(self, subkey: object, value: object, expires: float) -> None:
        """Keep ``value`` (if it is an entry) under ``subkey`` until ``expires``
        (monotonic seconds)."""
        entry = TrainerEntry.from_record(value)
        if entry is None or not isinstance(subkey, str | bytes | int):
            return
        self._entries.pop(subkey, None)
        self._entries[subkey] = (entry, expires)
        while len(self._entries) > self.limit:
            del self._entries[next(iter(self._entries))]

    def live(self, now: float) -> list[TrainerEntry]:
        """The entries not expired at ``now`` (monotonic), oldest first."""
        self._entries = {k: v for k, v in self._entries.items() if v[1] > now}
        return [entry for entry, _ in self._entries.values()]


__all__ = [
    "AVERAGERS_SUFFIX",
    "TRAINERS_SUFFIX",
    "LocalTrainers",
    "TrainerEntry",
    "TrainingRun",
    "describe_runs",
    "other_daemons",
    "runs_by_daemon",
    "trainers_key",
    "training_runs",
]
