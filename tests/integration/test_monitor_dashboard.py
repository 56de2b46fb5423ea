"""``swarmavg monitor`` against a real swarm, its dashboard in a real headless browser:
it loads, shows the plots with real data from a running swarm, and updates.

Two ``swarmavg peer`` daemons on 127.0.0.1; two trainers report progress and a falling loss
through real clients (:class:`ProgressTracker`, the part of the wrappers that writes the
records, metrics included); the monitor runs as a real process and the page is loaded in
Debian's Chromium, driven through the DevTools protocol (tests/browser.py).
"""

from __future__ import annotations

import csv
import json
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.peer import connect
from tests.browser import Browser, find_chromium
from tests.harness import ProcessPool, SwarmavgProcess

pytestmark = pytest.mark.integration
RUN = "monitor-run"
CHROMIUM = find_chromium()

# Guarded: the first evaluations can run before the page has a body (CI saw `document.body`
# null once) or while a plot's caption is being built; those read as "nothing plotted yet".
PLOTS_JS = (
    "JSON.stringify(document.body ? {updates: +document.body.dataset.updates, plots: "
    "Object.fromEntries([...document.querySelectorAll('figure.plot')].map(f => "
    "[f.dataset.series, {points: +f.dataset.points, "
    "last: f.querySelector('figcaption span')?.textContent ?? ''}]))} : {updates: 0, plots: {}})"
)
INKED_JS = (
    "(() => { const c = document.querySelector('figure[data-series=\"metric/loss\"] canvas');"
    " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;"
    " for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; })()"
)


def wait_until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll ``check`` until it returns something truthy (records and polls travel between
    processes: there is no event to wait on across them)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Trainers:
    """Training processes' reports in a thread: samples grow, the loss falls."""

    def __init__(self, controls: list[str]) -> None:
        self.clients = [connect(c, use_shm=False) for c in controls]
        self.trackers = [ProgressTracker(c, RUN, 10_000, ttl=60.0) for c in self.clients]
        self.stop = threading.Event()
        self.reports = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.reports += 1
                for i, tracker in enumerate(self.trackers):
                    tracker.add_samples(8)
                    tracker.set_metrics({"loss": 2.0 / (1 + self.reports) + i * 0.1})
                    tracker.report()
                self.stop.wait(0.2)
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc

    def __enter__(self) -> Trainers:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for client in self.clients:
            client.close()


def start_peers(pool: ProcessPool, folder: Path, run: str, n: int) -> list[SwarmavgProcess]:
    """``n`` daemons of ``run`` on 127.0.0.1, each joining the first."""

    def start(name: str, *extra: str) -> SwarmavgProcess:
        control = str(folder / f"{name}.sock")
        return pool.start(
            ["peer", "--listen", "127.0.0.1:0", "--control", control, "--run-id", run, *extra]
        )

    first = start("p0")
    return [first, *(start(f"p{i}", "--join", first.address) for i in range(1, n))]


@pytest.fixture
def swarm(swarmavg_processes: ProcessPool, tmp_path: Path) -> Iterator[list[SwarmavgProcess]]:
    return start_peers(swarmavg_processes, tmp_path, RUN, 2)


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return dict(json.loads(answer.read()))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
@pytest.mark.timeout(180)
def test_dashboard_shows_the_swarm_and_updates_in_a_browser(
    swarm: list[SwarmavgProcess], swarmavg_processes: ProcessPool, tmp_path: Path
) -> None:
    assert CHROMIUM is not None
    csv_path = tmp_path / "run.csv"
    with Trainers([d.control for d in swarm]) as trainers:
        monitor = swarmavg_processes.start(
            [
                "monitor",
                "--run-id",
                RUN,
                "--initial-peers",
                swarm[1].address,
                "--interval",
                "0.3",
                "--http",
                "127.0.0.1:0",
                "--csv",
                str(csv_path),
            ]
        )
        url = monitor.ready["dashboard"]
        assert url.startswith("http://127.0.0.1:")
        # the monitor's own view: both daemons and both trainers, loss and throughput
        data = wait_until(
            lambda: (d := get_json(url + "data.json"))["series"].get("metric/loss") and d,
            "the monitor to read the loss",
        )
        assert set(data["series"]) >= {"peers", "trainers", "epoch", "samples_per_second"}

        browser = Browser(CHROMIUM)
        try:
            browser.open(url)

            def plots() -> dict[str, Any]:
                return dict(json.loads(browser.evaluate(PLOTS_JS)))

            first = wait_until(
                lambda: (p := plots())["plots"].get("metric/loss", {}).get("points", 0) >= 2 and p,
                "the page to plot the loss",
            )
            assert {"peers", "trainers", "samples_per_second", "metric/loss"} <= set(first["plots"])
            # real data: the swarm's two daemons, both trainers, a loss between theirs
            wait_until(lambda: plots()["plots"]["peers"]["last"] == "2", "2 peers on the page")
            assert plots()["plots"]["trainers"]["last"] == "2"
            assert 0 < float(plots()["plots"]["metric/loss"]["last"]) < 2.1
            assert browser.evaluate(INKED_JS) > 50  # the line is drawn on the canvas
            # and it updates by itself: more polls drawn, more points
            later = wait_until(
                lambda: (
                    (p := plots())["plots"]["metric/loss"]["points"]
                    > first["plots"]["metric/loss"]["points"]
                    and p["updates"] > first["updates"]
                    and p
                ),
                "the page to update",
            )
            assert later["plots"]["samples_per_second"]["points"] >= 2
        finally:
            browser.close()
        assert trainers.error is None, trainers.error

    monitor.signal(signal.SIGINT)  # Ctrl+C: one graceful, bounded stop
    assert monitor.wait(timeout=15) == 0, monitor.stderr()
    with csv_path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["time", "series", "value"]
    series = {row[1] for row in rows[1:]}
    assert {"peers", "trainers", "samples_per_second", "metric/loss"} <= series
    assert "watching run 'monitor-run'" in monitor.stderr()
