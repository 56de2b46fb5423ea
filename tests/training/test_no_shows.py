"""A daemon the progress records name but that stopped coming is waited for once.

Without this, a killed daemon's records (ttl 30 s) kept every trainer's ``group_size`` one
too high, and each round waited out the whole matchmaking window for it (docs/training.md,
"When a peer dies").
"""

from __future__ import annotations

import pytest

from swarmavg.averaging.run_records.progress import PeerProgress
from swarmavg.averaging.training.no_shows import NoShows
from swarmavg.averaging.training.progress import ProgressTracker
from tests.training.memswarm import MemorySwarm


def rec(peer: str, time: float, epoch: int = 0) -> PeerProgress:
    return PeerProgress(peer, epoch, 4, 1.0, time)


def test_a_missing_daemon_stops_counting_until_it_reports_anew() -> None:
    no_shows = NoShows()
    assert no_shows.note({"aa": 10.0, "bb": 11.0, "cc": 12.0}, ["aa", "bb"]) == ["cc"]
    assert no_shows.note({"aa": 10.0, "cc": 12.0}, ["aa"]) == []  # already known
    records = [rec("aa", 20.0), rec("bb", 21.0), rec("cc", 12.0)]
    assert [p.peer_id for p in no_shows.admitted(records)] == ["aa", "bb"]
    assert "cc" in no_shows
    # A record newer than the one it was expected on: it is alive, it counts again.
    assert [p.peer_id for p in no_shows.admitted([*records, rec("cc", 12.5)])] == [
        "aa",
        "bb",
        "cc",
        "cc",
    ]
    assert len(no_shows) == 0


def test_a_daemon_whose_records_expired_is_forgotten() -> None:
    no_shows = NoShows()
    no_shows.note({"aa": 1.0, "cc": 2.0}, ["aa"])
    assert no_shows.admitted([rec("aa", 5.0)]) == [rec("aa", 5.0)]
    assert len(no_shows) == 0  # the memory is never larger than the records


def test_the_tracker_counts_without_the_no_show_and_with_it_once_it_reports() -> None:
    swarm = MemorySwarm()
    trackers = {
        name: ProgressTracker(swarm.client(name), "run", target_batch_size=64) for name in "abc"
    }
    for tracker in trackers.values():
        tracker.report()
    a = trackers["a"]
    progress = a.refresh()
    assert progress.num_peers == 3
    assert set(progress.members()) == {"a", "b", "c"}
    a.no_shows.note(progress.members(), ["a", "b"])  # a round closed without c
    assert a.refresh().num_peers == 2
    trackers["c"].report()  # c is alive after all (it was loading state, say)
    assert a.refresh().num_peers == 3


torch = pytest.importorskip("torch")

from tests.training.helpers import (  # noqa: E402
    linear_model,
    run_in_threads,
    sgd_collaborative,
    train_until,
)


def test_a_dead_peer_is_waited_for_in_one_round_only() -> None:
    swarm = MemorySwarm()
    peers = []
    for name in "abc":
        model = linear_model()
        opt = sgd_collaborative(
            model,
            swarm.client(name),
            run_id="run",
            target_batch_size=4 * 3,
            averaging_timeout=3.0,  # a round without c waits this long for it
        )
        peers.append((model, opt))
    run_in_threads(*(lambda m=m, o=o: train_until(m, o, 0, 2) for m, o in peers))
    died = len(swarm.calls)
    # c dies: it stops training, and its records stay in the DHT until their ttl (30 s).
    live = peers[:2]
    run_in_threads(*(lambda m=m, o=o: train_until(m, o, 0, 6) for m, o in live))
    asked = [size for _, _, _, size in swarm.calls[died:]]
    # Each of a and b expected c in one round (the one that found it gone), not in every
    # round until c's records expired or fell two epochs behind.
    assert asked.count(3) == 2, asked
    assert asked.count(2) >= 4, asked
    assert all("c" in o.link.no_shows for _, o in live)
    for _, o in peers:
        o.close()
