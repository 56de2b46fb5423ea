"""Round reports: what each daemon tells the run about its own rounds, for ``swarmavg monitor``.

A round's outcome is known only to the daemons that ran it (``PeerStats``, read through the
local control service), and an organiser's monitor is elsewhere. So every daemon publishes a
small owner-signed record under ``{run}.rounds`` (its subkey names it: ``[owner:<hex>]``):
its counters (done, partial, failed by reason) and its last :data:`RECENT_ROUNDS` rounds,
each with the round's key, the group's id and size, or the failure's reason. Read together,
the reports show what no single daemon sees: two groups under one round key (the swarm
split), a daemon whose rounds find no group (a stranded trainer), failures by reason.

:class:`RoundLog` is the daemon's side (pure: the daemon calls it from its event loop),
:func:`publish_rounds` the task that stores it, :func:`parse_reports` the reader's side, which
treats every record as hostile: a record that is malformed, too large, or that names another
daemon than the one that signed it is counted as ignored.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

ROUNDS_SUFFIX = ".rounds"
RECENT_ROUNDS = 16
"""Rounds a report lists (older ones are in the counters only)."""
MAX_REASONS = 16
"""Failure reasons a report counts separately (reason codes are a short fixed list)."""
MAX_TEXT = 96
"""Longest round key or reason a report carries (longer ones are cut)."""
REPORT_TTL = 120.0
"""Seconds a report lives in the DHT: a daemon that stops leaves the monitor's view then."""
REFRESH = REPORT_TTL / 3
"""A daemon re-stores an unchanged report this often, so that it never expires while alive."""
CHECK_EVERY = 1.0
"""Seconds between the publisher's looks at the log: a round shows within about this long."""
STORE_TIMEOUT = 10.0
OUTCOMES = ("ok", "partial", "failed")


def rounds_key(run_id: str) -> str:
    """The DHT key the daemons of ``run_id`` publish their round reports under."""
    return run_id + ROUNDS_SUFFIX


@dataclass(frozen=True)
class RoundEntry:
    """One round as one daemon saw it.

    Attributes:
        key: the round's key (what was averaged, e.g. ``step-42``).
        time: the daemon's wall clock when the round ended.
        outcome: ``ok``, ``partial`` (returned, but some part kept local values) or
            ``failed``.
        group: the group's id (hex, shortened); empty for a failed round.
        size: members of the group (0 for a failed round).
        reason: why it failed (``no_group``, ``timeout``, ...); empty otherwise.
    """

    key: str
    time: float
    outcome: str
    group: str = ""
    size: int = 0
    reason: str = ""

    def to_record(self) -> list[Any]:
        return [self.key, self.time, self.outcome, self.group, self.size, self.reason]

    @classmethod
    def from_record(cls, raw: object) -> RoundEntry | None:
        if not isinstance(raw, list | tuple) or len(raw) != 6:
            return None
        key, when, outcome, group, size, reason = raw
        if not (
            _short_text(key)
            and _finite(when)
            and outcome in OUTCOMES
            and _short_text(group, empty=True)
            and _count(size)
            and _short_text(reason, empty=True)
        ):
            return None
        return cls(key, float(when), outcome, group, size, reason)


@dataclass(frozen=True)
class RoundReport:
    """One daemon's rounds since it started.

    Attributes:
        peer_id: the daemon (hex).
        time: its wall clock when it stored the report.
        done: rounds that returned (partial ones included).
        partial: rounds that returned partial.
        failed: rounds that failed.
        failures: reason -> failed rounds.
        recent: its last rounds, oldest first.
    """

    peer_id: str
    time: float
    done: int
    partial: int
    failed: int
    failures: Mapping[str, int]
    recent: tuple[RoundEntry, ...]

    def to_record(self) -> dict[str, Any]:
        """The msgpack-able DHT value."""
        return {
            "peer": self.peer_id,
            "time": self.time,
            "done": self.done,
            "partial": self.partial,
            "failed": self.failed,
            "failures": dict(self.failures),
            "recent": [e.to_record() for e in self.recent],
        }

    @classmethod
    def from_record(cls, raw: object) -> RoundReport | None:
        """The report in a DHT value, or None when it is not a well-formed one."""
        if not isinstance(raw, Mapping):
            return None
        peer, when = raw.get("peer"), raw.get("time")
        counts = [raw.get(name) for name in ("done", "partial", "failed")]
        failures, recent = raw.get("failures"), raw.get("recent")
        if not (isinstance(peer, str) and len(peer) == 40 and _finite(when)):
            return None
        if not all(_count(c) for c in counts) or not isinstance(failures, Mapping):
            return None
        if not isinstance(recent, list | tuple) or len(recent) > RECENT_ROUNDS:
            return None
        if len(failures) > MAX_REASONS or not all(
            _short_text(k) and _count(v) for k, v in failures.items()
        ):
            return None
        entries = [RoundEntry.from_record(e) for e in recent]
        if any(e is None for e in entries):
            return None
        done, partial, failed = (int(c) for c in counts)  # type: ignore[arg-type]
        return cls(
            peer,
            float(when),  # type: ignore[arg-type]
            done,
            partial,
            failed,
            dict(failures),
            tuple(e for e in entries if e is not None),
        )


class RoundLog:
    """A daemon's rounds, as its report says them. Not thread-safe: the event loop's."""

    def __init__(self) -> None:
        self.done = 0
        self.partial = 0
        self.failed = 0
        self.failures: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[RoundEntry] = collections.deque(maxlen=RECENT_ROUNDS)
        self.version = 0  # bumped on every change: the publisher stores only news

    def round_done(self, key: str, group_id: str, size: int, *, partial: bool) -> None:
        self.done += 1
        self.partial += int(partial)
        outcome = "partial" if partial else "ok"
        self.recent.append(RoundEntry(key[:MAX_TEXT], time.time(), outcome, group_id[:16], size))
        self.version += 1

    def round_failed(self, key: str, reason: str) -> None:
        reason = reason[:MAX_TEXT] or "error"
        self.failed += 1
        # one slot stays for "other", so that the report never counts more than MAX_REASONS
        if reason in self.failures or len(self.failures) < MAX_REASONS - 1:
            self.failures[reason] += 1
        else:
            self.failures["other"] += 1
        self.recent.append(RoundEntry(key[:MAX_TEXT], time.time(), "failed", reason=reason))
        self.version += 1

    def report(self, peer_id: str) -> RoundReport:
        return RoundReport(
            peer_id,
            time.time(),
            self.done,
            self.partial,
            self.failed,
            dict(self.failures),
            tuple(self.recent),
        )


class Storing(Protocol):
    async def store(self, key: str, value: Any, expiration: float, subkey: Any = None) -> Any: ...


async def publish_rounds(
    dht: Storing, run_id: str, peer_id: str, rounds: RoundLog, check_every: float = CHECK_EVERY
) -> None:
    """Store ``rounds``' report whenever it changed (at most every ``check_every`` s) and
    every :data:`REFRESH` s; runs until cancelled. A failed store is logged and retried at
    the next change or refresh: the monitor is a spectator, the rounds never wait for it."""
    loop = asyncio.get_running_loop()
    key, subkey = rounds_key(run_id), f"[owner:{peer_id}]"
    stored_version, stored_at = -1, -math.inf
    while True:
        if rounds.version != stored_version or loop.time() - stored_at >= REFRESH:
            version = rounds.version
            record = rounds.report(peer_id).to_record()
            try:
                async with asyncio.timeout(STORE_TIMEOUT):
                    await dht.store(key, record, time.time() + REPORT_TTL, subkey=subkey)
                stored_version, stored_at = version, loop.time()
            except Exception as exc:  # the DHT is unreachable for a while: try again later
                log.debug("storing the round report failed: %r", exc)
                stored_at = loop.time()
        await asyncio.sleep(check_every)


def parse_reports(raw: object) -> tuple[list[RoundReport], int]:
    """The valid reports in the ``{run}.rounds`` value and how many entries were ignored.

    The DHT checked that the owner a subkey names signed its entry; a report that names
    another daemon inside is a forgery and is ignored.
    """
    reports: list[RoundReport] = []
    ignored = 0
    if not isinstance(raw, Mapping):
        return reports, ignored
    for subkey, value in raw.items():
        report = RoundReport.from_record(value)
        if report is not None and subkey == f"[owner:{report.peer_id}]":
            reports.append(report)
        else:
            ignored += 1
    return reports, ignored


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53


def _short_text(value: object, *, empty: bool = False) -> bool:
    return isinstance(value, str) and (empty or bool(value)) and len(value) <= MAX_TEXT
