"""What TCP's restart after idle costs a butterfly round on a long link (interleaved pairs).

Between two rounds the data plane's connections idle through matchmaking, longer than an
RTO at long RTTs, and Linux then shrinks their congestion windows
(``net.ipv4.tcp_slow_start_after_idle``; not for congestion controls with their own
``cong_control`` hook, such as BBR). This benchmark measures what that costs: one swarm of
real daemons (the CLI) on the test bed, ``--hosts`` hosts at ``--rate-mbit`` with
``--rtt-ms`` between any two, and rounds of ``--mb`` MB (codec none, group of all hosts)
taken in pairs, the sysctl on in every host's namespace for one round of the pair and off
for the other, the order alternating from pair to pair. The sysctl is host-wide on a real
machine; flipping it here is only the measurement, not a fix.

    sudo .venv/bin/python -m benchmarks.idle_restart --rtt-ms 200 --pairs 5 \
        --daemon-flags "--congestion-control cubic"

Prints ONE JSON line: per setting the round times, the exchange phase of one member
(``allreduce.exchange``) and matchmaking, their medians, and how many pairs the setting
"off" won. Needs root (like the test bed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from deploy.testbed import TestBed, missing_requirements
from deploy.testbed.wan import add_link_arguments, link_figures, uniform_hosts

from . import bandwidth
from .common import DaemonPool

SYSCTL = "net.ipv4.tcp_slow_start_after_idle"


def run(args: argparse.Namespace) -> dict[str, Any]:
    elements = int(args.mb * 1e6) // 4
    flags = shlex.split(args.daemon_flags)
    per_setting: dict[int, list[dict[str, float]]] = {1: [], 0: []}
    off_won = 0
    tmp = tempfile.mkdtemp(prefix="idle-", dir="/tmp")  # unix socket paths stay short
    with TestBed(uniform_hosts(args.hosts, args, rate_mbit=args.rate_mbit)) as bed:
        pool = DaemonPool(Path(tmp))
        workers: list[bandwidth.Worker] = []
        try:
            daemons = bandwidth.start_daemons(bed, pool, Path(tmp), "idle", extra=flags)
            for seed, (host, daemon) in enumerate(zip(bed.hosts.values(), daemons, strict=True)):
                workers.append(bandwidth.Worker(host, daemon.control, seed, elements))

            def one(key: str, n_elements: int) -> bandwidth.Round:
                return bandwidth.one_round(
                    bed, daemons, workers, None, key=key, codec="none", elements=n_elements,
                    timeout=args.timeout, group_size=args.hosts,
                )  # fmt: skip

            one("warm", 1 << 18)  # connections, lazy imports: untimed
            for pair in range(args.pairs):
                seconds: dict[int, float] = {}
                for setting in (1, 0) if pair % 2 == 0 else (0, 1):
                    for host in bed.hosts.values():
                        host.run(["sysctl", "-q", "-w", f"{SYSCTL}={setting}"])
                    done = one(f"pair{pair}-{setting}", elements)
                    seconds[setting] = done.seconds
                    per_setting[setting].append(
                        {
                            "seconds": round(done.seconds, 3),
                            "exchange": round(done.timings.get("allreduce.exchange", 0.0), 3),
                            "matchmaking": round(done.timings.get("matchmaking", 0.0), 3),
                        }
                    )
                    print(f"pair {pair} {SYSCTL}={setting}: {done.seconds:.3f} s", file=sys.stderr)
                off_won += seconds[0] < seconds[1]
        finally:
            for worker in workers:
                worker.close()
            pool.close()
    figures: dict[str, Any] = {
        "benchmark": "idle_restart",
        "hosts": args.hosts,
        "rate_mbit": args.rate_mbit,
        **link_figures(args),
        "tensor_mb": args.mb,
        "pairs": args.pairs,
        "daemon_flags": args.daemon_flags,
        "load_average_at_start": round(os.getloadavg()[0], 1),
        "off_faster_pairs": off_won,
    }
    for setting, name in ((1, "on"), (0, "off")):
        rounds = per_setting[setting]
        figures[name] = {
            "rounds": rounds,
            "median_s": statistics.median(r["seconds"] for r in rounds),
            "median_exchange_s": statistics.median(r["exchange"] for r in rounds),
            "median_matchmaking_s": statistics.median(r["matchmaking"] for r in rounds),
        }
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    add_link_arguments(parser)
    parser.add_argument("--mb", type=float, default=16.0, help="tensor size per host, MB")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0, help="per average() call")
    parser.add_argument("--daemon-flags", default="", help="extra flags of every daemon")
    args = parser.parse_args()
    reason = missing_requirements()
    if reason is not None:
        print(json.dumps({"benchmark": "idle_restart", "skipped": reason}))
        return 1
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
