"""DHT store/get at 128 nodes, this tree against a baseline tree (issue 16); one JSON line.

A/B interleaved: each round runs one child process per tree (baseline first in even rounds,
this tree first in odd ones, so that drift of the machine's load cancels). Each child starts
``--nodes`` nodes on loopback and does ``--ops`` stores then ``--ops`` gets exactly as phase 2
of benchmarks/dht.py (one at a time, through random nodes), then the same again on the same
swarm (``warm_*``: by then most pairs of nodes have met, so the one-time check of each other's
signed address is cached, as in a swarm that has run a while). The figures are the medians
over rounds of each child's median and p99 latencies and of its CPU time per operation (the
process's CPU seconds over the stores and gets, less sensitive than latency to waiting for a
core on a loaded machine), and the ratio this / baseline. The baseline is a checkout of
another commit (e.g. ``git worktree add`` of main): its folders are linked as ``swarmavg.*``
into a temporary directory put first on PYTHONPATH.

This tree's children also report every limit counter of issue 16 summed over all nodes
(requests refused by the rate limit, stores refused by a quota, contacts refused by the range
limit, answers refused for not binding the dialled address): honest nodes must never hit one.

Usage: python benchmarks/dht_guard_ab.py --baseline /path/to/main [--nodes 128] [--ops 300]
       [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PACKAGES = ("proto", "compression", "dht", "averaging", "peer")


async def child(nodes_n: int, ops: int, seed: int) -> dict[str, Any]:
    # benchmarks/dht.py: the same phase, the same code for both trees
    bench = importlib.import_module("dht")
    from swarmavg.dht import ChannelPool, DHTConfig, DHTNode

    grow, store_get = bench.grow, bench.store_get
    rng = random.Random(seed)
    channels = ChannelPool()
    nodes: list[DHTNode] = []
    try:
        await grow(nodes, nodes_n, DHTConfig(run_id="bench"), channels, rng)
        cpu = time.process_time()
        out = await store_get(nodes, ops, rng, f"ab-{seed}")
        out["cpu_ms_per_op"] = round((time.process_time() - cpu) * 1e3 / (2 * ops), 3)
        # a second pass on the same swarm: nodes have met (verified each other's address
        # bindings once, cached), as in a swarm that has run for a while
        cpu = time.process_time()
        warm = await store_get(nodes, ops, rng, f"ab-warm-{seed}")
        warm["cpu_ms_per_op"] = round((time.process_time() - cpu) * 1e3 / (2 * ops), 3)
        out.update({f"warm_{name}": value for name, value in warm.items()})
        out["limits_present"] = hasattr(nodes[0].protocol, "rate_limiter")
        if out["limits_present"]:
            out["rate_limited_requests"] = sum(n.protocol.rate_limiter.refused for n in nodes)
            out["quota_refused_stores"] = sum(n.storage.ledger.refused for n in nodes)
            out["range_refused_contacts"] = sum(n.routing.refused_by_range for n in nodes)
            out["unproven_answers"] = sum(n.protocol.unproven_answers for n in nodes)
        out["rpcs_received"] = sum(n.protocol.rpcs_received for n in nodes)
        return out
    finally:
        for node in nodes:
            await node.shutdown()
        await channels.close()


def link_tree(baseline: Path, into: Path) -> Path:
    package = into / "swarmavg"
    package.mkdir()
    for name in PACKAGES:
        (package / name).symlink_to(baseline / name)
    return into


def run_child(pythonpath: str | None, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, __file__, "--child", "--nodes", str(args.nodes)]
    command += ["--ops", str(args.ops), "--seed", str(seed)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="checkout of the baseline commit")
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        print(json.dumps(asyncio.run(child(args.nodes, args.ops, args.seed))))
        return
    if args.baseline is None:
        parser.error("--baseline is required")
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        baseline_path = str(link_tree(args.baseline.resolve(), Path(tmp)))
        for r in range(args.rounds):
            seed = args.seed + r  # the same swarm and keys for both trees in one round
            order = [("baseline", baseline_path), ("this", None)]
            for name, path in order if r % 2 == 0 else order[::-1]:  # ABBA: drift cancels
                t0 = time.perf_counter()
                runs[name].append(run_child(path, args, seed))
                print(
                    f"round {r} {name}: {time.perf_counter() - t0:.0f} s "
                    f"{json.dumps(runs[name][-1])}",
                    file=sys.stderr,
                    flush=True,
                )
    out: dict[str, Any] = {"nodes": args.nodes, "ops": args.ops, "rounds": args.rounds}
    metrics = ("store_median_ms", "store_p99_ms", "get_median_ms", "get_p99_ms", "cpu_ms_per_op")
    for metric in (*metrics, *(f"warm_{m}" for m in metrics)):
        for name in runs:
            out[f"{name}_{metric}"] = round(statistics.median(r[metric] for r in runs[name]), 2)
        out[f"ratio_{metric}"] = round(out[f"this_{metric}"] / out[f"baseline_{metric}"], 3)
    for name in runs:
        out[f"{name}_store_success"] = min(r["store_success"] for r in runs[name])
        out[f"{name}_get_success"] = min(r["get_after_store_success"] for r in runs[name])
    for counter in (
        "rate_limited_requests",
        "quota_refused_stores",
        "range_refused_contacts",
        "unproven_answers",
    ):
        out[counter] = sum(r[counter] for r in runs["this"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
