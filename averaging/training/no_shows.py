"""Daemons the progress records name that did not come to a round.

A trainer expects as many peers in a round as the progress records name (the caller's
``group_size``), and a leader waits for that many up to ``matchmaking_time``. A daemon that
was killed leaves its records behind until their ttl (30 s) runs out, so without this
memory every round of that half minute would wait the whole window for it: 19-28 s of round
time per peer in the chaos benchmark, against 7-8 s without faults.

So once a round closes without a daemon the records named, that daemon stops counting
until it writes a record newer than the one it was expected on: a live peer that missed a
round (it was loading state, or late) counts again at its next report; a dead one never does.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol, TypeVar


class Record(Protocol):
    """What this module reads of a progress record (``progress.PeerProgress``)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def time(self) -> float: ...


R = TypeVar("R", bound=Record)


class NoShows:
    """Per daemon id, the time of the newest record it was expected on and missed.

    Thread-safe: the overlap modes run their rounds in a worker thread while the training
    thread reads the records.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._missed: dict[str, float] = {}

    def note(self, expected: Mapping[str, float], present: Collection[str]) -> list[str]:
        """Remember the daemons of ``expected`` (id -> its newest record's time, as the
        round's caller read them) that are not among the round's ``present`` members.

        Returns:
            the ids newly remembered, sorted.
        """
        missing = sorted(set(expected) - set(present))
        with self._lock:
            fresh = [p for p in missing if self._missed.get(p) != expected[p]]
            for peer_id in missing:
                self._missed[peer_id] = max(self._missed.get(peer_id, 0.0), expected[peer_id])
        return fresh

    def admitted(self, records: Iterable[R]) -> list[R]:
        """The records that count: all but those of a remembered daemon that has written
        nothing newer since. A daemon that has is forgotten, and so is one whose records
        are all gone (expired), which keeps the memory as small as the records."""
        records = list(records)
        with self._lock:
            if not self._missed:
                return records
            newest: dict[str, float] = {}
            for p in records:
                newest[p.peer_id] = max(newest.get(p.peer_id, 0.0), p.time)
            for peer_id, seen in list(self._missed.items()):
                if newest.get(peer_id, seen + 1.0) > seen:
                    del self._missed[peer_id]  # it reported again (alive), or expired
            return [p for p in records if p.peer_id not in self._missed]

    def __len__(self) -> int:
        with self._lock:
            return len(self._missed)

    def __contains__(self, peer_id: object) -> bool:
        with self._lock:
            return peer_id in self._missed
