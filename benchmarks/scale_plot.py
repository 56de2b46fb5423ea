"""Plot how swarmavg grows with N from the JSON lines of scale.py and scale_dht.py.

    python -m benchmarks.scale_plot RESULTS.jsonl [MORE.jsonl ...] [--out docs/scale.png]

Reads every line that is a JSON object with ``"benchmark": "scale"`` (averaging swarms) or
``"benchmark": "scale_dht"`` (DHT sizes); prints one JSON line with the points it drew.
Needs matplotlib (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def load(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(averaging runs, DHT sizes), each sorted by N; a later file's N replaces an earlier's."""
    runs: dict[int, dict[str, Any]] = {}
    sizes: dict[int, dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if record.get("benchmark") == "scale":
                runs.update({r["n"]: r for r in record["runs"]})
            elif record.get("benchmark") == "scale_dht":
                sizes.update({s["n"]: s for s in record["sizes"]})
    return [runs[n] for n in sorted(runs)], [sizes[n] for n in sorted(sizes)]


def plot(runs: list[dict[str, Any]], sizes: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    if runs:
        n = [r["n"] for r in runs]
        ax.plot(n, [r["round_s_median"] for r in runs], "o-", label="round, last peer (s)")
        ax.plot(
            n, [r["cpu_s_per_peer_per_round"] for r in runs], "s-", label="CPU s / peer / round"
        )
        ax.plot(n, [r["rss_mib_per_peer"] for r in runs], "^-", label="RSS MiB / peer")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # seconds and MiB differ by orders of magnitude
    ax.set_xlabel("peers N (Moshpit groups of 16)")
    ax.set_title("averaging: time, CPU and memory per peer")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[1]
    if sizes:
        n = [s["n"] for s in sizes]
        ax.plot(n, [s["find_node_hops_mean"] for s in sizes], "o-", label="FIND_NODE hops")
        ax.plot(n, [s["value_hops_mean"] or 0 for s in sizes], "s-", label="value-lookup hops")
        ax.plot(n, [s["get"]["median_ms"] / 10 for s in sizes], "^-", label="get median (10 ms)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DHT nodes N")
    ax.set_title("DHT lookups")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[2]
    if sizes:
        n = [s["n"] for s in sizes]
        ax.plot(n, [s["routing_table_mean"] for s in sizes], "o-", label="routing table (contacts)")
        ax.plot(
            n,
            [s.get("idle_requests_per_node_per_min", 0) for s in sizes],
            "s-",
            label="idle requests / node / min",
        )
    if runs:
        ax.plot(
            [r["n"] for r in runs],
            [r["dht_requests_per_node_per_min"] for r in runs],
            "^-",
            label="requests / node / min during rounds",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N")
    ax.set_title("DHT load per node")
    ax.legend(loc="center")  # the corners hold the small-N and idle points
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/scale.png"))
    args = parser.parse_args()
    runs, sizes = load(args.results)
    plot(runs, sizes, args.out)
    print(
        json.dumps(
            {
                "benchmark": "scale_plot",
                "out": str(args.out),
                "averaging_n": [r["n"] for r in runs],
                "dht_n": [s["n"] for s in sizes],
            }
        )
    )


if __name__ == "__main__":
    main()
