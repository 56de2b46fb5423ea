"""What parallel connections per peer pair buy a butterfly's bytes on long links (raw TCP).

Every host sends 2 S / N to every other at once over plain TCP (deploy/testbed/tcpprobe.py,
no swarmavg code), split over ``--connections`` connections per pair, for each congestion
control of ``--congestion-controls``: the candidates for "parallel streams per reducer",
each connection with its own initial window and its own share of the window growth, before
any protocol carries them. Settings take turns within each repeat (the order rotating), so
the load of a shared machine weighs on all alike. Figures per setting: the median span
(first accept to last EOF), its fraction of the link, and the hosts' TCP counters over
all repeats (deploy/testbed/tcpstats.py: retransmitted share, HyStart exits per
exchange). Needs root, like the test bed. Prints ONE JSON line.

    sudo .venv/bin/python -m benchmarks.parallel_streams --rtt-ms 200 --mb 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from deploy.testbed import TestBed
from deploy.testbed.goodput import all_to_all
from deploy.testbed.tcpstats import counter_delta, read_counters
from deploy.testbed.wan import add_link_arguments, link_figures, uniform_hosts

from .link_ceiling import fraction, parse_bed_arguments


def log(message: str) -> None:
    print(f"parallel_streams: {message}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    add_link_arguments(parser)
    parser.add_argument("--mb", type=float, default=16.0, help="the all-reduce's tensor, MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--connections", default="1,2,4", help="per pair, comma-separated")
    parser.add_argument("--congestion-controls", default="cubic,bbr")
    args = parse_bed_arguments(parser)
    n, rate = args.hosts, args.rate_mbit
    per_pair = 2 * int(args.mb * 1e6) // n
    settings = [
        (cc, int(k))
        for cc in args.congestion_controls.split(",")
        if cc
        for k in args.connections.split(",")
        if k
    ]
    spans: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
    counters: dict[tuple[str, int], dict[str, int]] = {s: {} for s in settings}
    with TestBed(uniform_hosts(n, args, rate_mbit=rate)) as bed:
        hosts = list(bed.hosts.values())
        for repeat in range(args.repeats):
            shift = repeat % len(settings)
            for cc, k in settings[shift:] + settings[:shift]:
                before = [read_counters(host) for host in hosts]
                exchange = all_to_all(
                    hosts, per_pair, timeout=300, congestion_control=cc, connections_per_pair=k
                )
                spans[cc, k].append(exchange.seconds)
                total = counters[cc, k]
                for host, old in zip(hosts, before, strict=True):
                    for name, value in counter_delta(read_counters(host), old).items():
                        total[name] = total.get(name, 0) + value
                log(f"repeat {repeat + 1} {cc} x{k}: {exchange.seconds:.2f} s")
    results: dict[str, Any] = {}
    for (cc, k), values in spans.items():
        total = counters[cc, k]
        seconds = statistics.median(values)
        sent = total.get("OutSegs", 0)
        results[f"{cc}_x{k}"] = {
            "seconds": round(seconds, 3),
            "all_seconds": [round(v, 3) for v in values],
            "fraction_of_link": round(fraction(per_pair * (n - 1), seconds, rate), 3),
            "retransmitted_fraction": round(total.get("RetransSegs", 0) / sent, 4) if sent else 0,
            "hystart_exits_per_exchange": round(
                (total.get("TCPHystartTrainDetect", 0) + total.get("TCPHystartDelayDetect", 0))
                / len(values),
                1,
            ),
        }
    print(
        json.dumps(
            {
                "benchmark": "parallel_streams",
                "path": "raw TCP (deploy/testbed/tcpprobe.py), butterfly pattern, tc tbf links",
                "hosts": n,
                "rate_mbit": rate,
                **link_figures(args),
                "tensor_mb": args.mb,
                "repeats": args.repeats,
                "load_average_at_start": round(os.getloadavg()[0], 1),
                "settings": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
