"""Soak and daemon memory: many rounds of real daemons.

Starts ``--peers`` (4) ``swarmavg peer`` processes (the CLI, loopback) and drives them from
one client thread of this process per daemon, in lockstep: every round each thread calls
``client.average`` with a fresh key (``group_size`` given). After every round it samples each
daemon's RSS (``/proc/PID/status``). Prints ONE JSON line: the RSS series (every
``--every`` rounds, MiB per daemon), and per daemon the growth from round ``--warmup`` to
the end (``growth``: last / at warmup - 1; goal: under 0.10).

Memory mode (``--mb M``: M MB of float32 per peer instead of ``--elements``): a sampler
thread also reads every daemon's ``VmRSS``, ``RssAnon`` (its private memory) and
``RssShmem`` (the clients' shared-memory segments it maps) every ``--sample-ms`` during
the rounds, and the record gives per daemon: ``idle`` (connected, after one tiny round),
``peak`` during the rounds, ``after`` (the end), each in MiB, and ``peak_above_idle`` in
units of the tensors' size (the goal: at most 2).

Usage: ``python -m benchmarks.soak [--rounds 1000] [--warmup 50] [--elements 4096]``
       ``python -m benchmarks.soak --mb 64 --rounds 100 --warmup 10 --peers 4``
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

from .common import swarmavg_command

READY_TIMEOUT = 60.0


MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssShmem")


def memory_mib(pid: int) -> dict[str, float]:
    """``VmRSS``, ``RssAnon`` and ``RssShmem`` of a process, in MiB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in MEMORY_FIELDS:
            out[name] = int(value.split()[0]) / 1024
    if "VmRSS" not in out:
        raise RuntimeError(f"process {pid} has no VmRSS")
    return out


def rss_mib(pid: int) -> float:
    return memory_mib(pid)["VmRSS"]


class PeakSampler:
    """Samples the daemons' memory every ``interval`` seconds in a thread; keeps maxima."""

    def __init__(self, pids: list[int], interval: float) -> None:
        self.pids = pids
        self.interval = interval
        self.peak = [dict.fromkeys(MEMORY_FIELDS, 0.0) for _ in pids]
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for peak, pid in zip(self.peak, self.pids, strict=True):
                for name, value in memory_mib(pid).items():
                    peak[name] = max(peak[name], value)
            self.samples += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


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


def soak(
    rounds: int,
    warmup: int,
    elements: int,
    every: int,
    timeout: float,
    peers: int = 4,
    sample_interval: float | None = None,
) -> dict[str, Any]:
    from swarmavg.peer import connect

    run_id = f"soak-{os.getpid()}-{os.urandom(3).hex()}"
    with tempfile.TemporaryDirectory(prefix="swarmavg-soak-") as tmp:
        workdir = Path(tmp)
        daemons = [Daemon(workdir, 0, run_id, None)]
        try:
            first = daemons[0].ready["address"]
            daemons += [Daemon(workdir, i, run_id, first) for i in range(1, peers)]
            clients = [connect(d.ready["control"]) for d in daemons]
            sampler = PeakSampler([d.proc.pid for d in daemons], sample_interval or 1.0)
            rng = np.random.default_rng(0)
            tiny = [[np.ones(256, np.float32)] for _ in daemons]
            inputs = [[rng.standard_normal(elements).astype(np.float32)] for _ in daemons]
            series: list[list[float]] = []
            failures = 0
            partial = 0
            durations: list[float] = []
            barrier = threading.Barrier(len(daemons))
            outcomes: list[Any] = [None] * len(daemons)

            def member(i: int, key: str, tensors: list[list[np.ndarray]]) -> None:
                barrier.wait()
                try:
                    outcomes[i] = clients[i].average(
                        tensors[i], key=key, group_size=peers, min_group_size=peers, timeout=timeout
                    )
                except Exception as e:  # counted: a soak must show failures, not stop
                    outcomes[i] = e

            def one_round(key: str, tensors: list[list[np.ndarray]]) -> None:
                threads = [
                    threading.Thread(target=member, args=(i, key, tensors))
                    for i in range(len(daemons))
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            # "Idle": connected and past one tiny round (modules loaded, channels open),
            # so that the figures below are what rounds of this size cost.
            one_round("soak-tiny", tiny)
            idle = [memory_mib(d.proc.pid) for d in daemons]
            if sample_interval is not None:
                sampler.start()
            for r in range(rounds):
                started = time.monotonic()
                one_round(f"soak-{r}", inputs)
                durations.append(time.monotonic() - started)
                failures += sum(isinstance(o, Exception) for o in outcomes)
                partial += sum(bool(getattr(o, "partial", False)) for o in outcomes)
                series.append([rss_mib(d.proc.pid) for d in daemons])
            if sample_interval is not None:
                sampler.stop()
            outcomes = [None] * len(daemons)  # let go of the last results' segments
            after = [memory_mib(d.proc.pid) for d in daemons]
            for c in clients:
                c.close()
        finally:
            for d in daemons:
                d.stop()
    base = series[min(warmup, len(series) - 1)]
    end = series[-1]
    growth = [e / b - 1 for e, b in zip(end, base, strict=True)]
    later = series[min(warmup, len(series) - 1) :]
    memory: dict[str, Any] = {}
    if sample_interval is not None:
        tensors_mib = elements * 4 / 2**20
        memory = {
            "tensors_mib": round(tensors_mib, 1),
            "peak_samples": sampler.samples,
            "idle_mib": [{k: round(v, 1) for k, v in m.items()} for m in idle],
            "peak_mib": [{k: round(v, 1) for k, v in m.items()} for m in sampler.peak],
            "after_mib": [{k: round(v, 1) for k, v in m.items()} for m in after],
            # Peak above idle in units of the tensors: the whole RSS, and the daemon's
            # private memory alone (RssAnon; the rest is the clients' mapped segments).
            "peak_above_idle_x": [
                round((p["VmRSS"] - i["VmRSS"]) / tensors_mib, 2)
                for p, i in zip(sampler.peak, idle, strict=True)
            ],
            "peak_anon_above_idle_x": [
                round((p.get("RssAnon", 0) - i.get("RssAnon", 0)) / tensors_mib, 2)
                for p, i in zip(sampler.peak, idle, strict=True)
            ],
        }
    return {
        "benchmark": "soak",
        "rounds": rounds,
        "peers": peers,
        "elements": elements,
        "warmup": warmup,
        "round_s_median": round(statistics.median(durations), 4),
        "failed_calls": failures,
        "partial_results": partial,
        "rss_mib_at_warmup": [round(x, 1) for x in base],
        "rss_mib_end": [round(x, 1) for x in end],
        "rss_mib_max_after_warmup": [round(max(s[i] for s in later), 1) for i in range(peers)],
        "growth": [round(g, 4) for g in growth],
        "flat_within_10pct": all(g < 0.10 for g in growth),
        "series_every": every,
        "series_mib": [[round(x, 1) for x in s] for s in series[::every]],
        **memory,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--elements", type=int, default=4096)
    parser.add_argument("--every", type=int, default=50, help="print every Nth RSS sample")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--mb", type=float, default=None, help="memory mode: MB of float32")
    parser.add_argument("--sample-ms", type=float, default=2.0, help="memory mode's sampling")
    args = parser.parse_args(argv)
    elements = args.elements if args.mb is None else int(args.mb * 1e6) // 4
    interval = None if args.mb is None else args.sample_ms / 1000
    result = soak(
        args.rounds, args.warmup, elements, args.every, args.timeout, args.peers, interval
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
