"""The swarm's health at one poll, for the dashboard: a row per peer, the recent rounds, and
the warnings an organiser must not miss (pure; no I/O).

Inputs: the run's view (``view_to_dict``: routing table and progress records) and the
daemons' round reports (:mod:`swarmavg.peer.daemon.round_reports`). A round is the set of entries
that share a round key across reports; its groups are the distinct group ids among them.
Two groups under one key is a split swarm (peers that meant to average together did not);
a daemon whose recent rounds all failed to find a group, or ran in a group of one, trains
alone, and so do the trainers of the only daemon that has any.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarmavg.peer.daemon.round_reports import RoundEntry, RoundReport

RECENT_KEYS = 12
"""Rounds the dashboard lists (newest first)."""
ALONE_AFTER = 2
"""Consecutive rounds without a partner after which a daemon is reported as alone."""
LONELY_REASONS = frozenset({"no_group"})


@dataclass(frozen=True)
class RoundHealth:
    """One round key across the daemons that reported it.

    Attributes:
        key: the round's key.
        time: the newest end among its entries (wall clock).
        groups: group id -> its size, as its members reported it.
        done, partial, failed: entries of each outcome (one per daemon).
        failures: reason -> failed entries.
    """

    key: str
    time: float
    groups: Mapping[str, int]
    done: int
    partial: int
    failed: int
    failures: Mapping[str, int]

    @property
    def split(self) -> bool:
        return len(self.groups) > 1

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "time": self.time,
            "group_sizes": sorted(self.groups.values(), reverse=True),
            "split": self.split,
            "done": self.done,
            "partial": self.partial,
            "failed": self.failed,
            "failures": dict(sorted(self.failures.items())),
        }


def round_health(reports: Sequence[RoundReport], limit: int = RECENT_KEYS) -> list[RoundHealth]:
    """The ``limit`` most recent round keys over all reports, newest first."""
    by_key: dict[str, list[RoundEntry]] = {}
    for report in reports:
        for entry in report.recent:
            by_key.setdefault(entry.key, []).append(entry)
    rounds = []
    for key, entries in by_key.items():
        groups = {e.group: e.size for e in entries if e.outcome != "failed" and e.group}
        outcomes = Counter(e.outcome for e in entries)
        rounds.append(
            RoundHealth(
                key,
                max(e.time for e in entries),
                groups,
                outcomes["ok"] + outcomes["partial"],
                outcomes["partial"],
                outcomes["failed"],
                dict(Counter(e.reason for e in entries if e.outcome == "failed")),
            )
        )
    rounds.sort(key=lambda r: r.time, reverse=True)
    return rounds[:limit]


def alone(report: RoundReport, streak: int = ALONE_AFTER) -> bool:
    """The daemon's last ``streak`` rounds found no partner (no group, or a group of one)."""
    last = report.recent[-streak:]
    return len(last) == streak and all(
        (e.outcome == "failed" and e.reason in LONELY_REASONS) or (e.size == 1) for e in last
    )


def peer_rows(view: Mapping[str, Any], reports: Sequence[RoundReport]) -> list[dict[str, Any]]:
    """One row per daemon of the run (the monitor itself left out): where it is, its
    training progress and its rounds. A daemon seen only through its round report (outside
    the monitor's routing table, no trainer) still gets a row."""
    by_peer = {r.peer_id: r for r in reports}
    rows: dict[str, dict[str, Any]] = {}
    for row in view["peers"]:
        if row["this_peer"]:
            continue
        mine = rows.setdefault(row["peer_id"], _empty_row(row["peer_id"]))
        mine["address"] = mine["address"] or row["address"]
        # "full": in the routing table, dialable; "client": known only from its records
        mine["reachability"] = "public" if row["mode"] == "full" else "client"
        mine["last_seen"] = min(mine["last_seen"] or row["last_seen"], row["last_seen"])
        if row["method"] is not None:
            mine["method"] = row["method"]
            mine["epoch"] = max(mine["epoch"] or 0, row["epoch"])
            mine["samples_per_second"] = (mine["samples_per_second"] or 0.0) + row[
                "samples_per_second"
            ]
            mine["trainers"] += row["processes"]
    for peer_id, report in by_peer.items():
        mine = rows.setdefault(peer_id, _empty_row(peer_id))
        last = report.recent[-1] if report.recent else None
        mine.update(
            rounds_done=report.done,
            rounds_partial=report.partial,
            rounds_failed=report.failed,
            failures=dict(sorted(report.failures.items())),
            last_round=None if last is None else _entry_json(last),
            alone=alone(report),
        )
    return sorted(
        rows.values(), key=lambda r: (r["address"] is None, r["address"] or "", r["peer_id"])
    )


def alerts(rounds: Sequence[RoundHealth], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """What an organiser should look at now, one sentence each (empty: all looks well)."""
    said = []
    for r in rounds:
        if r.split:
            sizes = " + ".join(str(s) for s in sorted(r.groups.values(), reverse=True))
            said.append(f"round {r.key} split into {len(r.groups)} groups ({sizes} peers)")
    training = [row for row in rows if row["trainers"] > 0]
    if len(training) == 1 and len(rows) > 1:
        # one daemon's trainers, no other's: whatever its rounds say, it steps alone
        only = training[0]
        said.append(
            f"only peer {only['address'] or only['peer_id'][:12]} has trainers reporting: "
            "it trains alone"
        )
    for row in rows:
        if row["alone"]:
            said.append(
                f"peer {row['address'] or row['peer_id'][:12]} is alone: its last "
                f"{ALONE_AFTER} rounds found no partner"
            )
    return said


def health_json(
    view: Mapping[str, Any], reports: Sequence[RoundReport], ignored: int
) -> dict[str, Any]:
    """The dashboard's snapshot of the swarm's health (``data.json``'s ``health``)."""
    rounds = round_health(reports)
    rows = peer_rows(view, reports)
    return {
        "peers": rows,
        "rounds": [r.to_json() for r in rounds],
        "alerts": alerts(rounds, rows),
        "ignored_reports": ignored,
    }


def round_totals(reports: Sequence[RoundReport]) -> dict[str, float]:
    """The run's round counters summed over its daemons (series for the charts)."""
    return {
        "rounds_done": float(sum(r.done for r in reports)),
        "rounds_partial": float(sum(r.partial for r in reports)),
        "rounds_failed": float(sum(r.failed for r in reports)),
    }


def _empty_row(peer_id: str) -> dict[str, Any]:
    return {
        "peer_id": peer_id,
        "address": None,
        "reachability": "unknown",
        "method": None,
        "trainers": 0,
        "epoch": None,
        "samples_per_second": None,
        "last_seen": None,
        "rounds_done": None,
        "rounds_partial": None,
        "rounds_failed": None,
        "failures": {},
        "last_round": None,
        "alone": False,
    }


def _entry_json(entry: RoundEntry) -> dict[str, Any]:
    return {
        "key": entry.key,
        "time": entry.time,
        "outcome": entry.outcome,
        "size": entry.size,
        "reason": entry.reason,
    }
