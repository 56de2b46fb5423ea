"""Peer daemon figures; prints ONE JSON line.

- ``start_to_ready_s``: process start -> JSON ready line of ``swarmavg peer`` (median).
- ``idle_rss_mb`` / ``idle_cpu_percent``: an idle daemon with one DHT neighbour.
- ``average_64mb``: one 64 MB ``client.average`` round between two peers, measured on one
  side, three ways: the round called in process (``Peer.averager.average``, the baseline),
  through a daemon over the plain socket, and through a daemon with shared memory. The
  other side is always the same partner daemon fed by a helper process that is already
  waiting, so the difference is what the client <-> daemon hop costs.

Usage: ``python -m benchmarks.peer [--starts 7] [--rounds 5] [--idle 10]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

MB = 1 << 20
SIZE = 64 * MB
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class Proc:
    """A ``swarmavg peer`` process; ``ready_s`` is the time from spawn to its ready line."""

    def __init__(self, *args: str) -> None:
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "swarmavg.peer.cli",
                "peer",
                "--listen",
                "127.0.0.1:0",
                "--log-level",
                "WARNING",
                *args,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.ready_s = time.perf_counter() - started
        if not line:
            raise RuntimeError(f"daemon exited with {self.proc.wait()} before its ready line")
        self.ready: dict[str, Any] = json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=15)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def measure_start(tmp: Path, n: int) -> list[float]:
    times = []
    for i in range(n):
        p = Proc("--control", str(tmp / f"start{i}.sock"))
        times.append(p.ready_s)
        p.stop()
    return times


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def measure_idle(tmp: Path, seconds: float) -> tuple[float, float]:
    a = Proc("--control", str(tmp / "idle-a.sock"))
    b = Proc("--control", str(tmp / "idle-b.sock"), "--join", a.ready["address"])
    try:
        time.sleep(2.0)  # let the join's lookups settle before the idle window
        pid = b.proc.pid
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(seconds)
        cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0) * 100
        return rss_mb(pid), cpu
    finally:
        b.stop()
        a.stop()


def tensors(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SIZE // 4 // 4, dtype=np.float32) for _ in range(4)]


def partner_main(control: str, keys: list[str]) -> int:
    """The other side of every measured round: average each key in turn."""
    from swarmavg.peer import connect

    x = tensors(1)
    with connect(control) as client:
        for key in keys:
            client.average(x, key=key, group_size=2, min_group_size=2, timeout=120)
    return 0


class InProcessPeer:
    """A ``Peer`` running on its own event loop in a background thread of this process."""

    def __init__(self, join: str, tmp: Path) -> None:
        from swarmavg.peer import Peer, PeerConfig

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = PeerConfig(listen="127.0.0.1:0", join=[join], control=str(tmp / "inproc.sock"))
        self.peer = Peer(config)
        self._run(self.peer.start())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def average(self, x: list[np.ndarray], key: str) -> float:
        assert self.peer.averager is not None
        t0 = time.perf_counter()
        self._run(self.peer.averager.average(x, key, group_size=2, min_group_size=2, timeout=120))
        return time.perf_counter() - t0

    def close(self) -> None:
        self._run(self.peer.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def daemon_round(client: Any, x: list[np.ndarray], key: str) -> float:
    t0 = time.perf_counter()
    client.average(x, key=key, group_size=2, min_group_size=2, timeout=120)
    return time.perf_counter() - t0


def measure_average(tmp: Path, rounds: int) -> dict[str, Any]:
    partner = Proc("--control", str(tmp / "partner.sock"))
    measured = Proc("--control", str(tmp / "measured.sock"), "--join", partner.ready["address"])
    modes = ["inprocess", "socket", "shm"]
    # interleave the modes so that drift in the machine's load hits all three alike
    plan = [(mode, f"{mode}-{r}") for r in range(rounds + 1) for mode in modes]
    helper = subprocess.Popen(
        [sys.executable, __file__, "--partner", partner.ready["control"], *[k for _, k in plan]]
    )
    results: dict[str, list[float]] = {m: [] for m in modes}
    from swarmavg.peer import connect

    x = tensors(0)
    inproc = InProcessPeer(partner.ready["address"], tmp)
    try:
        with (
            connect(measured.ready["control"], use_shm=False) as plain,
            connect(measured.ready["control"], use_shm=True) as shm,
        ):
            for r in range(rounds + 1):
                for mode in modes:
                    key = f"{mode}-{r}"
                    if mode == "inprocess":
                        took = inproc.average(x, key)
                    else:
                        took = daemon_round(shm if mode == "shm" else plain, x, key)
                    if r > 0:  # round 0 warms up channels and caches
                        results[mode].append(took)
        helper.wait(timeout=300)
    finally:
        inproc.close()
        if helper.poll() is None:
            helper.kill()
            helper.wait()
        measured.stop()
        partner.stop()
    med = {m: statistics.median(v) for m, v in results.items()}
    return {
        "rounds": rounds,
        "median_s": {m: round(v, 3) for m, v in med.items()},
        "ratio_socket": round(med["socket"] / med["inprocess"], 3),
        "ratio_shm": round(med["shm"] / med["inprocess"], 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--partner", nargs="+", metavar=("CONTROL", "KEY"))
    args = parser.parse_args()
    if args.partner:
        return partner_main(args.partner[0], args.partner[1:])
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-bench-") as d:
        tmp = Path(d)
        starts = measure_start(tmp, args.starts)
        rss, cpu = measure_idle(tmp, args.idle)
        average = measure_average(tmp, args.rounds)
    figures = {
        "benchmark": "peer",
        "start_to_ready_s": {
            "median": round(statistics.median(starts), 3),
            "min": round(min(starts), 3),
            "max": round(max(starts), 3),
            "n": len(starts),
        },
        "idle_rss_mb": round(rss, 1),
        "idle_cpu_percent": round(cpu, 2),
        "average_64mb": average,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
