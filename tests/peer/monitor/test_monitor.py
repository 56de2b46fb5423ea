"""``swarmavg monitor``'s parts without a swarm: the samples, the ring buffer, the
dashboard's HTTP server on a real socket, the sinks, the settings' fail-fast messages.
(The monitor against real daemons and a real browser: tests/integration/test_monitor_dashboard.py.)
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from swarmavg.peer.monitor.http_server import MAX_HEAD_BYTES, DashboardServer
from swarmavg.peer.monitor.monitor import MonitorSettings
from swarmavg.peer.monitor.page import render_page
from swarmavg.peer.monitor.series import History, Sample, sample_from_view
from swarmavg.peer.monitor.sinks import CsvSink, SinkUnavailable, open_sinks

pytestmark = pytest.mark.timeout(60)


def row(peer: str, method: str | None, processes: int = 1, **metrics: float) -> dict[str, Any]:
    return {
        "peer_id": peer,
        "method": method,
        "processes": processes,
        "metrics": metrics,
        "this_peer": False,
    }


def test_a_sample_sums_the_run_and_averages_each_metric_over_its_reporters() -> None:
    view = {
        "ignored_records": 1,
        "progress": [
            {"epoch": 4, "samples_per_second": 30.0, "eta": 2.5},
            {"epoch": 2, "samples_per_second": 5.0, "eta": None},  # a DiLoCo run beside it
        ],
        "peers": [
            {**row("me", None), "this_peer": True},  # the monitor itself is not a peer
            row("a", "collaborative", processes=2, loss=1.0, acc=0.5),
            row("b", "collaborative", loss=3.0),
            row("c", None),  # a bootstrap node: a peer, no trainer
        ],
    }
    sample = sample_from_view(view, now=100.0)
    assert sample == Sample(
        100.0,
        {
            "peers": 3.0,
            "trainers": 3.0,
            "ignored_records": 1.0,
            "epoch": 4.0,
            "samples_per_second": 35.0,
            "eta": 2.5,
            "metric/acc": 0.5,
            "metric/loss": 2.0,
        },
    )


def test_a_run_without_trainers_has_no_epoch_nor_eta() -> None:
    view = {"ignored_records": 0, "progress": [], "peers": [row("a", None)]}
    assert sample_from_view(view, 1.0).values == {
        "peers": 1.0,
        "trainers": 0.0,
        "ignored_records": 0.0,
    }


def test_the_history_is_a_bounded_ring_buffer_with_gaps_for_missing_series() -> None:
    history = History("r", capacity=3)
    for i in range(5):
        values = {"peers": float(i)} | ({"metric/loss": 1.0 / (i + 1)} if i % 2 else {})
        history.add(Sample(float(i), values))
    history.add(Sample(5.0, {"peers": 5.0, "eta": math.inf}))  # JSON has no infinity
    assert (len(history), history.total) == (3, 6)
    data = history.to_json()
    assert data["t"] == [3.0, 4.0, 5.0]
    assert data["series"] == {
        "peers": [3.0, 4.0, 5.0],
        "eta": [None, None, None],
        "metric/loss": [0.25, None, None],
    }
    assert (data["points"], data["total"], data["run_id"]) == (3, 6, "r")
    json.dumps(data, allow_nan=False)
    with pytest.raises(ValueError, match="at least 2"):
        History("r", capacity=1)


async def http(address: str, request: bytes) -> tuple[str, dict[str, str], bytes]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return status, headers, body


async def test_the_dashboard_serves_the_page_and_the_data_and_refuses_the_rest() -> None:
    history = History("my <run>")
    history.add(Sample(1.0, {"peers": 2.0}))
    server = DashboardServer("127.0.0.1:0", render_page("my <run>", 1.0), history.to_json)
    address = await server.start()
    try:
        status, headers, body = await http(address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == "HTTP/1.1 200 OK"
        assert headers["Content-Type"].startswith("text/html")
        assert int(headers["Content-Length"]) == len(body)
        page = body.decode()
        assert "my &lt;run&gt;" in page
        assert "<run>" not in page
        assert "POLL_MS = 1000" in page
        assert "http://" not in page.replace(server.url, "")  # nothing from elsewhere

        status, headers, body = await http(address, b"GET /data.json?x=1 HTTP/1.1\r\n\r\n")
        assert status == "HTTP/1.1 200 OK"
        assert headers["Content-Type"] == "application/json"
        assert json.loads(body)["series"] == {"peers": [2.0]}

        status, _, body = await http(address, b"HEAD /data.json HTTP/1.1\r\n\r\n")
        assert (status, body) == ("HTTP/1.1 200 OK", b"")
        status, _, body = await http(address, b"GET /nope HTTP/1.1\r\n\r\n")
        assert status == "HTTP/1.1 404 Not Found"
        assert b"/data.json" in body
        status, _, body = await http(address, b"POST / HTTP/1.1\r\n\r\n")
        assert status == "HTTP/1.1 405 Method Not Allowed"
        assert b"use GET" in body
        status, _, _ = await http(address, b"hello\r\n\r\n")
        assert status == "HTTP/1.1 400 Bad Request"
        big = b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n"
        status, _, body = await http(address, big)
        assert status == "HTTP/1.1 400 Bad Request"
        assert b"too large" in body
    finally:
        await server.stop()
    await server.stop()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", server.port)


async def test_a_taken_dashboard_port_is_an_error() -> None:
    first = DashboardServer("127.0.0.1:0", "", dict)
    address = await first.start()
    try:
        with pytest.raises(OSError, match="address already in use"):
            await DashboardServer(address, "", dict).start()
    finally:
        await first.stop()


def test_the_csv_sink_appends_one_row_per_series(tmp_path: Path) -> None:
    path = tmp_path / "run.csv"
    sink = CsvSink(path)
    sink.write(Sample(1.5, {"peers": 2.0, "metric/loss": 0.25}), 0)
    sink.close()
    again = CsvSink(path)  # a restarted monitor keeps the rows and writes no second header
    again.write(Sample(2.5, {"peers": 3.0}), 1)
    again.close()
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["time", "series", "value"],
        ["1.500", "peers", "2.0"],
        ["1.500", "metric/loss", "0.25"],
        ["2.500", "peers", "3.0"],
    ]


def test_tensorboard_writes_the_samples_as_scalars(tmp_path: Path) -> None:
    # installed by `make setup` (the `monitor` extra), so this runs in CI
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (sink,) = open_sinks("r", tensorboard=tmp_path / "tb")
    sink.write(Sample(1.0, {"peers": 2.0, "metric/loss": 0.5}), 0)
    sink.write(Sample(2.0, {"peers": 3.0, "metric/loss": 0.25}), 1)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"peers", "metric/loss"}
    loss = events.Scalars("metric/loss")
    assert [(e.step, e.value, e.wall_time) for e in loss] == [(0, 0.5, 1.0), (1, 0.25, 2.0)]
    assert [e.value for e in events.Scalars("peers")] == [2.0, 3.0]


@pytest.mark.timeout(120)
def test_wandb_logs_the_samples_in_offline_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # offline: a run folder on disk, nothing sent (WANDB_MODE is how a user asks for it)
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_DATA_DIR": str(tmp_path / "data"),
        "WANDB_SILENT": "true",
    }.items():
        monkeypatch.setenv(name, value)
    (sink,) = open_sinks("my-run", wandb_project="swarm-test")
    sink.write(Sample(1.0, {"peers": 2.0, "metric/loss": 0.5}), 0)
    sink.write(Sample(2.0, {"peers": 3.0, "metric/loss": 0.25}), 1)
    sink.close()
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # the run's records (wandb's own binary log): the series' names and values are in it.
    # wandb's service process writes them behind finish(): under CI's load the file once
    # held only its 7-byte header when finish() returned, so wait for them, bounded.
    expected = (b"metric/loss", b"peers", b"0.25", b"my-run")
    deadline = time.monotonic() + 60.0
    data = log.read_bytes()
    while not all(e in data for e in expected) and time.monotonic() < deadline:
        time.sleep(0.05)
        data = log.read_bytes()
    for e in expected:
        assert e in data, e


@pytest.mark.parametrize(
    ("module", "flag", "hint"),
    [
        ("wandb", "wandb_project", "--wandb needs the wandb package: pip install wandb"),
        ("torch.utils.tensorboard", "tensorboard", "pip install torch tensorboard"),
    ],
)
def test_a_missing_optional_sink_says_what_to_install(
    module: str, flag: str, hint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when it is absent
    csv_path = tmp_path / "x.csv"
    value: Any = "p" if flag == "wandb_project" else tmp_path / "tb"
    with pytest.raises(SinkUnavailable, match=re.escape(hint)):
        open_sinks("r", csv_path=csv_path, **{flag: value})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"join": []}, "needs at least one initial peer"),
        ({"join": ["http://10.0.0.1:31337"]}, "drop the http:// scheme"),
        ({"join": ["/ip4/10.0.0.1/tcp/31337"]}, "expected HOST:PORT"),
        ({"interval": 0.0}, "--interval must be between"),
        ({"interval": math.nan}, "--interval must be between"),
        ({"history": 1}, "--history must keep at least 2"),
        ({"http": "localhost"}, "--http 'localhost': expected HOST:PORT"),
        ({"run_id": "a/b"}, "run_id 'a/b'"),
    ],
)
def test_bad_settings_fail_fast_with_a_hint(changes: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"run_id": "r", "join": ["127.0.0.1:1"]}
    with pytest.raises(ValueError, match=message):
        MonitorSettings(**(base | changes))


def monitor_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", "monitor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )


def test_the_cli_names_what_is_missing_or_wrong() -> None:
    result = monitor_cli("--initial-peers", "127.0.0.1:1")
    assert result.returncode == 2
    assert "give --run-id NAME" in result.stderr
    result = monitor_cli("--run-id", "r", "--initial-peers", "http://127.0.0.1:41337")
    assert result.returncode == 2
    assert "drop the http:// scheme and write '127.0.0.1:41337'" in result.stderr
    result = monitor_cli("--run-id", "r")
    assert result.returncode == 2
    assert "--initial-peers HOST:PORT" in result.stderr


def test_the_cli_says_when_no_initial_peer_answers(tmp_path: Path) -> None:
    result = monitor_cli(
        "--run-id",
        "r",
        "--initial-peers",
        "127.0.0.1:9",  # the discard port: nothing answers gRPC there
        "--bootstrap-timeout",
        "1",
        "--http",
        "127.0.0.1:0",
        "--csv",
        str(tmp_path / "x.csv"),
    )
    assert result.returncode == 1, result.stderr
    assert "could not join the swarm" in result.stderr
    assert result.stdout == ""  # no ready line
