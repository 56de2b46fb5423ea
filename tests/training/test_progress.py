"""The progress tracker's pure logic: records, aggregation, rates, ETA (no daemon)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.run_records.progress import (
    MAX_EPOCH_LEAD,
    PeerProgress,
    aggregate,
    within_epoch_lead,
)
from swarmavg.averaging.training.progress import ProgressTracker, RateMeter


def rec(peer: str, epoch: int, samples: int, sps: float = 10.0) -> PeerProgress:
    return PeerProgress(peer, epoch, samples, sps, 1000.0)


def test_aggregate_counts_only_the_newest_epoch() -> None:
    progress = aggregate(
        [rec("a", 3, 20, 5.0), rec("b", 3, 30, 15.0), rec("c", 1, 100, 50.0)], target=100
    )
    assert progress.epoch == 3
    assert progress.samples == 50
    assert progress.num_peers == 2
    assert progress.samples_per_second == 20.0
    assert progress.eta == pytest.approx(50 / 20)
    assert not progress.ready
    assert progress.samples_per_peer() == {"a": 5.0, "b": 15.0, "c": 50.0}


def test_peers_one_epoch_behind_are_members_of_the_next_round() -> None:
    # right after a step, "b" has not reported epoch 4 yet: it will join round 4
    progress = aggregate([rec("a", 4, 8), rec("b", 3, 8), rec("c", 2, 8)], target=16)
    assert (progress.epoch, progress.samples, progress.num_peers) == (4, 8, 2)


def test_processes_of_one_daemon_count_as_one_peer() -> None:
    progress = aggregate([rec("a", 0, 40), rec("a", 0, 40), rec("b", 0, 20)], target=100)
    assert progress.num_peers == 2
    assert progress.num_processes == 3
    assert progress.ready
    assert progress.eta == 0.0


def test_eta_is_infinite_without_throughput_and_empty_swarm_is_epoch_zero() -> None:
    assert aggregate([rec("a", 1, 0, 0.0)], target=10).eta == math.inf
    empty = aggregate([], target=10)
    assert (empty.epoch, empty.samples, empty.num_peers) == (0, 0, 0)
    with pytest.raises(ValueError, match="positive"):
        aggregate([], target=0)


@pytest.mark.parametrize(
    "record",
    [
        None,
        [1, 2],
        {"peer": "a", "epoch": -1, "samples": 0, "sps": 0.0, "time": 0.0},
        {"peer": "a", "epoch": 1, "samples": 0, "sps": float("nan"), "time": 0.0},
        {"peer": "a", "epoch": True, "samples": 0, "sps": 0.0, "time": 0.0},
        {"peer": "", "epoch": 1, "samples": 0, "sps": 0.0, "time": 0.0},
        {"peer": "a", "epoch": 2**60, "samples": 0, "sps": 0.0, "time": 0.0},
        {"peer": "a", "epoch": 1, "samples": "3", "sps": 0.0, "time": 0.0},
        {"epoch": 1, "samples": 3, "sps": 0.0, "time": 0.0},
        {"peer": "a", "epoch": 1, "samples": 0, "sps": 0.0, "time": 0.0, "target": -1},
        {"peer": "a", "epoch": 1, "samples": 0, "sps": 0.0, "time": 0.0, "target": 1.5},
        {"peer": "a", "epoch": 1, "samples": 0, "sps": 0.0, "time": 0.0, "metrics": [1]},
        {"peer": "a", "epoch": 1, "samples": 0, "sps": 0.0, "time": 0.0, "metrics": {"l": "x"}},
        {"peer": "a", "epoch": 1, "samples": 0, "sps": 0.0, "time": 0.0, "metrics": {"l": 1e999}},
        {"peer": "a", "epoch": 1, "samples": 0, "sps": 0.0, "time": 0.0, "metrics": {"a b": 1}},
        {
            "peer": "a",
            "epoch": 1,
            "samples": 0,
            "sps": 0.0,
            "time": 0.0,
            "metrics": {f"m{i}": 1.0 for i in range(9)},
        },
    ],
)
def test_malformed_records_are_dropped(record: object) -> None:
    assert PeerProgress.from_record(record) is None


def test_record_round_trip() -> None:
    original = PeerProgress("ab12", 7, 96, 123.5, 1700000000.25)
    assert PeerProgress.from_record(original.to_record()) == original
    assert set(original.to_record()) == {"peer", "epoch", "samples", "sps", "time"}
    full = PeerProgress("ab12", 7, 96, 1.0, 1.0, target=4096, metrics=(("acc", 0.5), ("loss", 2)))
    assert full.to_record()["metrics"] == {"acc": 0.5, "loss": 2}
    assert PeerProgress.from_record(full.to_record()) == full


def test_rate_meter_smooths_and_pauses() -> None:
    meter = RateMeter(smoothing=0.5)
    meter.start(now=0.0)
    assert meter.update(10, now=1.0) == 10.0
    assert meter.update(30, now=2.0) == 20.0  # 10 + 0.5 * (30 - 10)
    meter.pause()
    assert meter.update(1000, now=50.0) == 20.0  # the paused interval is not counted
    assert meter.update(20, now=51.0) == 20.0
    with pytest.raises(ValueError, match="smoothing"):
        RateMeter(smoothing=0.0)


class DictDHT:
    """A DHT with the client's interface over one dict (the tracker's I/O seam)."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, Any]] = {}

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: str | None = None) -> bool:
        self.data.setdefault(key, {})[str(subkey)] = value
        return True

    def get(self, key: str) -> Any:
        return dict(self.data[key]) if key in self.data else None


class DictClient:
    def __init__(self, dht: DictDHT, peer_id: str) -> None:
        self.dht = dht
        self.peer_id = peer_id

    def status(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id}


def test_trackers_see_each_other_and_ignore_garbage() -> None:
    dht = DictDHT()
    a = ProgressTracker(DictClient(dht, "aa"), "run", target_batch_size=64)
    b = ProgressTracker(DictClient(dht, "bb"), "run", target_batch_size=64)
    assert a.peer_id == "aa"
    a.add_samples(16)
    a.report()
    b.add_samples(32)
    b.report()
    dht.store("run.progress", {"peer": "evil", "epoch": "x"}, subkey="evil.1")
    progress = a.refresh()
    assert (progress.epoch, progress.samples, progress.num_peers) == (0, 48, 2)
    b.set_epoch(1)
    b.report()
    progress = a.refresh()
    assert (progress.epoch, progress.samples, progress.num_peers) == (1, 0, 2)
    assert a.epoch == 0  # the tracker reports; catching up is the wrapper's decision


def test_a_process_that_left_no_longer_counts() -> None:
    dht = DictDHT()
    a = ProgressTracker(DictClient(dht, "aa"), "run", target_batch_size=64)
    b = ProgressTracker(DictClient(dht, "bb"), "run", target_batch_size=64)
    b.add_samples(32)
    b.report()
    assert a.refresh().num_peers == 2
    b.leave()
    progress = a.refresh()
    assert (progress.num_peers, progress.samples) == (1, 0)
    b.set_epoch(3)
    b.leave()
    progress = a.refresh()
    assert progress.epoch == 3  # the run got that far: "a" is behind and loads the state
    assert (progress.num_peers, progress.samples) == (0, 0)
    assert PeerProgress.from_record({**b.local.to_record(), "left": "yes"}) is None


def test_tracker_validates_arguments() -> None:
    client = DictClient(DictDHT(), "aa")
    with pytest.raises(ValueError, match="target_batch_size"):
        ProgressTracker(client, "run", 0)
    with pytest.raises(ValueError, match="run_id"):
        ProgressTracker(client, "", 8)
    tracker = ProgressTracker(client, "run", 8)
    with pytest.raises(ValueError, match="negative"):
        tracker.add_samples(-1)


def _at(peer: str, epoch: int) -> PeerProgress:
    return PeerProgress(peer, epoch, 1, 1.0, time.time())


def test_an_epoch_far_ahead_of_the_majority_is_ignored() -> None:
    honest = [_at("a", 5), _at("b", 5), _at("c", 6)]
    forged = [_at("evil", 2**53), _at("evil2", 6 + MAX_EPOCH_LEAD + 1)]
    kept, dropped = within_epoch_lead(honest + forged, own_epoch=5)
    assert (sorted(p.peer_id for p in kept), dropped) == (["a", "b", "c"], 2)
    # within the lead, a record ahead still counts (an honest peer one step further on)
    kept, dropped = within_epoch_lead([*honest, _at("d", 5 + MAX_EPOCH_LEAD)], own_epoch=5)
    assert dropped == 0


def test_a_newcomer_still_sees_the_veterans_epoch() -> None:
    veterans = [_at("v1", 1000), _at("v2", 1001), _at("evil", 2**50)]
    kept, dropped = within_epoch_lead(veterans, own_epoch=0)
    assert ({p.peer_id for p in kept}, dropped) == ({"v1", "v2"}, 1)
    assert aggregate([_at("me", 0), *kept], target=8).epoch == 1001


def test_the_tracker_ignores_a_forged_epoch_jump(caplog: pytest.LogCaptureFixture) -> None:
    dht = DictDHT()
    honest = [ProgressTracker(DictClient(dht, name), "run", target_batch_size=64) for name in "abc"]
    for tracker in honest:
        tracker.set_epoch(4)
        tracker.report()
    dht.store("run.progress", _at("evil", 2**53).to_record(), subkey="x[owner:evil]")
    progress = honest[0].refresh()
    assert (progress.epoch, progress.num_peers) == (4, 3)
    assert "ignoring 1" in caplog.text


def test_metrics_are_checked_when_set_and_sent_with_every_report() -> None:
    dht = DictDHT()
    tracker = ProgressTracker(DictClient(dht, "a"), "run", target_batch_size=64)
    tracker.set_metrics({"loss": np.float32(0.5), "ppl": 3})
    tracker.report()
    (stored,) = dht.data["run.progress"].values()
    assert (stored["metrics"], stored["target"]) == ({"loss": 0.5, "ppl": 3.0}, 64)
    with pytest.raises(ValueError, match="'loss' must be a finite number"):
        tracker.set_metrics({"loss": float("nan")})
    with pytest.raises(ValueError, match="at most 8 metrics"):
        tracker.set_metrics({f"m{i}": 1 for i in range(9)})
    with pytest.raises(ValueError, match="metric name 'a b'"):
        tracker.set_metrics({"a b": 1})
    assert tracker.metrics == (("loss", 0.5), ("ppl", 3.0))  # a refused call changes nothing
    tracker.set_metrics({})
    tracker.report()
    assert "metrics" not in next(iter(dht.data["run.progress"].values()))


class GatedDHT(DictDHT):
    """A DictDHT whose stores wait for ``gate`` (a slow DHT) and log what they stored."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.stored: list[tuple[int, int]] = []
        self.failures = 0  # the next stores that raise

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: str | None = None) -> bool:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        if self.failures:
            self.failures -= 1
            raise RuntimeError("DHT unreachable")
        self.stored.append((int(value["epoch"]), int(value["samples"])))
        return super().store(key, value, ttl, subkey)


@pytest.mark.timeout(30)
def test_report_soon_does_not_wait_for_the_dht_and_never_overtakes_a_later_report() -> None:
    dht = GatedDHT()
    tracker = ProgressTracker(DictClient(dht, "aa"), "run", target_batch_size=64)
    tracker.add_samples(4)
    tracker.report_soon()  # returns while the store is stuck behind the gate
    assert dht.entered.wait(10)
    assert dht.stored == []
    tracker.add_samples(4)
    tracker.report_soon()  # the first is still in flight: skipped, nothing queued
    tracker.set_epoch(1)
    dht.gate.set()
    assert tracker.report()  # waits for the one in flight first: the new epoch lands last
    assert dht.stored == [(0, 4), (1, 0)]
    assert dht.get("run.progress")[tracker.subkey]["epoch"] == 1
    tracker.leave()


@pytest.mark.timeout(30)
def test_a_failed_background_report_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dht = GatedDHT()
    dht.gate.set()
    dht.failures = 1  # only the background store fails; the next reports go through
    tracker = ProgressTracker(DictClient(dht, "aa"), "run", target_batch_size=64)
    tracker.report_soon()
    with caplog.at_level("WARNING"):
        assert tracker.report()
    assert "background progress report failed" in caplog.text
    assert dht.stored == [(0, 0)]
    tracker.leave()


class ReadOpensStores(GatedDHT):
    """A DHT whose stores go through only once a read has come: a tracker that waited for
    its store before reading would wait for ever (the test's timeout)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def get(self, key: str) -> Any:
        self.reads += 1
        answer = super().get(key)
        self.gate.set()
        return answer


@pytest.mark.timeout(30)
def test_report_and_refresh_reads_while_the_store_is_on_its_way() -> None:
    dht = ReadOpensStores()
    other = ProgressTracker(DictClient(DictDHT(), "bb"), "run", target_batch_size=64)
    other.add_samples(16)
    dht.data["run.progress"] = {other.subkey: other.local.to_record()}
    tracker = ProgressTracker(DictClient(dht, "aa"), "run", target_batch_size=64)
    tracker.add_samples(8)
    progress = tracker.report_and_refresh()
    assert dht.reads == 1
    assert (progress.samples, progress.num_peers) == (24, 2)  # its own record from memory
    assert dht.stored == [(0, 8)]  # stored before the call returned
    assert tracker.last is progress
    tracker.leave()


@pytest.mark.timeout(30)
def test_report_and_refresh_stores_after_a_report_in_flight_and_raises_a_failed_store() -> None:
    dht = ReadOpensStores()
    tracker = ProgressTracker(DictClient(dht, "aa"), "run", target_batch_size=64)
    tracker.add_samples(4)
    tracker.report_soon()  # held at the gate until the read below
    assert dht.entered.wait(10)
    tracker.set_epoch(1)
    tracker.report_and_refresh()
    assert dht.stored == [(0, 4), (1, 0)]  # never an older record last
    dht.failures = 1
    with pytest.raises(RuntimeError, match="DHT unreachable"):
        tracker.report_and_refresh()  # as report() would, once the read is done
    assert dht.reads == 2
    tracker.leave()


@pytest.mark.timeout(30)
def test_report_soon_skips_reports_within_its_interval_but_never_a_latest_one() -> None:
    dht = GatedDHT()
    dht.gate.set()
    tracker = ProgressTracker(DictClient(dht, "aa"), "run", 64, soon_interval=3600.0)
    tracker.add_samples(4)
    first = tracker.report_soon()
    assert first is not None
    first.result(10)
    tracker.add_samples(4)
    assert tracker.report_soon() is None  # nothing in flight, but within the interval
    tracker.set_epoch(1)
    latest = tracker.report_soon(latest=True)  # a new epoch is never skipped
    assert latest is not None
    latest.result(10)
    assert dht.stored == [(0, 4), (1, 0)]
    tracker.leave()
    # no interval: every report goes through once the previous one landed
    every = ProgressTracker(DictClient(dht, "bb"), "run", 64, soon_interval=0.0)
    for _ in range(3):
        every.add_samples(1)
        future = every.report_soon()
        assert future is not None
        future.result(10)
    assert dht.stored[-3:] == [(0, 1), (0, 2), (0, 3)]
    every.leave()
    with pytest.raises(ValueError, match="soon_interval"):
        ProgressTracker(DictClient(dht, "cc"), "run", 64, soon_interval=-1.0)
