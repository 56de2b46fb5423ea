"""The long-link options the test bed's benchmarks share: one round-trip time, jitter and loss
for every host's link, given on the command line.

    parser = argparse.ArgumentParser()
    add_link_arguments(parser)
    args = parser.parse_args()
    TestBed(uniform_hosts(4, args, rate_mbit=100))

Every host gets the same link, so the round-trip time between any two hosts is ``--rtt-ms``:
each link's one-way delay is a quarter of it (a round trip crosses two links twice).
"""

from __future__ import annotations

import argparse
from typing import Any

from deploy.testbed.bed import HostSpec


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--rtt-ms``, ``--jitter-ms`` and ``--loss`` to ``parser``."""
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="round-trip time between any two hosts (each link delays a quarter of it each "
        "way; deploy/testbed/wire.c); default 0",
    )
    parser.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="each link's delay varies within +- this (at most --rtt-ms / 4); default 0",
    )
    parser.add_argument(
        "--loss",
        type=float,
        default=0.0,
        help="probability that a link drops a frame, each link and direction; default 0",
    )


def uniform_hosts(
    n: int, args: argparse.Namespace, *, rate_mbit: float | None, mtu: int | None = None
) -> list[HostSpec]:
    """``n`` hosts ``h0``... with the same link: ``rate_mbit``, ``mtu`` and ``args``'s delay."""
    return [
        HostSpec(
            f"h{i}",
            rate_mbit=rate_mbit,
            mtu=mtu,
            delay_ms=args.rtt_ms / 4,
            jitter_ms=args.jitter_ms,
            loss=args.loss,
        )
        for i in range(n)
    ]


def link_figures(args: argparse.Namespace) -> dict[str, Any]:
    """The link options as JSON fields of a benchmark's line."""
    return {"rtt_ms": args.rtt_ms, "jitter_ms": args.jitter_ms, "loss": args.loss}
