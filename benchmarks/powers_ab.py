"""A/B of issue 17's bounded member powers: a 64 MB butterfly round of 4, this tree vs another.

Runs ``benchmarks/allreduce.py`` (one process per peer, loopback) alternately on this
checkout and on ``--base`` (a worktree of the branch point, imported through a link tree on
``PYTHONPATH`` so that the same virtual environment serves both), ``--pairs`` times per
transport, and prints ONE JSON line: every round time of both sides, their medians, and the
ratio this/base. Interleaving puts both sides under the same load of a shared machine.

    python benchmarks/powers_ab.py --base /path/to/worktree-of-main --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = ("proto", "compression", "dht", "averaging", "peer")
HERE = Path(__file__).resolve().parent.parent


def _link_tree(root: Path, into: Path) -> Path:
    """``into/swarmavg/<pkg>`` -> ``root/<pkg>``: the ``swarmavg.*`` names of ``root``."""
    package = into / "swarmavg"
    package.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        (package / name).symlink_to(root / name)
    return into


def _run(
    tree: Path, pythonpath: str, transport: str, args: argparse.Namespace
) -> tuple[list[float], bool]:
    """One ``allreduce.py`` run: its round times, and whether any round was partial."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    command = [
        sys.executable,
        str(tree / "benchmarks" / "allreduce.py"),
        "--peers",
        "4",
        "--codecs",
        "none",
        "--mb",
        str(args.mb),
        "--rounds",
        str(args.rounds),
        "--transports",
        transport,
    ]
    out = subprocess.run(
        command, env=env, cwd=tree, capture_output=True, text=True, check=True, timeout=600
    )
    [result] = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    if not result["bit_identical"]:
        raise RuntimeError(f"members did not end bit-identical: {result}")
    # A partial round (a member dropped as stalled on a loaded machine) is counted, not
    # hidden: its time is kept, and the JSON line says how many runs had one.
    return [float(x) for x in result["seconds_all"]], bool(result["partial"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="worktree of the branch point")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--transports", default="data,grpc")
    args = parser.parse_args()
    base = Path(args.base).resolve()
    figures: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base_path = f"{_link_tree(base, Path(tmp))}{os.pathsep}{base}"
        for transport in args.transports.split(","):
            times: dict[str, list[float]] = {"base": [], "this": []}
            partial = {"base": 0, "this": 0}
            for _ in range(args.pairs):
                for side, tree, path in (("base", base, base_path), ("this", HERE, str(HERE))):
                    seconds, was_partial = _run(tree, path, transport, args)
                    times[side] += seconds
                    partial[side] += was_partial
            medians = {side: statistics.median(t) for side, t in times.items()}
            figures[transport] = {
                "base_median_s": round(medians["base"], 4),
                "this_median_s": round(medians["this"], 4),
                "ratio_this_over_base": round(medians["this"] / medians["base"], 3),
                "runs_with_a_partial_round": partial,
                "base_all_s": times["base"],
                "this_all_s": times["this"],
            }
    print(
        json.dumps(
            {
                "benchmark": "powers_ab",
                "peers": 4,
                "mb_per_peer": args.mb,
                "pairs": args.pairs,
                "rounds_per_run": args.rounds,
                "load_average": os.getloadavg(),
                "results": figures,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
