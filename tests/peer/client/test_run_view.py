"""The run's view (``swarmavg peers``) built from records and a routing table (pure)."""

from __future__ import annotations

import pytest

from swarmavg.averaging.run_records.progress import PeerProgress
from swarmavg.peer.cli.peers_table import format_peers
from swarmavg.peer.client.run_view import (
    Neighbour,
    ThisPeer,
    build_view,
    progress_keys,
    view_to_dict,
)

NOW = 10_000.0


def rec(peer: str, epoch: int, samples: int, sps: float, age: float, **kw: object) -> PeerProgress:
    return PeerProgress(peer, epoch, samples, sps, NOW - age, **kw)  # type: ignore[arg-type]


def test_progress_keys_are_the_wrappers_keys() -> None:
    assert progress_keys("r") == {"collaborative": "r.progress", "diloco": "r.diloco.progress"}


def test_rows_join_records_with_the_routing_table() -> None:
    records = {
        "collaborative": [
            rec("aa", 5, 10, 1.0, 2.0, target=100, metrics=(("loss", 1.5),)),
            rec("aa", 5, 20, 2.0, 1.0, target=100),  # a second process of the same daemon
            rec("bb", 4, 99, 9.0, 3.0, target=100),  # one epoch behind: a member, not counted
            rec("cc", 5, 0, 0.0, 1.0, left=True),  # left: says the epoch, nothing else
            rec("dd", 5, 30, 3.0, 4.0, target=50),
        ],
        "diloco": [],
    }
    neighbours = [Neighbour("bb", "10.0.0.2:1", 0.5), Neighbour("ee", "10.0.0.5:1", 7.0)]
    view = view_to_dict(
        build_view("r", ThisPeer("aa", "10.0.0.1:1"), neighbours, records, NOW, ignored=2)
    )
    (progress,) = view["progress"]
    assert progress == {
        "method": "collaborative",
        "epoch": 5,
        "samples": 60,
        "target": 100,  # what most records at the epoch say
        "samples_per_second": 6.0,
        "eta": pytest.approx(40 / 6.0),
        "peers": 3,
    }
    rows = {r["peer_id"]: r for r in view["peers"]}
    assert [r["peer_id"] for r in view["peers"]] == ["aa", "bb", "dd", "ee"]
    assert rows["aa"]["this_peer"]
    assert rows["aa"]["address"] == "10.0.0.1:1"
    assert (rows["aa"]["processes"], rows["aa"]["samples"], rows["aa"]["samples_per_second"]) == (
        2,
        30,
        3.0,
    )
    assert rows["aa"]["metrics"] == {"loss": 1.5}
    assert (rows["bb"]["mode"], rows["bb"]["last_seen"], rows["bb"]["epoch"]) == ("full", 0.5, 4)
    assert (rows["dd"]["mode"], rows["dd"]["address"], rows["dd"]["last_seen"]) == (
        "client",
        None,
        4.0,
    )
    assert (rows["ee"]["method"], rows["ee"]["epoch"], rows["ee"]["last_seen"]) == (None, None, 7.0)
    assert view["ignored_records"] == 2
    table = format_peers(view)
    assert (
        "run r (collaborative): epoch 5, 60/100 samples, 6.0 samples/s, next step in 7 s" in table
    )
    assert "(2 malformed or implausible record(s) ignored)" in table


def test_eta_is_unknown_without_a_target_or_without_progress() -> None:
    old = {"collaborative": [rec("bb", 1, 5, 1.0, 0.0)]}  # a writer that sends no target
    stalled = {"diloco": [rec("bb", 1, 5, 0.0, 0.0, target=10)]}
    for records in (old, stalled):
        view = view_to_dict(build_view("r", ThisPeer("aa", None), [], records, NOW))
        assert view["progress"][0]["eta"] is None
        assert view["peers"][0] == {**view["peers"][0], "peer_id": "aa", "mode": "client"}
        assert "next step: unknown" in format_peers(view)
