"""DHT benchmark: many nodes in one process on loopback; prints one JSON line.

Phases:
1. ``--nodes`` nodes (default 128), each bootstrapped from a random earlier node.
2. ``--ops`` stores then ``--ops`` gets, each through a random node, one at a time; a get
   runs from a different node than the store and always does a network lookup (every key is
   read once, so lookup-path caches never answer it). Success, latency median/p99, hops.
   Once with the default replication (k=20), once with replication=5 (``r5_*``), hivemind's
   default.
3. Kill 10%, then 30% (cumulative) of the nodes, without any maintenance in between; get every
   key again from random survivors.
4. Grow a swarm to ``--scale-max`` nodes (default 1000); at N = 16, 32, ..., record mean hops
   of value lookups, of FIND_NODE lookups for random ids (hop of the farthest of the k nearest
   found) and the time to create the nodes.
5. Idle: a fresh process with two joined nodes, over ``--idle-seconds`` (default 65, so two
   maintenance rounds of each node fall inside): start time, CPU share, RSS.

All nodes share one ChannelPool (one channel per address): with separate pools 1000 nodes
would open ~10^5 loopback connections in one process. Per-RPC work is the same.

Usage: python -m benchmarks.dht [--nodes 128] [--ops 1000] [--scale-max 1000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from swarmavg.dht import ChannelPool, DHTConfig, DHTNode
from swarmavg.dht.traversal import traverse

HIVEMIND = {
    "store_median_ms": 26.0,
    "store_p99_ms": 104.0,
    "get_median_ms": 19.0,
    "get_p99_ms": 67.0,
}


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def grow(
    nodes: list[DHTNode], n: int, config: DHTConfig, channels: ChannelPool, rng: random.Random
) -> None:
    while len(nodes) < n:
        initial = [rng.choice(nodes).address] if nodes else []
        cfg = DHTConfig(**{**config.__dict__, "initial_peers": [a for a in initial if a]})
        nodes.append(await DHTNode.create(cfg, channels=channels))


async def store_get(
    nodes: list[DHTNode], ops: int, rng: random.Random, prefix: str
) -> dict[str, Any]:
    expiration = time.time() + 3600
    store_ms, get_ms, hops = [], [], []
    stored_ok = found_ok = 0
    writers = []
    for i in range(ops):
        writer = rng.choice(nodes)
        writers.append(writer)
        t0 = time.perf_counter()
        ok = await writer.store(f"{prefix}-{i}", {"i": i, "payload": "x" * 32}, expiration)
        store_ms.append((time.perf_counter() - t0) * 1e3)
        stored_ok += ok
    for i in range(ops):
        reader = rng.choice([n for n in nodes if n is not writers[i]])
        before = len(reader.lookup_hops)
        t0 = time.perf_counter()
        found = await reader.get(f"{prefix}-{i}")
        get_ms.append((time.perf_counter() - t0) * 1e3)
        if found is not None and found.value["i"] == i:
            found_ok += 1
        if len(reader.lookup_hops) > before:
            hops.append(reader.lookup_hops[-1])
    return {
        "store_success": stored_ok / ops,
        "get_after_store_success": found_ok / ops,
        "store_median_ms": round(statistics.median(store_ms), 2),
        "store_p99_ms": round(percentile(store_ms, 0.99), 2),
        "get_median_ms": round(statistics.median(get_ms), 2),
        "get_p99_ms": round(percentile(get_ms, 0.99), 2),
        "mean_hops": round(statistics.mean(hops), 3) if hops else None,
    }


async def get_all(nodes: list[DHTNode], keys: list[str], rng: random.Random) -> float:
    found = 0
    for key in keys:
        found += (await rng.choice(nodes).get(key)) is not None
    return found / len(keys)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = DHTConfig(run_id="bench", request_timeout=2.0)
    out: dict[str, Any] = {
        "nodes": args.nodes,
        "ops": args.ops,
        "k": config.k,
        "alpha": config.alpha,
    }
    channels = ChannelPool()
    nodes: list[DHTNode] = []
    try:
        t0 = time.perf_counter()
        await grow(nodes, args.nodes, config, channels, rng)
        out["create_s"] = round(time.perf_counter() - t0, 2)
        progress(f"created {args.nodes} nodes in {out['create_s']} s")
        # 128 nodes' long-lived objects in one process would be rescanned by every full
        # garbage collection (a real daemon runs one node); exempt them from it
        gc.collect()
        gc.freeze()
        out["known_peers_mean"] = round(statistics.mean(n.num_known_peers() for n in nodes), 1)
        out["size_estimate_median"] = statistics.median(n.size_estimate() for n in nodes)
        rpcs_before = sum(n.protocol.rpcs_sent for n in nodes)
        out.update(await store_get(nodes, args.ops, rng, "k"))
        out["rpcs_per_op"] = round(
            (sum(n.protocol.rpcs_sent for n in nodes) - rpcs_before) / (2 * args.ops), 2
        )
        # hivemind stores 5 replicas by default (DHTNode.create(num_replicas=5)); the same
        # workload with replication=5 compares like with like
        for node in nodes:
            node.config.replication = 5
        r5 = await store_get(nodes, args.ops, rng, "r5")
        for node in nodes:
            node.config.replication = None
        progress("store/get done")
        for name, value in r5.items():
            out[f"r5_{name}"] = value
        for name, value in HIVEMIND.items():
            out[f"{name}_vs_hivemind"] = round(out[name] / value, 3)
            out[f"r5_{name}_vs_hivemind"] = round(out[f"r5_{name}"] / value, 3)

        keys = [f"k-{i}" for i in range(args.ops)]
        survivors = list(nodes)
        for label, fraction in (("kill10", 0.10), ("kill30", 0.30)):
            target = round(args.nodes * (1 - fraction))
            victims = rng.sample(survivors, len(survivors) - target)
            for victim in victims:
                await victim.shutdown()
                survivors.remove(victim)
            t0 = time.perf_counter()
            out[f"{label}_get_success"] = await get_all(survivors, keys, rng)
            out[f"{label}_get_mean_ms"] = round((time.perf_counter() - t0) * 1e3 / len(keys), 2)
        progress("figures so far: " + json.dumps(out))
        for node in survivors:
            await node.shutdown()
        nodes = []

        # O(log N): grow one swarm, measuring value-lookup hops at each size
        scale: list[dict[str, Any]] = []
        grow_total = 0.0
        n = 16
        sizes = []
        while n < args.scale_max:
            sizes.append(n)
            n *= 2
        sizes.append(args.scale_max)
        for size in sizes:
            t0 = time.perf_counter()
            before = len(nodes)
            await grow(nodes, size, config, channels, rng)
            took = time.perf_counter() - t0
            grow_total += took
            gc.collect()
            gc.freeze()
            probe = await store_get(nodes, args.scale_probes, rng, f"s{size}")
            find_hops = []
            for _ in range(args.scale_probes):
                target = rng.randbytes(20)
                lookup = await traverse(rng.choice(nodes).protocol, [target], want_values=False)
                find_hops.append(lookup[target].hops)
            progress(f"grown to {size} nodes in {took:.1f} s; hops {probe['mean_hops']}")
            scale.append(
                {
                    "n": size,
                    "mean_hops": probe["mean_hops"],
                    "find_node_mean_hops": round(statistics.mean(find_hops), 3),
                    "get_success": probe["get_after_store_success"],
                    "get_median_ms": probe["get_median_ms"],
                    "create_ms_per_node": round(took * 1e3 / max(size - before, 1), 1),
                }
            )
        out["scale"] = scale
        out["scale_create_total_s"] = round(grow_total, 1)
    finally:
        for node in nodes:
            await node.shutdown()
        await channels.close()
    return out


IDLE_CHILD = r"""
import asyncio, json, os, sys, time
t0 = time.perf_counter()
from swarmavg.dht import DHTConfig, DHTNode
async def main():
    first = await DHTNode.create(DHTConfig(run_id="bench"))
    ready = time.perf_counter() - t0
    second = await DHTNode.create(DHTConfig(run_id="bench", initial_peers=[first.address]))
    c0 = os.times(); w0 = time.perf_counter()
    await asyncio.sleep(float(sys.argv[1]))
    c1 = os.times(); w1 = time.perf_counter()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    status = open("/proc/self/status").read()
    rss = int(status.split("VmRSS:")[1].split()[0]) / 1024
    peak = int(status.split("VmHWM:")[1].split()[0]) / 1024  # ru_maxrss survives exec
    await second.shutdown()
    await first.shutdown()
    print(json.dumps({"start_s": round(ready, 3), "cpu_percent": round(100 * cpu / (w1 - w0), 3),
                      "rss_mib": round(rss, 1), "peak_rss_mib": round(peak, 1),
                      "seconds": float(sys.argv[1])}))
asyncio.run(main())
"""


def idle_node(seconds: float) -> dict[str, Any]:
    """Two joined nodes idle in a fresh process (maintenance runs every 30 s): start time of
    the first node (imports included), CPU share and RSS of the whole process."""
    out = subprocess.run(
        [sys.executable, "-c", IDLE_CHILD, str(seconds)],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--scale-max", type=int, default=1000)
    parser.add_argument("--scale-probes", type=int, default=100)
    parser.add_argument("--idle-seconds", type=float, default=65.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.ops, args.scale_max, args.scale_probes, args.idle_seconds = (
            32,
            50,
            64,
            20,
            2.0,
        )
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    t0 = time.perf_counter()
    result = asyncio.run(main_async(args))
    result["idle_node"] = idle_node(args.idle_seconds)
    result["cpu_count"] = os.cpu_count()
    result["load_avg_1m_at_end"] = os.getloadavg()[0]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
