"""The dashboard's view of the swarm's health, with real daemons, real rounds and the real
page in headless Chromium: the per-peer table, a round that split into two groups, a peer
whose rounds find no partner, a time axis on every chart, and the training figures greyed as
stale once the trainers have left.

Four ``swarmavg peer`` daemons on 127.0.0.1. A round under one key with ``group_size=2``
and all four daemons in it must form two groups (a group holds at most two): exactly the
split an organiser must see. Then one daemon averages alone twice (nobody else uses its
keys): two rounds without a group, a stranded trainer. The page is saved as a PNG in the
test's temporary folder (``dashboard.png``) for a reader to look at.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.peer import connect
from swarmavg.peer.client.errors import NoGroupError
from tests.browser import Browser, chromium_or_skip
from tests.harness import ProcessPool, SwarmavgProcess
from tests.integration.test_monitor_dashboard import get_json, start_peers, wait_until

pytestmark = pytest.mark.integration
RUN = "health-run"

HEALTH_JS = (
    "JSON.stringify(document.body ? {"
    "updates: +document.body.dataset.updates,"
    "peers: [...document.querySelectorAll('tr.peer')].map(r => ({id: r.dataset.peer,"
    " cells: [...r.cells].map(c => c.textContent)})),"
    "rounds: [...document.querySelectorAll('tr.round')].map(r => ({key: r.dataset.key,"
    " sizes: JSON.parse(r.dataset.sizes), split: r.dataset.split === '1'})),"
    "alerts: [...document.querySelectorAll('li.alert')].map(l => l.textContent),"
    "plots: Object.fromEntries([...document.querySelectorAll('figure.plot')].map(f => "
    "[f.dataset.series, {axis: JSON.parse(f.dataset.axis || '[]'), stale: f.dataset.stale,"
    " caption: f.querySelector('figcaption span')?.textContent ?? ''}]))"
    "} : {updates: 0, peers: [], rounds: [], alerts: [], plots: {}})"
)
CLOCK = re.compile(r"\d\d:\d\d:\d\d")


@pytest.fixture
def swarm(swarmavg_processes: ProcessPool, tmp_path: Path) -> Iterator[list[SwarmavgProcess]]:
    return start_peers(swarmavg_processes, tmp_path, RUN, 4)


def average(control: str, key: str, timeout: float) -> Any:
    with connect(control, use_shm=False) as client:
        try:
            return client.average([np.ones(64, np.float32)], key, group_size=2, timeout=timeout)
        except NoGroupError as exc:
            return exc


@pytest.mark.timeout(240)
def test_the_dashboard_shows_peers_a_split_round_a_lone_peer_and_stale_figures(
    swarm: list[SwarmavgProcess], swarmavg_processes: ProcessPool, tmp_path: Path
) -> None:
    chromium = chromium_or_skip()
    monitor = swarmavg_processes.start(
        ["monitor", "--run-id", RUN, "--initial-peers", swarm[1].address,
         "--interval", "0.3", "--http", "127.0.0.1:0"]
    )  # fmt: skip
    url = monitor.ready["dashboard"]
    controls = [d.control for d in swarm]
    # trainers on two daemons report progress, so that the page has figures to grey later
    clients = [connect(c, use_shm=False) for c in controls[:2]]
    trackers = [ProgressTracker(c, RUN, 10_000, ttl=60.0) for c in clients]
    for tracker in trackers:
        tracker.add_samples(32)
        tracker.report()
    # one round, four daemons, groups of at most two: two groups under one key
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: average(c, "step-1", 30.0), controls))
    sizes = sorted(r.group_size for r in results if not isinstance(r, Exception))
    assert sizes == [2, 2, 2, 2], results
    # one daemon alone: nobody else averages these keys
    for key in ("solo-1", "solo-2"):
        assert isinstance(average(controls[3], key, 2.0), NoGroupError)

    data = wait_until(
        lambda: (
            (d := get_json(url + "data.json"))["health"].get("alerts", [])
            and len(d["health"]["alerts"]) >= 2
            and d
        ),
        "the monitor to see the split and the lone peer",
    )
    assert data["series"]["rounds_done"][-1] == 4.0

    browser = Browser(chromium)
    try:
        browser.open(url)
        browser.set_viewport(1280, 1500)

        def page() -> dict[str, Any]:
            return dict(json.loads(browser.evaluate(HEALTH_JS)))

        shown = wait_until(
            lambda: len((p := page())["peers"]) == 4 and len(p["alerts"]) >= 2 and p,
            "the page to show four peers and the alerts",
        )
        by_key = {r["key"]: r for r in shown["rounds"]}
        assert by_key["step-1"] == {"key": "step-1", "sizes": [2, 2], "split": True}
        assert by_key["solo-2"]["sizes"] == []
        assert any("round step-1 split into 2 groups (2 + 2 peers)" in a for a in shown["alerts"])
        lone = swarm[3].ready["peer_id"]
        assert (
            f"peer {swarm[3].address} is alone: its last 2 rounds found no partner"
            in (shown["alerts"])
        )
        rows = {r["id"]: r["cells"] for r in shown["peers"]}
        assert set(rows) == {d.ready["peer_id"] for d in swarm}
        # peer, address, reachability, trainers, epoch, samples/s, last seen, done, partial,
        # failed, last round
        assert rows[lone][1] == swarm[3].address
        assert rows[lone][2] == "public"
        assert (rows[lone][7], rows[lone][9]) == ("1", "2 (no_group 2)")
        assert rows[lone][10].startswith("solo-2: failed, no_group at ")
        trainer = rows[swarm[0].ready["peer_id"]]
        assert (trainer[3], trainer[4], trainer[7], trainer[9]) == ("1", "0", "1", "0")
        assert trainer[6].endswith("s ago")
        for name, plot in shown["plots"].items():  # a wall-clock axis on every chart
            assert len(plot["axis"]) >= 3, name
            assert all(CLOCK.fullmatch(x) for x in plot["axis"]), name
        assert shown["plots"]["epoch"]["stale"] == "0"

        # the trainers stop: their figures stay on the page, greyed, "stale since ..."
        for tracker in trackers:
            tracker.leave()
        stale = wait_until(
            lambda: (p := page())["plots"]["samples_per_second"]["stale"] == "1" and p,
            "the page to grey the training figures",
        )
        assert stale["plots"]["epoch"]["stale"] == "1"
        assert re.search(r"\(stale since \d\d:\d\d:\d\d\)", stale["plots"]["epoch"]["caption"])
        assert stale["plots"]["peers"]["stale"] == "0"  # the daemons still run
        updates = stale["updates"]
        wait_until(lambda: page()["updates"] > updates + 1, "two more redraws")
        browser.screenshot(tmp_path / "dashboard.png")
    finally:
        browser.close()
        for client in clients:
            client.close()
    monitor.signal(signal.SIGINT)
    assert monitor.wait(timeout=15) == 0, monitor.stderr()
