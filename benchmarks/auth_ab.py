"""A/B of two source trees under one benchmark, interleaved in one run (issue 16's figures).

Runs ``benchmarks/rounds.py`` (real ``swarmavg peer`` daemons) or ``benchmarks/dht.py``
(128 nodes in one process) against a ``--before`` tree and an ``--after`` tree in turn
(ABBA order per repeat, so a drift of the machine's load hits both alike). Each tree is
imported as the package ``swarmavg`` through a link folder put first on ``PYTHONPATH``,
which every daemon and worker the benchmark starts inherits; the interpreter, its packages
and the benchmark scripts are this checkout's, so only the package code differs. A tree
needs its compiled kernel (``compression/_native*.so``; copy it from a built checkout).

Prints ONE JSON line: per configuration the median of every timed round (pooled over
repeats) for each tree, the ratio after/before of those medians, and each repeat's ratio.

    python benchmarks/auth_ab.py --before ../main-tree --what rounds --peers 4,8 --mb 64
    python benchmarks/auth_ab.py --before ../main-tree --what dht --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LINKS = ROOT / "build" / "ab"


def tree_env(label: str, tree: Path) -> dict[str, str]:
    """An environment whose ``import swarmavg`` loads ``tree``."""
    if not any((tree / "compression").glob("_native*.so")):
        raise SystemExit(f"{tree}: no compiled compression/_native*.so (copy one in)")
    folder = LINKS / label
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "swarmavg"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(tree.resolve())
    env = dict(os.environ)
    env["PYTHONPATH"] = str(folder) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    found = subprocess.run(
        [sys.executable, "-c", "import swarmavg.dht.identity as m; print(m.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not found.startswith(str(folder)):
        raise SystemExit(f"{label}: swarmavg resolves to {found}, not to {tree}")
    return env


def progress(sample: dict[str, Any]) -> None:
    """One invocation's samples on stderr, so that an interrupted A/B keeps what it measured."""
    print("sample " + json.dumps(sample), file=sys.stderr, flush=True)


def run_json(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    print(f"$ {' '.join(argv)}", file=sys.stderr, flush=True)
    out = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout, check=False
    ).stdout
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"no JSON line from {argv}")
    return dict(json.loads(lines[-1]))


def rounds_samples(args: argparse.Namespace, n: int, env: dict[str, str]) -> dict[str, Any]:
    """Per mode, the slowest worker's time of every timed round of one invocation."""
    argv = [
        sys.executable,
        str(ROOT / "benchmarks" / "rounds.py"),
        "--peers",
        str(n),
        "--codecs",
        args.codec,
        "--mb",
        str(args.mb),
        "--rounds",
        str(args.rounds),
        "--no-gloo",
    ]
    record = run_json(argv, env, timeout=1800)
    if "error" in record:
        raise RuntimeError(f"rounds.py failed: {record['error']}")
    (config,) = record["configs"]
    samples: dict[str, Any] = {"failed_rounds": 0, "partial_rounds": 0, "inexact": 0}
    for mode in ("default", "given"):
        figures = config[mode]
        # Kept, and counted: on an overloaded machine a stalled member makes a round
        # partial (or a group split) whichever tree runs; the counts say how often.
        samples[mode] = figures["slowest_all"]
        samples["failed_rounds"] += figures["failed_rounds"]
        samples["partial_rounds"] += figures["partial_rounds"]
        samples["inexact"] += not figures["exact_within_tolerance"]
        samples.setdefault("errors", []).extend(figures["errors"][:2])
    samples["load"] = record["load_average_at_start"]
    return samples


def dht_samples(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    argv = [
        sys.executable,
        str(ROOT / "benchmarks" / "dht.py"),
        "--nodes",
        str(args.nodes),
        "--ops",
        str(args.ops),
        "--scale-max",
        "16",
        "--scale-probes",
        "5",
        "--idle-seconds",
        "1",
    ]
    record = run_json(argv, env, timeout=3600)
    keys = ("store_median_ms", "get_median_ms", "store_p99_ms", "get_p99_ms")
    out: dict[str, Any] = {k: [record[k]] for k in keys if k in record}
    out["get_after_store_success"] = record.get("get_after_store_success")
    out["load"] = record.get("load_avg_1m_at_end")
    return out


def summarise(runs: dict[str, list[dict[str, Any]]], metrics: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in metrics:
        pooled = {
            tree: [x for run in runs[tree] for x in run[metric]] for tree in ("before", "after")
        }
        medians = {tree: statistics.median(values) for tree, values in pooled.items()}
        per_repeat = [
            round(statistics.median(a[metric]) / statistics.median(b[metric]), 3)
            for a, b in zip(runs["after"], runs["before"], strict=True)
        ]
        out[metric] = {
            "before_median": round(medians["before"], 4),
            "after_median": round(medians["after"], 4),
            "after/before": round(medians["after"] / medians["before"], 3),
            "after/before per repeat": per_repeat,
            "samples": {tree: len(values) for tree, values in pooled.items()},
        }
    out["load"] = {tree: [run["load"] for run in runs[tree]] for tree in ("before", "after")}
    for count in ("failed_rounds", "partial_rounds", "inexact"):
        if all(count in run for tree in runs for run in runs[tree]):
            out[count] = {tree: sum(run[count] for run in runs[tree]) for tree in runs}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="source tree of the baseline")
    parser.add_argument("--after", default=str(ROOT), help="source tree measured against it")
    parser.add_argument("--what", choices=("rounds", "dht"), default="rounds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", default="4,8", help="rounds: peer counts")
    parser.add_argument("--codec", default="none", help="rounds: the codec")
    parser.add_argument("--mb", type=float, default=64.0, help="rounds: MB of float32 per peer")
    parser.add_argument("--rounds", type=int, default=5, help="rounds: timed rounds per mode")
    parser.add_argument("--nodes", type=int, default=128, help="dht: nodes")
    parser.add_argument("--ops", type=int, default=1000, help="dht: stores and gets")
    args = parser.parse_args()
    envs = {
        "before": tree_env("before", Path(args.before)),
        "after": tree_env("after", Path(args.after)),
    }
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": f"auth_ab/{args.what}",
        "before": str(Path(args.before).resolve()),
        "after": str(Path(args.after).resolve()),
        "repeats": args.repeats,
        "cpu_cores": os.cpu_count(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    try:
        if args.what == "rounds":
            result.update(mb=args.mb, codec=args.codec, rounds=args.rounds, configs={})
            for n in (int(x) for x in args.peers.split(",") if x):
                runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
                for repeat in range(args.repeats):
                    order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
                    for tree in order:
                        runs[tree].append(rounds_samples(args, n, envs[tree]))
                        progress({"peers": n, "tree": tree, **runs[tree][-1]})
                result["configs"][str(n)] = summarise(runs, ["default", "given"])
        else:
            result.update(nodes=args.nodes, ops=args.ops)
            runs = {"before": [], "after": []}
            for repeat in range(args.repeats):
                order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
                for tree in order:
                    runs[tree].append(dht_samples(args, envs[tree]))
                    progress({"tree": tree, **runs[tree][-1]})
            result["dht"] = summarise(runs, ["store_median_ms", "get_median_ms"])
            result["get_after_store_success"] = {
                tree: [run["get_after_store_success"] for run in runs[tree]] for tree in runs
            }
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
