"""Overhead of ``swarmavg peers`` on a 16-peer run (issue 19), as one JSON line.

16 daemons on 127.0.0.1: the one asked runs in this process (``start_peer``), 15 are
``swarmavg peer`` processes. One writer process reports a progress record (with metrics)
for every daemon every 2 s, as trainers do. Windows of ``--window`` seconds alternate
(A/B interleaved): A, nobody asks; B, ``client.peers()`` (what ``swarmavg peers`` calls)
every ``--every`` seconds. Per window: CPU seconds of this process (the asked daemon and the
calls) and the bytes of the asked daemon's outbound DHT calls (requests + answers, counted
at its protocol's ``_call``) plus the Peers answers on the control socket.

    PYTHONPATH=. python benchmarks/run_view.py [--peers 16] [--window 20] [--reps 3] [--every 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--every", type=float, default=3.0)
    args = parser.parse_args()
    from swarmavg.peer import start_peer
    from tests.harness import ProcessPool

    run = "bench-view"
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-bv-") as tmp:
        work = Path(tmp)
        pool = ProcessPool(work)
        try:
            with start_peer(
                run_id=run, listen="127.0.0.1:0", control=str(work / "asked.sock")
            ) as asked:
                listen = ["peer", "--listen", "127.0.0.1:0"]
                join = ["--join", str(asked.address), "-q", "--run-id", run]
                others = [
                    pool.start([*listen, "--control", str(work / f"p{i}.sock"), *join])
                    for i in range(args.peers - 1)
                ]
                controls = [asked.control, *(o.control for o in others)]
                writer = subprocess.Popen([sys.executable, "-c", WRITER, run, *controls])
                try:
                    result = measure(asked, args)
                finally:
                    writer.kill()
                    writer.wait()
        finally:
            pool.close()
    print(json.dumps(result))


def measure(asked: Any, args: argparse.Namespace) -> dict[str, Any]:
    counted = {"bytes": 0}
    protocol = _protocol_of(asked)
    original = protocol._call

    async def counting_call(address: str, method: str, body: bytes, *rest: Any) -> Any:
        peer_id, data = await original(address, method, body, *rest)
        counted["bytes"] += len(body) + len(data)
        return peer_id, data

    protocol._call = counting_call
    with asked.connect(use_shm=False) as client:
        deadline = time.monotonic() + 120
        while len(client.peers()["peers"]) < args.peers:  # every daemon listed once
            if time.monotonic() > deadline:
                raise SystemExit("the run's view never listed every peer")
            time.sleep(1.0)
        windows: dict[str, list[tuple[float, int, int]]] = {"idle": [], "peers": []}
        for _ in range(args.reps):
            for kind in ("idle", "peers"):
                cpu, dht = time.process_time(), counted["bytes"]
                answers = 0
                end = time.monotonic() + args.window
                while time.monotonic() < end:
                    if kind == "peers":
                        view = client.peers()
                        answers += len(json.dumps(view))  # a lower bound of the proto size
                    time.sleep(min(args.every, max(end - time.monotonic(), 0.0)))
                windows[kind].append((time.process_time() - cpu, counted["bytes"] - dht, answers))
    per_minute = 60.0 / args.window

    def med(kind: str, i: int) -> float:
        return statistics.median(w[i] for w in windows[kind]) * per_minute

    return {
        "peers": args.peers,
        "every_s": args.every,
        "window_s": args.window,
        "reps": args.reps,
        "listed": len(view["peers"]),
        "cpu_s_per_min_idle": round(med("idle", 0), 3),
        "cpu_s_per_min_peers": round(med("peers", 0), 3),
        "dht_bytes_per_min_idle": round(med("idle", 1)),
        "dht_bytes_per_min_peers": round(med("peers", 1)),
        "answer_json_bytes_per_min": round(med("peers", 2)),
        "windows": windows,
    }


def _protocol_of(asked: Any) -> Any:
    """The asked daemon's DHT protocol (this process's background peer)."""
    return asked.peer.dht.protocol


if __name__ == "__main__":
    main()
