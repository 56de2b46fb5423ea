"""A trainer's rounds across its daemon's restart: two real daemons, two trainers.

Daemon A and daemon B (``swarmavg peer`` processes on loopback, B joined through A) each
serve one trainer in this process (a thread with a blocking client). Every trainer does what
a training wrapper does each step: store its progress record, read the run's records, and
average under the period's key (a round every ``--period`` seconds, ``--round-timeout``
each); a failed round (``SwarmError``) is a local step, any other failure of a step ends
the trainer (it crashed). ``--restart-at`` seconds in, daemon A gets Ctrl+C (SIGINT) and
is started again with the same command; the run goes on to ``--duration`` seconds.

Prints ONE JSON line: for trainer A (whose daemon restarted) whether it crashed, its failed
rounds and the gap from its last round before the restart to its first after; for trainer
B (the partner), its failed rounds and its longest round; the daemon's restart time.

    python -m benchmarks.daemon_restart --duration 30 --restart-at 8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from swarmavg.peer import connect
from swarmavg.peer.client.errors import SwarmError


@dataclass
class Trainer:
    """One trainer's log of rounds: (start time, seconds, ok)."""

    name: str
    rounds: list[tuple[float, float, bool]] = field(default_factory=list)
    crashed: str = ""


def start_daemon(
    args: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmavg.peer.cli", "peer", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the daemon bounds its own start (bootstrap timeout)
    if not line:
        raise RuntimeError(f"daemon did not start: {args}")
    return proc, json.loads(line)


def train(trainer: Trainer, control: str, opts: argparse.Namespace, t0: float) -> None:
    x = np.ones(1024, dtype=np.float32)
    try:
        with connect(control) as client:
            while (now := time.time()) < t0 + opts.duration:
                period = int(now // opts.period)
                time.sleep(max((period + 1) * opts.period - time.time(), 0))
                client.dht.store("bench.alive", {"t": time.time()}, ttl=30, subkey=trainer.name)
                client.dht.get("bench.alive")
                began = time.time()
                try:
                    client.average(
                        [x],
                        key=f"bench.round-{period + 1}",
                        group_size=2,
                        min_group_size=2,
                        timeout=opts.round_timeout,
                    )
                    ok = True
                except SwarmError:
                    ok = False
                trainer.rounds.append((began - t0, time.time() - began, ok))
    except Exception as exc:  # a crash of the trainer is what this measures
        trainer.crashed = f"{type(exc).__name__}: {str(exc)[:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--restart-at", type=float, default=8.0)
    parser.add_argument("--period", type=float, default=2.0)
    parser.add_argument("--round-timeout", type=float, default=1.5)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="restart-") as tmp:
        work = Path(tmp)
        (work / "ctl").mkdir(mode=0o700)
        env = {**os.environ, "XDG_RUNTIME_DIR": str(work / "ctl")}
        common = ["--run-id", "bench", "--log-level", "WARNING"]
        a_args = [*common, "--listen", "127.0.0.1:0", "--control", str(work / "ctl" / "a.sock")]
        a_args += ["--identity", str(work / "a.key")]
        daemon_a, ready_a = start_daemon(a_args, env)
        b_args = [*common, "--listen", "127.0.0.1:0", "--control", str(work / "ctl" / "b.sock")]
        daemon_b, ready_b = start_daemon([*b_args, "--join", ready_a["address"]], env)
        # The restarted A listens where it did and joins through B, as a user's rerun would.
        a_again = [*a_args[:5], ready_a["address"], *a_args[6:], "--join", ready_b["address"]]
        t0 = time.time()
        trainers = [Trainer("a"), Trainer("b")]
        threads = [
            threading.Thread(target=train, args=(trainers[0], ready_a["control"], opts, t0)),
            threading.Thread(target=train, args=(trainers[1], ready_b["control"], opts, t0)),
        ]
        for thread in threads:
            thread.start()
        time.sleep(max(t0 + opts.restart_at - time.time(), 0))
        stopped_at = time.time()
        daemon_a.send_signal(signal.SIGINT)
        daemon_a.wait(timeout=30)
        daemon_a, _ = start_daemon(a_again, env)
        restart_s = time.time() - stopped_at
        for thread in threads:
            thread.join(timeout=opts.duration + 120)
        for daemon in (daemon_a, daemon_b):
            daemon.send_signal(signal.SIGINT)
            daemon.wait(timeout=30)
    a, b = trainers
    before = [start for start, _, ok in a.rounds if ok and start < stopped_at - t0]
    after = [start for start, _, ok in a.rounds if ok and start > stopped_at - t0]
    print(
        json.dumps(
            {
                "benchmark": "daemon_restart",
                "duration_s": opts.duration,
                "period_s": opts.period,
                "round_timeout_s": opts.round_timeout,
                "restart_s": round(restart_s, 2),
                "trainer_crashed": a.crashed,
                "trainer_rounds": len(a.rounds),
                "trainer_failed_rounds": sum(not ok for _, _, ok in a.rounds),
                "trainer_gap_s": round(after[0] - before[-1], 2) if before and after else None,
                "partner_rounds": len(b.rounds),
                "partner_failed_rounds": sum(not ok for _, _, ok in b.rounds),
                "partner_longest_round_s": round(max((s for _, s, _ in b.rounds), default=0), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
