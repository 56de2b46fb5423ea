"""When a trainer says it is alone, and the trainer entries that name the training runs
(pure: no daemon)."""

from __future__ import annotations

import math

import pytest

from swarmavg.averaging.run_records.trainers import (
    LocalTrainers,
    TrainerEntry,
    describe_runs,
    runs_by_daemon,
    training_runs,
)
from swarmavg.averaging.training.company import CompanyWatch, Event


def test_a_trainer_that_never_met_anyone_says_so_once() -> None:
    watch = CompanyWatch(alone_after=60.0, stalled_after=math.inf, started=0.0)
    assert watch.update(False, 0, 59.0) is None
    assert watch.update(False, 1, 60.0) is Event.NEVER_MET
    assert watch.alone_for(75.0) == 75.0
    assert [watch.update(False, e, 61.0 + e) for e in range(100)] == [None] * 100


def test_a_trainer_whose_company_left_says_so_and_when_it_comes_back() -> None:
    watch = CompanyWatch(alone_after=30.0, stalled_after=math.inf, started=0.0)
    assert watch.update(True, 0, 1.0) is None
    assert watch.alone_for(1.0) == 0.0
    assert watch.update(False, 1, 100.0) is None  # the others just left
    assert watch.update(False, 2, 129.0) is None
    assert watch.update(False, 3, 130.0) is Event.LEFT_ALONE
    assert watch.update(True, 4, 131.0) is Event.COMPANY
    assert watch.update(True, 5, 132.0) is None
    assert watch.update(False, 6, 140.0) is None  # a new absence counts from its start
    assert watch.update(False, 6, 170.0) is Event.LEFT_ALONE


def test_no_global_step_for_long_is_said_once_per_epoch() -> None:
    watch = CompanyWatch(alone_after=math.inf, stalled_after=300.0, started=0.0)
    assert watch.update(True, 0, 0.0) is None
    assert watch.update(True, 0, 299.0) is None
    assert watch.update(True, 0, 300.0) is Event.STALLED
    assert watch.update(True, 0, 900.0) is None
    assert watch.update(True, 1, 901.0) is None
    assert watch.update(True, 1, 1201.0) is Event.STALLED
    with pytest.raises(ValueError, match="positive"):
        CompanyWatch(alone_after=0.0)


def entry(run: str, alone: float = 0.0, when: float = 1.0) -> dict[str, object]:
    return TrainerEntry(run, "collaborative", alone, when).to_record()


def test_training_runs_are_counted_and_malformed_entries_skipped() -> None:
    raw = {
        "a": entry("my-run"),
        "b": entry("my-run", alone=70.0),
        "c": entry("my_run", alone=65.0),
        "d": {"run": "", "method": "x", "alone": 0, "time": 1},
        "e": {"run": "r", "method": "x", "alone": -1, "time": 1},
        "f": {"run": "r", "method": "x", "alone": math.nan, "time": 1},
        "g": "not an entry",
        "h": {"run": "x" * 129, "method": "x", "alone": 0, "time": 1},
    }
    runs = training_runs(raw)
    assert [(r.run, r.trainers, r.alone) for r in runs] == [("my-run", 2, 1), ("my_run", 1, 1)]
    assert describe_runs(runs) == "'my-run' (2 trainers), 'my_run' (1 trainer)"
    assert describe_runs([]) == "none"
    assert training_runs(None) == []


def test_a_daemon_keeps_its_local_trainers_until_they_expire_and_bounds_them() -> None:
    local = LocalTrainers(limit=2)
    local.remember("s1", entry("a"), expires=10.0)
    local.remember("s1", entry("a", alone=5.0), expires=20.0)  # a refresh replaces
    local.remember("s2", "garbage", expires=20.0)
    assert [(t.run, t.alone) for t in local.live(5.0)] == [("a", 5.0)]
    local.remember("s2", entry("b"), expires=10.0)
    local.remember("s3", entry("c"), expires=30.0)  # over the limit: the oldest goes
    assert [t.run for t in local.live(5.0)] == ["b", "c"]
    assert [t.run for t in local.live(15.0)] == ["c"]


class StatusOnly:
    def __init__(self, status: dict[str, object]) -> None:
        self._status = status

    def status(self) -> dict[str, object]:
        return self._status


def test_a_wrappers_run_is_its_daemons_unless_given() -> None:
    pytest.importorskip("torch")
    from swarmavg.averaging.training.base import resolve_run

    daemon = StatusOnly({"peer_id": "ab", "run_id": "my-run"})
    assert resolve_run(daemon, None) == "my-run"
    assert resolve_run(daemon, "other-run") == "other-run"
    with pytest.raises(ValueError, match="must not be empty"):
        resolve_run(daemon, "")
    with pytest.raises(ValueError, match="names no run_id"):
        resolve_run(StatusOnly({"peer_id": "ab"}), None)
    with pytest.raises(ValueError, match="every rank"):
        resolve_run(None, None)


def test_the_runs_of_each_daemon_come_from_its_entries_subkeys() -> None:
    raw = {
        "x1[owner:aa]": entry("my-run"),
        "x2[owner:aa]": entry("my_run"),
        "x3[owner:bb]": entry("my_run"),
        "unowned": entry("my-run"),
        "x4[owner:cc]": "garbage",
    }
    assert runs_by_daemon(raw) == {"aa": {"my-run", "my_run"}, "bb": {"my_run"}}
    assert runs_by_daemon(None) == {}
