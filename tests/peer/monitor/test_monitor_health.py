"""Round reports and the swarm's health on the dashboard, without a swarm: the record's
round trip and its checks against hostile input, the split and alone verdicts, the per-peer
rows, and the daemon-side publisher against a real in-memory store loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from swarmavg.peer.daemon.round_reports import (
    RECENT_ROUNDS,
    RoundEntry,
    RoundLog,
    RoundReport,
    parse_reports,
    publish_rounds,
    rounds_key,
)
from swarmavg.peer.monitor.health import alerts, health_json, peer_rows, round_health
from swarmavg.peer.monitor.series import History, Sample, sample_from_view

pytestmark = pytest.mark.timeout(60)

A, B, C, D = ("a" * 40, "b" * 40, "c" * 40, "d" * 40)


def entry(key: str, t: float, group: str = "", size: int = 0, reason: str = "") -> list[Any]:
    outcome = "failed" if reason else "ok"
    return RoundEntry(key, t, outcome, group, size, reason).to_record()


def report(peer: str, *entries: list[Any], failed: int = 0, **failures: int) -> dict[str, Any]:
    done = sum(1 for e in entries if e[2] != "failed")
    return {
        "peer": peer,
        "time": 100.0,
        "done": done,
        "partial": 0,
        "failed": failed,
        "failures": failures,
        "recent": list(entries),
    }


def owned(*records: dict[str, Any]) -> dict[str, Any]:
    return {f"[owner:{r['peer']}]": r for r in records}


def test_a_round_log_reports_what_it_counted_and_round_trips() -> None:
    log = RoundLog()
    log.round_done("step-1", "ab" * 20, 3, partial=False)
    log.round_done("step-2", "cd" * 20, 2, partial=True)
    log.round_failed("step-3", "no_group")
    for i in range(RECENT_ROUNDS + 5):
        log.round_failed(f"k{i}", f"reason{i}")  # more reasons than a report counts apart
    record = log.report(A).to_record()
    parsed = RoundReport.from_record(record)
    assert parsed is not None
    assert (parsed.done, parsed.partial, parsed.failed) == (2, 1, RECENT_ROUNDS + 6)
    assert len(parsed.recent) == RECENT_ROUNDS
    assert len(parsed.failures) == 16
    assert parsed.failures["other"] == RECENT_ROUNDS + 6 - 15
    assert log.version == RECENT_ROUNDS + 8


@pytest.mark.parametrize(
    "hostile",
    [
        "not a map",
        {"peer": A},
        report(A) | {"done": -1},
        report(A) | {"done": True},
        report(A) | {"time": float("nan")},
        report(A) | {"recent": [entry("k", 1.0)] * (RECENT_ROUNDS + 1)},
        report(A) | {"recent": [["k", 1.0, "exploded", "", 0, ""]]},
        report(A) | {"recent": [["x" * 10_000, 1.0, "ok", "g", 2, ""]]},
        report(A) | {"failures": {str(i): 1 for i in range(100)}},
        report(A) | {"peer": "A" * 39},
    ],
)
def test_a_malformed_report_is_ignored(hostile: Any) -> None:
    reports, ignored = parse_reports({f"[owner:{A}]": hostile, f"[owner:{B}]": report(B)})
    assert ([r.peer_id for r in reports], ignored) == ([B], 1)


def test_a_report_that_speaks_for_another_daemon_is_ignored() -> None:
    reports, ignored = parse_reports({f"[owner:{A}]": report(B)})
    assert (reports, ignored) == ([], 1)
    assert parse_reports(None) == ([], 0)


def test_two_groups_under_one_round_key_are_a_split() -> None:
    reports, _ = parse_reports(
        owned(
            report(A, entry("step-1", 10.0, "g1", 2), entry("step-2", 20.0, "g3", 4)),
            report(B, entry("step-1", 10.5, "g1", 2), entry("step-2", 20.0, "g3", 4)),
            report(C, entry("step-1", 11.0, "g2", 2), entry("step-2", 20.0, "g3", 4)),
            report(D, entry("step-1", 11.0, "g2", 2), entry("step-2", 21.0, "g3", 4)),
        )
    )
    newest, older = round_health(reports)
    assert (newest.key, newest.split, newest.done) == ("step-2", False, 4)
    assert (older.key, older.split, older.to_json()["group_sizes"]) == ("step-1", True, [2, 2])
    assert alerts([newest, older], []) == ["round step-1 split into 2 groups (2 + 2 peers)"]


def test_a_daemon_whose_rounds_find_no_partner_is_alone() -> None:
    lonely = report(
        C,
        entry("step-1", 1.0, reason="no_group"),
        entry("step-2", 2.0, "g9", 1),
        failed=1,
        no_group=1,
    )
    fine = report(A, entry("step-1", 1.0, reason="no_group"), entry("step-2", 2.0, "g1", 2))
    reports, _ = parse_reports(owned(lonely, fine))
    view = {
        "peers": [
            {"peer_id": "m" * 40, "this_peer": True},
            {
                "peer_id": A,
                "this_peer": False,
                "address": "127.0.0.1:1",
                "mode": "full",
                "method": "collaborative",
                "epoch": 3,
                "samples_per_second": 10.0,
                "processes": 2,
                "last_seen": 1.5,
            },
        ]
    }
    rows = peer_rows(view, reports)
    assert [r["peer_id"] for r in rows] == [A, C]  # C: seen only through its report
    a, c = rows
    assert (a["reachability"], a["epoch"], a["trainers"], a["rounds_done"]) == (
        "public",
        3,
        2,
        1,
    )
    assert (c["address"], c["alone"], c["rounds_failed"], c["failures"]) == (
        None,
        True,
        1,
        {"no_group": 1},
    )
    health = health_json(view, reports, 0)
    assert (
        health["alerts"]
        == [
            "round step-2 split into 2 groups (2 + 1 peers)",  # C ran it in a group of one
            "only peer 127.0.0.1:1 has trainers reporting: it trains alone",
            f"peer {C[:12]} is alone: its last 2 rounds found no partner",
        ]
    )
    assert health["rounds"][0]["failures"] == {}
    assert health["rounds"][1]["failures"] == {"no_group": 2}


def test_training_figures_leave_the_sample_when_no_trainer_reports() -> None:
    # the trainers left: their last records still name an epoch and an ETA
    view = {
        "ignored_records": 0,
        "progress": [{"epoch": 4, "samples_per_second": 30.0, "eta": 0.2193}],
        "peers": [
            {"peer_id": A, "method": None, "processes": 0, "metrics": {}, "this_peer": False}
        ],
    }
    assert sample_from_view(view, 1.0).values == {
        "peers": 1.0,
        "trainers": 0.0,
        "ignored_records": 0.0,
    }


class Store:
    """What the publisher stores, one event per store (a DHT stand-in for the daemon's
    side alone; the monitor's end-to-end test runs real daemons)."""

    def __init__(self) -> None:
        self.stored: asyncio.Queue[tuple[str, Any, Any]] = asyncio.Queue()

    async def store(self, key: str, value: Any, expiration: float, subkey: Any = None) -> bool:
        await self.stored.put((key, value, subkey))
        return True


async def test_the_daemon_publishes_its_report_when_a_round_ends() -> None:
    store, log = Store(), RoundLog()
    task = asyncio.create_task(publish_rounds(store, "run", A, log, check_every=0.01))
    try:
        key, value, subkey = await asyncio.wait_for(store.stored.get(), 10)
        assert (key, subkey, value["done"]) == (rounds_key("run"), f"[owner:{A}]", 0)
        log.round_done("step-1", "g", 2, partial=False)
        _, value, _ = await asyncio.wait_for(store.stored.get(), 10)
        assert [e[0] for e in value["recent"]] == ["step-1"]
        assert store.stored.empty()  # nothing new: nothing stored until the refresh
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_the_history_says_when_each_series_last_had_a_value() -> None:
    history = History("r")
    history.add(Sample(1.0, {"peers": 2.0, "eta": 0.2193}))
    history.add(Sample(2.0, {"peers": 2.0}))  # the trainers left: no ETA any more
    history.add(Sample(3.0, {"peers": 1.0}))
    data = history.to_json()
    assert data["updated"] == {"peers": 3.0, "eta": 1.0}
    assert data["series"]["eta"] == [0.2193, None, None]


def test_the_only_daemon_with_trainers_is_reported_as_training_alone() -> None:
    def peer(peer_id: str, method: str | None, processes: int) -> dict[str, Any]:
        return {
            "peer_id": peer_id,
            "this_peer": False,
            "address": f"10.0.0.{processes}:1",
            "mode": "full",
            "method": method,
            "epoch": 1 if method else None,
            "samples_per_second": 1.0 if method else None,
            "processes": processes,
            "last_seen": 0.0,
        }

    alone = {"peers": [peer(A, "collaborative", 1), peer(B, None, 0)]}
    assert health_json(alone, [], 0)["alerts"] == [
        "only peer 10.0.0.1:1 has trainers reporting: it trains alone"
    ]
    together = {"peers": [peer(A, "collaborative", 1), peer(B, "collaborative", 2)]}
    assert health_json(together, [], 0)["alerts"] == []
