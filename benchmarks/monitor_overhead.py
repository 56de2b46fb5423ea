"""Overhead of ``swarmavg monitor`` and ``swarmavg peers`` on a 16-peer run, as
one JSON line.

16 ``swarmavg peer`` processes on 127.0.0.1 and one writer process reporting a progress
record (with metrics) for every daemon every 2 s, as trainers do. Windows of ``--window``
seconds alternate (A/B/C interleaved): idle (nobody watches); monitor (a
:class:`~swarmavg.peer.monitor.monitor.Monitor` in this process, polling every ``--interval`` s, as
``swarmavg monitor`` does, its dashboard off); peers (``client.peers()`` on one daemon every
``--every`` s, what ``swarmavg peers`` calls). Per window: CPU seconds of the 16 daemons
together (``/proc/PID/stat``), CPU seconds of this process (in monitor windows: the
monitor), and the bytes of the monitor's DHT calls (signed requests + answers, their
protobuf sizes, counted at its protocol's ``_call``): the swarm's peers send and receive
the same bytes for it. The monitor is started before and stopped after its window (its
join is not counted).

    python -m benchmarks.monitor_overhead [--peers 16] [--window 30] [--reps 2]
        [--kinds idle,monitor,peers]

The kinds' order alternates from one rep to the next (A B C, then C B A, ...), so that a
load that drifts during the run weighs on every kind alike; ``paired`` is the median over
reps of each kind's window minus the idle window of the same rep (the daemons' CPU seconds
per minute that the monitor or ``peers`` adds), and every window records the load average
when it ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import DaemonPool, cpu_seconds

WRITER = """
import sys, time
from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.peer import connect
clients = [connect(c, use_shm=False) for c in sys.argv[2:]]
trackers = [ProgressTracker(c, sys.argv[1], target_batch_size=4096, ttl=30.0) for c in clients]
for t in trackers:
    t.set_metrics({"loss": 0.5, "accuracy": 0.9})
while True:
    for t in trackers:
        t.add_samples(32)
        t.report()
    time.sleep(2.0)
"""
"""A trainer stand-in: a progress record with metrics for every daemon every 2 s."""


async def monitor_window(
    address: str, run: str, args: argparse.Namespace, pids: list[int]
) -> tuple[float, float, int, int, dict[str, Any]]:
    from swarmavg.peer.monitor.monitor import Monitor, MonitorSettings

    monitor = Monitor(
        MonitorSettings(run_id=run, join=[address], interval=args.interval, http=None)
    )
    await monitor.start()
    assert monitor.node is not None
    protocol = monitor.node.protocol
    counted = {"bytes": 0}
    original = protocol._call

    async def counting_call(target: str, method: str, request: Any, *rest: Any) -> Any:
        peer_id, answer = await original(target, method, request, *rest)
        # the signed request as sent and the answer as received (protobuf sizes)
        counted["bytes"] += request.ByteSize() + answer.ByteSize()
        return peer_id, answer

    protocol._call = counting_call
    try:
        swarm, own = cpu_seconds(pids), time.process_time()
        await asyncio.sleep(args.window)
        return (
            cpu_seconds(pids) - swarm,
            time.process_time() - own,
            counted["bytes"],
            monitor.history.total,
            dict(monitor.history.to_json()["series"]),
        )
    finally:
        await monitor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--every", type=float, default=3.0)
    parser.add_argument(
        "--kinds",
        default="idle,monitor,peers",
        help="the windows to alternate, comma-separated, among idle, monitor, peers",
    )
    args = parser.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if "idle" not in args.kinds or not set(args.kinds) <= {"idle", "monitor", "peers"}:
        parser.error("--kinds: idle and any of monitor, peers")
    from swarmavg.peer import connect

    run = "bench-monitor"
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-bm-") as tmp:
        work = Path(tmp)
        pool = DaemonPool(work, ready_timeout=180)
        try:
            listen = ["peer", "--listen", "127.0.0.1:0", "-q", "--run-id", run]
            first = pool.start([*listen, "--control", str(work / "p0.sock")])
            daemons = [first] + [
                pool.start(
                    [*listen, "--control", str(work / f"p{i}.sock"), "--join", first.address]
                )
                for i in range(1, args.peers)
            ]
            pids = [d.pid for d in daemons]
            writer = subprocess.Popen(
                [sys.executable, "-c", WRITER, run, *(d.control for d in daemons)]
            )
            try:
                with connect(first.control, use_shm=False) as client:
                    deadline = time.monotonic() + 180
                    while (
                        sum(r["method"] is not None for r in client.peers()["peers"]) < args.peers
                    ):
                        if time.monotonic() > deadline:
                            raise SystemExit("the run's view never listed every trainer")
                        time.sleep(1.0)
                    result = measure(client, first.address, run, args, pids)
            finally:
                writer.kill()
                writer.wait()
        finally:
            pool.close()
    print(json.dumps(result))


def measure(
    client: Any, address: str, run: str, args: argparse.Namespace, pids: list[int]
) -> dict[str, Any]:
    windows: dict[str, list[tuple[float, float, int]]] = {k: [] for k in args.kinds}
    loads: dict[str, list[float]] = {k: [] for k in args.kinds}
    polls, last_series = 0, {}
    for rep in range(args.reps):
        order = args.kinds if rep % 2 == 0 else list(reversed(args.kinds))
        for kind in order:
            if kind == "monitor":
                swarm, own, sent, n, last_series = asyncio.run(
                    monitor_window(address, run, args, pids)
                )
                polls += n
                windows[kind].append((swarm, own, sent))
            else:
                swarm, own = cpu_seconds(pids), time.process_time()
                end = time.monotonic() + args.window
                while time.monotonic() < end:
                    if kind == "peers":
                        client.peers()
                    time.sleep(min(args.every, max(end - time.monotonic(), 0.0)))
                windows[kind].append((cpu_seconds(pids) - swarm, time.process_time() - own, 0))
            loads[kind].append(round(os.getloadavg()[0], 1))
    per_minute = 60.0 / args.window

    def med(kind: str, i: int) -> float | None:
        if kind not in windows:
            return None
        return round(statistics.median(w[i] for w in windows[kind]) * per_minute, 3)

    def paired(kind: str) -> float | None:
        if kind not in windows:
            return None
        diffs = [
            (w[0] - idle[0]) * per_minute
            for w, idle in zip(windows[kind], windows["idle"], strict=True)
        ]
        return round(statistics.median(diffs), 3)

    bytes_per_min = med("monitor", 2)
    return {
        "peers": args.peers,
        "interval_s": args.interval,
        "every_s": args.every,
        "window_s": args.window,
        "reps": args.reps,
        "kinds": args.kinds,
        "monitor_polls": polls,
        "monitor_saw_peers": last_series.get("peers", [None])[-1],
        "monitor_saw_trainers": last_series.get("trainers", [None])[-1],
        "swarm_cpu_s_per_min_idle": med("idle", 0),
        "swarm_cpu_s_per_min_monitor": med("monitor", 0),
        "swarm_cpu_s_per_min_peers": med("peers", 0),
        "swarm_cpu_s_per_min_added_by_monitor": paired("monitor"),
        "swarm_cpu_s_per_min_added_by_peers": paired("peers"),
        "monitor_cpu_s_per_min": med("monitor", 1),
        "monitor_dht_bytes_per_min": None if bytes_per_min is None else round(bytes_per_min),
        "load_average_end": os.getloadavg(),
        "load_after_each_window": loads,
        "windows": windows,
    }


if __name__ == "__main__":
    main()
