"""What the test bed's links can carry at all: raw TCP's goodput in the patterns that matter.

The 100 Mbit/s goal for an all-reduce is stated as a fraction of the link (at
least 0.95 with codec ``none``). This measures, on the same test bed and with no swarmavg
code in the path, the fraction plain TCP reaches:

- ``one_way``: one connection, one direction (the frame ceiling: payload / frame bytes);
- ``both_ways``: one connection each way between two hosts (every uplink also carries the
  ACKs of its downloads, as in an all-reduce);
- ``all_to_all``: every host sends 2 S / N to every other at once (the butterfly's bytes
  with uncoordinated flows), once per congestion control;
- ``all_to_all_shifted``: the same bytes, host i sending to i+1, then i+2, ... in turn, so
  that each host receives from one sender at a time (what a schedule of the butterfly's
  streams could reach), once per congestion control.

for each MTU given (``--mtu 1500,9000``). Fractions are payload bits over the link's rate
and the transfer's span (first accept to last EOF); medians of ``--repeats``. Prints ONE
JSON line; progress on stderr. Needs root, iproute2 and iptables (like the test bed).

    sudo .venv/bin/python -m benchmarks.link_ceiling --mtu 1500,9000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from deploy.testbed import HostSpec, TestBed, missing_requirements
from deploy.testbed.goodput import all_to_all, transfer


def log(message: str) -> None:
    print(f"link_ceiling: {message}", file=sys.stderr, flush=True)


def fraction(payload_bytes: float, seconds: float, rate_mbit: float) -> float:
    return payload_bytes * 8 / seconds / (rate_mbit * 1e6)


def measure(mtu: int, args: argparse.Namespace) -> dict[str, float]:
    """Median fractions of the link for one MTU."""
    n, rate, nbytes = args.hosts, args.rate_mbit, int(args.mb * 1e6)
    per_pair = 2 * nbytes // n  # what a butterfly has each host send to each other host
    samples: dict[str, list[float]] = {"one_way": [], "both_ways": []}
    for cc in args.congestion_controls.split(","):
        samples[f"all_to_all_{cc}"] = []
        samples[f"all_to_all_shifted_{cc}"] = []
    with TestBed([HostSpec(f"h{i}", rate_mbit=rate, mtu=mtu) for i in range(n)]) as bed:
        hosts = list(bed.hosts.values())
        pair_bytes = per_pair * (n - 1)  # one host's whole upload, on one connection
        for repeat in range(args.repeats):
            one = transfer(hosts[0], hosts[1], pair_bytes, timeout=300)
            samples["one_way"].append(fraction(pair_bytes, one.seconds, rate))
            both = all_to_all(hosts[:2], pair_bytes, timeout=300)
            samples["both_ways"].append(fraction(pair_bytes, both.seconds, rate))
            for cc in args.congestion_controls.split(","):
                for shifted, name in (
                    (False, f"all_to_all_{cc}"),
                    (True, f"all_to_all_shifted_{cc}"),
                ):
                    exchange = all_to_all(
                        hosts, per_pair, timeout=300, congestion_control=cc, shifted=shifted
                    )
                    samples[name].append(fraction(pair_bytes, exchange.seconds, rate))
            log(
                f"mtu {mtu} repeat {repeat + 1}: "
                + ", ".join(f"{name} {values[-1]:.3f}" for name, values in samples.items())
            )
    return {name: round(statistics.median(values), 3) for name, values in samples.items()}


def parse_bed_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments (with ``--hosts``), or exit with the reason when there are
    fewer than 2 hosts or this machine cannot build a test bed."""
    args = parser.parse_args()
    if args.hosts < 2:
        parser.error("--hosts must be at least 2")
    reason = missing_requirements()
    if reason is not None:
        parser.error(f"the test bed cannot run here: {reason}")
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mtu", default="1500", help="comma-separated MTUs, one bed each")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--mb", type=float, default=64.0, help="the all-reduce's tensor, MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--congestion-controls", default="cubic,bbr")
    args = parse_bed_arguments(parser)
    figures: dict[str, object] = {
        "benchmark": "link_ceiling",
        "path": "raw TCP (deploy/testbed/tcpprobe.py) between test-bed hosts, tc tbf links",
        "hosts": args.hosts,
        "rate_mbit": args.rate_mbit,
        "tensor_mb": args.mb,
        "repeats": args.repeats,
        "load_average_at_start": round(os.getloadavg()[0], 1),
        "fraction_of_link": {mtu: measure(int(mtu), args) for mtu in args.mtu.split(",") if mtu},
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
