"""A DHT grown to thousands of nodes in one process, built and queried; prints ONE JSON line.

    python -m benchmarks.scale_dht [--sizes 250,500,1000,2000] [--probes 200] [--idle 40]
                                   [--processes 1]

One swarm is grown node by node (each bootstraps from a random earlier node, with the full
authentication: every request and answer signed and verified, contacts only from
their owners). At each size in ``--sizes``:

- build: seconds to add the nodes since the previous size, and per node;
- ``--probes`` stores then gets of fresh keys, each through a random node (a get from
  another node than the store, always a network lookup): success, latency median / p90,
  value-lookup hops;
- ``--probes`` FIND_NODE lookups of random ids: latency median / p90 and hops (the hop of
  the farthest of the k nearest found; a node from our own table is hop 1);
- routing-table size (contacts per node: mean, max) and the node's size estimate;
- DHT load: requests each node served per minute over ``--idle`` seconds of nothing but
  the nodes' own maintenance (bucket refreshes, rejoin pings), and RPCs per store and get.

With ``--processes P`` > 1 the nodes are spread over P processes (``--dht-worker``), one
swarm over real sockets, probes from the first process: each process then gets its own
share of the cores, as each daemon would. Otherwise all nodes share one event loop and one
``ChannelPool`` (with separate pools 2000 nodes
would open ~10^6 loopback connections); a daemon holds one node, so the latencies here
include queueing behind every other node of the process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from swarmavg.dht import BootstrapError, ChannelPool, DHTConfig, DHTNode
from swarmavg.dht.traversal import traverse


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


JOIN_ATTEMPTS = 4


async def grow(
    nodes: list[DHTNode],
    n: int,
    config: DHTConfig,
    channels: ChannelPool,
    rng: random.Random,
    retried: list[str],
) -> None:
    """Add nodes up to ``n``; a join whose initial peer did not answer (the one loop serves
    every node, so on a loaded machine a reply can miss its deadline) tries another random
    node, as a volunteer would; each retry is recorded in ``retried``."""
    while len(nodes) < n:
        for attempt in range(JOIN_ATTEMPTS):
            initial = [rng.choice(nodes).address] if nodes else []
            cfg = DHTConfig(**{**config.__dict__, "initial_peers": [a for a in initial if a]})
            try:
                nodes.append(await DHTNode.create(cfg, channels=channels))
                break
            except BootstrapError as error:
                if attempt == JOIN_ATTEMPTS - 1:
                    raise
                retried.append(str(error).splitlines()[-1].strip()[:120])


def ms(seconds: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(seconds) * 1e3, 2),
        "p90_ms": round(percentile(seconds, 0.9) * 1e3, 2),
    }


async def probe(
    nodes: list[DHTNode], count: int, rng: random.Random, prefix: str
) -> dict[str, Any]:
    expiration = time.time() + 3600
    store_s, get_s, hops = [], [], []
    stored = found = 0
    writers = []
    rpcs_before = sum(n.protocol.rpcs_sent for n in nodes)
    for i in range(count):
        writer = rng.choice(nodes)
        writers.append(writer)
        t0 = time.perf_counter()
        stored += await writer.store(f"{prefix}-{i}", {"i": i}, expiration)
        store_s.append(time.perf_counter() - t0)
    for i in range(count):
        reader = rng.choice([n for n in nodes if n is not writers[i]])
        before = len(reader.lookup_hops)
        t0 = time.perf_counter()
        value = await reader.get(f"{prefix}-{i}")
        get_s.append(time.perf_counter() - t0)
        found += value is not None and value.value["i"] == i
        if len(reader.lookup_hops) > before:
            hops.append(reader.lookup_hops[-1])
    rpcs = sum(n.protocol.rpcs_sent for n in nodes) - rpcs_before
    find_s, find_hops = [], []
    for _ in range(count):
        target = rng.randbytes(20)
        t0 = time.perf_counter()
        lookup = await traverse(rng.choice(nodes).protocol, [target], want_values=False)
        find_s.append(time.perf_counter() - t0)
        find_hops.append(lookup[target].hops)
    return {
        "store_success": stored / count,
        "get_success": found / count,
        "store": ms(store_s),
        "get": ms(get_s),
        "value_hops_mean": round(statistics.mean(hops), 3) if hops else None,
        "rpcs_per_store_and_get": round(rpcs / (2 * count), 1),
        "find_node": ms(find_s),
        "find_node_hops_mean": round(statistics.mean(find_hops), 3),
        "find_node_hops_max": max(find_hops),
    }


async def idle_load(nodes: list[DHTNode], seconds: float) -> float:
    """Requests served per node per minute while the nodes only run their own maintenance."""
    before = sum(n.protocol.rpcs_received for n in nodes)
    await asyncio.sleep(seconds)
    served = sum(n.protocol.rpcs_received for n in nodes) - before
    return round(served / len(nodes) / (seconds / 60), 2)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = DHTConfig(run_id="bench", request_timeout=5.0)
    channels = ChannelPool()
    nodes: list[DHTNode] = []
    rows = []
    retried: list[str] = []
    build_total = 0.0
    try:
        for size in args.sizes:
            t0 = time.perf_counter()
            before = len(nodes)
            await grow(nodes, size, config, channels, rng, retried)
            took = time.perf_counter() - t0
            build_total += took
            # thousands of nodes' long-lived objects in one process would be rescanned by
            # every full collection (a daemon holds one node): exempt them
            gc.collect()
            gc.freeze()
            progress(f"grown to {size} nodes in {took:.1f} s")
            tables = [n.num_known_peers() for n in nodes]
            row: dict[str, Any] = {
                "n": size,
                "build_s": round(took, 1),
                "build_ms_per_node": round(took * 1e3 / max(size - before, 1), 1),
                "build_total_s": round(build_total, 1),
                "joins_retried": len(retried),
                "routing_table_mean": round(statistics.mean(tables), 1),
                "routing_table_max": max(tables),
                "size_estimate_median": statistics.median(n.size_estimate() for n in nodes),
                "rss_mib_per_node": round(rss_mib() / size, 3),
            }
            row.update(await probe(nodes, args.probes, rng, f"s{size}"))
            if args.idle > 0:
                row["idle_requests_per_node_per_min"] = await idle_load(nodes, args.idle)
            progress(json.dumps(row))
            rows.append(row)
    finally:
        for node in nodes:
            await node.shutdown()
        await channels.close()
    return {"benchmark": "scale_dht", "k": config.k, "alpha": config.alpha, "sizes": rows}


# ------------------------------------------------------- several processes, one swarm


async def dht_worker() -> None:
    """``--dht-worker``: holds a share of the swarm's nodes, driven by JSON lines."""
    loop = asyncio.get_running_loop()
    config = DHTConfig(run_id="bench", request_timeout=5.0)
    channels = ChannelPool()
    nodes: list[DHTNode] = []
    retried: list[str] = []
    print(json.dumps({"event": "ready"}), flush=True)
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            out: dict[str, Any]
            if cmd["op"] == "grow":
                rng = random.Random(cmd["seed"])
                mine: list[DHTNode] = []
                for _ in range(cmd["count"]):
                    known = cmd["join"] + [n.address for n in mine if n.address]
                    for attempt in range(JOIN_ATTEMPTS):
                        initial = [rng.choice(known)] if known else []
                        cfg = DHTConfig(**{**config.__dict__, "initial_peers": initial})
                        try:
                            mine.append(await DHTNode.create(cfg, channels=channels))
                            break
                        except BootstrapError as error:
                            if attempt == JOIN_ATTEMPTS - 1:
                                raise
                            retried.append(str(error)[-120:])
                nodes.extend(mine)
                gc.collect()
                gc.freeze()
                out = {
                    "addresses": [n.address for n in nodes],
                    "retried": len(retried),
                    "rss_mib": rss_mib(),
                    "tables": [n.num_known_peers() for n in nodes],
                    "estimates": [n.size_estimate() for n in nodes],
                }
            elif cmd["op"] == "probe":
                out = await probe(nodes, cmd["count"], random.Random(cmd["seed"]), cmd["prefix"])
            elif cmd["op"] == "served":
                out = {"served": sum(n.protocol.rpcs_received for n in nodes), "nodes": len(nodes)}
            else:
                break
            print(json.dumps(out), flush=True)
    finally:
        for node in nodes:
            await node.shutdown()
        await channels.close()


class DHTWorker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--dht-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, "GRPC_VERBOSITY": "ERROR"},
        )
        self.next()

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def next(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a DHT worker exited (its stderr is this process's)")
        return dict(json.loads(line))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send(op="quit")
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def run_processes(args: argparse.Namespace) -> dict[str, Any]:
    """The same phases with the nodes spread over ``--processes`` processes (one swarm,
    real sockets between them): each process gets its own share of the cores, as each
    daemon would; probes run from the first process."""
    workers = [DHTWorker() for _ in range(args.processes)]
    rows = []
    addresses: list[str] = []
    build_total = 0.0
    current = 0
    try:
        for size in args.sizes:
            t0 = time.perf_counter()
            if current == 0:  # the first node alone founds the DHT
                workers[0].send(op="grow", count=1, join=[], seed=args.seed)
                addresses = workers[0].next()["addresses"]
                current = 1
            add = size - current
            shares = [add // len(workers) + (i < add % len(workers)) for i in range(len(workers))]
            for i, (w, count) in enumerate(zip(workers, shares, strict=True)):
                w.send(op="grow", count=count, join=addresses, seed=args.seed + 1000 * size + i)
            grown = [w.next() for w in workers]
            took = time.perf_counter() - t0
            build_total += took
            addresses = [a for g in grown for a in g["addresses"]]
            current = size
            tables = [t for g in grown for t in g["tables"]]
            progress(f"grown to {size} nodes in {took:.1f} s")
            row: dict[str, Any] = {
                "n": size,
                "processes": len(workers),
                "build_s": round(took, 1),
                "build_ms_per_node": round(took * 1e3 / max(add, 1), 1),
                "build_total_s": round(build_total, 1),
                "joins_retried": sum(g["retried"] for g in grown),
                "routing_table_mean": round(statistics.mean(tables), 1),
                "routing_table_max": max(tables),
                "size_estimate_median": statistics.median(e for g in grown for e in g["estimates"]),
                "rss_mib_per_node": round(sum(g["rss_mib"] for g in grown) / size, 3),
            }
            workers[0].send(op="probe", count=args.probes, seed=args.seed + size, prefix=f"s{size}")
            row.update(workers[0].next())
            if args.idle > 0:
                for w in workers:
                    w.send(op="served")
                before = sum(w.next()["served"] for w in workers)
                time.sleep(args.idle)
                for w in workers:
                    w.send(op="served")
                served = sum(w.next()["served"] for w in workers) - before
                row["idle_requests_per_node_per_min"] = round(served / size / (args.idle / 60), 2)
            progress(json.dumps(row))
            rows.append(row)
    finally:
        for w in workers:
            w.close()
    return {"benchmark": "scale_dht", "k": DHTConfig().k, "alpha": DHTConfig().alpha, "sizes": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dht-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--sizes", default="250,500,1000,2000")
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--idle", type=float, default=40.0, help="seconds of idle load")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if args.dht_worker:
        asyncio.run(dht_worker())
        return
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    result = run_processes(args) if args.processes > 1 else asyncio.run(main_async(args))
    result["cpu_count"] = os.cpu_count()
    result["load_avg_1m_start"] = load_start
    result["load_avg_1m_end"] = os.getloadavg()[0]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
