"""Soak (issue 17): many rounds of 4 real daemons; does a daemon's memory stay flat?

Starts 4 ``swarmavg peer`` processes (the CLI, loopback) and drives them from 4 client
threads of this process, one per daemon, in lockstep: every round each thread calls
``client.average`` on small tensors with a fresh key. After every round it samples each
daemon's RSS (``/proc/PID/status``). Prints ONE JSON line: the RSS series (every
``--every`` rounds, MiB per daemon), and per daemon the growth from round ``--warmup`` to
the end (``growth``: last / at warmup - 1; goal: under 0.10).

Usage: ``python benchmarks/soak.py [--rounds 1000] [--warmup 50] [--elements 4096]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

READY_TIMEOUT = 60.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"process {pid} has no VmRSS")


def swarmavg_command() -> list[str]:
    script = Path(sys.executable).with_name("swarmavg")
    return [str(script)] if script.exists() else [sys.executable, "-m", "swarmavg.peer.cli"]


class Daemon:
    """One ``swarmavg peer`` process whose ready line has been read."""

    def __init__(self, workdir: Path, i: int, run_id: str, join: str | None) -> None:
        argv = [*swarmavg_command(), "peer", "--listen", "127.0.0.1:0", "--run-id", run_id]
        argv += ["--control", str(workdir / f"p{i}.sock"), "--log-level", "WARNING"]
        if join is not None:
            argv += ["--join", join]
        self.log = open(workdir / f"daemon{i}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"daemon {i} exited with {self.proc.wait()} before its ready line")
        self.ready: dict[str, Any] = json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def soak(rounds: int, warmup: int, elements: int, every: int, timeout: float) -> dict[str, Any]:
    from swarmavg.peer import connect

    run_id = f"soak-{os.getpid()}-{os.urandom(3).hex()}"
    with tempfile.TemporaryDirectory(prefix="swarmavg-soak-") as tmp:
        workdir = Path(tmp)
        daemons = [Daemon(workdir, 0, run_id, None)]
        try:
            first = daemons[0].ready["address"]
            daemons += [Daemon(workdir, i, run_id, first) for i in range(1, 4)]
            clients = [connect(d.ready["control"]) for d in daemons]
            rng = np.random.default_rng(0)
            inputs = [[rng.standard_normal(elements).astype(np.float32)] for _ in daemons]
            series: list[list[float]] = []
            failures = 0
            partial = 0
            durations: list[float] = []
            barrier = threading.Barrier(len(daemons))
            outcomes: list[Any] = [None] * len(daemons)

            def member(i: int, key: str) -> None:
                barrier.wait()
                try:
                    outcomes[i] = clients[i].average(
                        inputs[i], key=key, group_size=4, min_group_size=4, timeout=timeout
                    )
                except Exception as e:  # counted: a soak must show failures, not stop
                    outcomes[i] = e

            for r in range(rounds):
                started = time.monotonic()
                threads = [
                    threading.Thread(target=member, args=(i, f"soak-{r}"))
                    for i in range(len(daemons))
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                durations.append(time.monotonic() - started)
                failures += sum(isinstance(o, Exception) for o in outcomes)
                partial += sum(bool(getattr(o, "partial", False)) for o in outcomes)
                series.append([rss_mib(d.proc.pid) for d in daemons])
            for c in clients:
                c.close()
        finally:
            for d in daemons:
                d.stop()
    base = series[min(warmup, len(series) - 1)]
    end = series[-1]
    growth = [e / b - 1 for e, b in zip(end, base, strict=True)]
    after = series[min(warmup, len(series) - 1) :]
    return {
        "benchmark": "soak",
        "rounds": rounds,
        "peers": 4,
        "elements": elements,
        "warmup": warmup,
        "round_s_median": round(statistics.median(durations), 4),
        "failed_calls": failures,
        "partial_results": partial,
        "rss_mib_at_warmup": [round(x, 1) for x in base],
        "rss_mib_end": [round(x, 1) for x in end],
        "rss_mib_max_after_warmup": [round(max(s[i] for s in after), 1) for i in range(4)],
        "growth": [round(g, 4) for g in growth],
        "flat_within_10pct": all(g < 0.10 for g in growth),
        "series_every": every,
        "series_mib": [[round(x, 1) for x in s] for s in series[::every]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--elements", type=int, default=4096)
    parser.add_argument("--every", type=int, default=50, help="print every Nth RSS sample")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    result = soak(args.rounds, args.warmup, args.elements, args.every, args.timeout)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
