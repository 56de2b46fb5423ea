"""A/B of benchmarks/rounds.py between two source trees, interleaved (issue 21).

Runs ``rounds.py`` of a base tree (e.g. a worktree of main, with its own virtualenv) and
of this tree in turns, one peer count at a time (base N=2, head N=2, base N=4, ...),
``--repeats`` times, so the machine's drifting load weighs on both alike. Each run is a
whole ``rounds.py`` invocation (its own daemons, clients and gloo reference). Prints ONE
JSON line: per (peers, codec, mode) the slowest-worker round time of every run of each
tree, their medians, head/base, and each tree's ratio to the gloo time measured in the
same invocation; progress on stderr.

    python benchmarks/rounds_ab.py --base-python /work/main/.venv/bin/python \\
        --base-script /work/main/benchmarks/rounds.py --peers 2,4,8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HEAD_SCRIPT = Path(__file__).resolve().with_name("rounds.py")


def run_once(python: str, script: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One ``rounds.py`` invocation's JSON record, with ``cpu_s``: user+sys seconds of it
    and every process it started (daemons, workers), all reaped by the time it exits."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    argv = [python, script, "--peers", str(n), "--codecs", args.codecs, "--mb", str(args.mb)]
    argv += ["--rounds", str(args.rounds)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.run_timeout)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"{script} N={n} failed ({done.returncode}): {done.stderr[-2000:]}")
    record: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    record["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return record


def _med(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-python", required=True)
    parser.add_argument("--base-script", required=True)
    parser.add_argument("--peers", default="2,4,8")
    parser.add_argument("--codecs", default="none,float16,uint8-blockwise")
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--run-timeout", type=float, default=1800.0)
    parser.add_argument(
        "--raw", type=Path, default=None, help="also write each invocation's JSON line here"
    )
    args = parser.parse_args(argv)
    trees = {
        "base": (args.base_python, args.base_script),
        "head": (sys.executable, str(HEAD_SCRIPT)),
    }
    # (peers, codec, mode) -> tree -> list of (slowest_s, gloo slowest_s, phases)
    runs: dict[tuple[int, str, str], dict[str, list[dict[str, Any]]]] = {}
    loads: list[float] = []
    cpu: dict[tuple[int, str], list[float]] = {}  # (peers, tree) -> CPU s per invocation
    for repeat in range(args.repeats):
        for n in (int(p) for p in args.peers.split(",")):
            order = ["base", "head"] if repeat % 2 == 0 else ["head", "base"]
            for tree in order:
                python, script = trees[tree]
                started = time.monotonic()
                record = run_once(python, script, n, args)
                if args.raw is not None:  # kept even if a later invocation never ends
                    with args.raw.open("a") as raw:
                        raw.write(json.dumps({"tree": tree, "peers": n, **record}) + "\n")
                loads.append(os.getloadavg()[0])
                cpu.setdefault((n, tree), []).append(round(record["cpu_s"], 1))
                print(
                    f"{time.strftime('%H:%M:%S')} ab: {tree} N={n} repeat {repeat} "
                    f"in {time.monotonic() - started:.0f} s, load {loads[-1]:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
                for config in record["configs"]:
                    gloo = (config.get("gloo") or {}).get("slowest_s")
                    for mode in ("default", "given"):
                        figures = config[mode]
                        runs.setdefault((n, config["codec"], mode), {"base": [], "head": []})[
                            tree
                        ].append(
                            {
                                "slowest_s": figures["slowest_s"],
                                "gloo_s": gloo,
                                "failed_rounds": figures["failed_rounds"],
                                "partial_rounds": figures["partial_rounds"],
                                "bit_identical": figures["bit_identical"],
                                "phases_s": figures.get("phases_s"),
                            }
                        )
    table = []
    for (n, codec, mode), by_tree in sorted(runs.items()):
        row: dict[str, Any] = {"peers": n, "codec": codec, "mode": mode}
        for tree, items in by_tree.items():
            times = [i["slowest_s"] for i in items if i["slowest_s"] is not None]
            ratios = [i["slowest_s"] / i["gloo_s"] for i in items if i["slowest_s"] and i["gloo_s"]]
            row[tree] = {
                "slowest_s": [round(t, 4) for t in times],
                "median_s": _med(times),
                "x_gloo": [round(r, 2) for r in ratios],
                "x_gloo_median": _med(ratios),
                "failed_rounds": sum(i["failed_rounds"] for i in items),
                "partial_rounds": sum(i["partial_rounds"] for i in items),
                "bit_identical": all(i["bit_identical"] for i in items),
                "phases_s": [i["phases_s"] for i in items if i["phases_s"]],
            }
        base, head = row["base"]["median_s"], row["head"]["median_s"]
        row["head/base"] = round(head / base, 3) if base and head else None
        table.append(row)
    print(
        json.dumps(
            {
                "benchmark": "rounds_ab",
                "mb": args.mb,
                "rounds": args.rounds,
                "repeats": args.repeats,
                "load_average": [round(x, 1) for x in loads],
                "rows": table,
                # Everything one invocation ran (same rounds in both trees): less noisy
                # than wall time on a loaded machine.
                "cpu_s_per_invocation": {f"{n}/{tree}": v for (n, tree), v in sorted(cpu.items())},
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
