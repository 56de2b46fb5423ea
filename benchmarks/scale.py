"""Moshpit averaging at scale: N real peers in a few processes; prints ONE JSON line.

    python -m benchmarks.scale [--peers 16,64,128,256] [--group-size 16] [--processes 4]
                               [--elements 4096] [--timeout 120]

For each N, ``--processes`` worker processes (``--worker`` mode of this script) each run
N / processes peers on one event loop (uvloop when installed, as the daemon): every peer is
a DHT node, an ``Averager`` with its own gRPC server and its own data plane, wired like the
daemon (one shared ``ChannelPool`` per process, as the DHT benchmark does). Peer ``p`` lives
in process ``p % processes``, so every group spans processes and real sockets.

The peers sit on a Moshpit grid (Ryabinin et al. 2021, section 3.1): ``N = g * 2**b`` with
``g = --group-size`` and ``b <= log2 g``; peer ``p`` starts with group bits ``p // g``
(``b`` bits). Round 0 averages the ``N / g`` groups of ``g`` that share their bits; the
averager then shifts in bits from its index in the group, and round 1 groups take
``g / 2**b`` peers from every round-0 group, so after ``ceil(log_g N)`` rounds (2 for
256 = 16 x 16) every peer must hold the exact global mean. Peer ``p`` averages
``p + (i mod 7)`` at element ``i`` (float32): every partial mean is exact in float32, so the
check is equality, not a tolerance.

Per N: the time from the common start to the last peer's return in each round, medians of
matchmaking and all-reduce time, bytes sent + received per peer per round, RSS per peer
(each worker's RSS growth while creating its peers, over its peers), DHT load (requests
each node served per minute during the rounds; routing-table size) and whether every peer
holds the exact global mean.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

RUN_ID = "scale"


def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    status = Path("/proc/self/status").read_text()
    rss = int(status.split("VmRSS:")[1].split()[0]) / 1024
    peak = int(status.split("VmHWM:")[1].split()[0]) / 1024
    return rss, peak


def peer_tensor(p: int, elements: int) -> np.ndarray:
    """Peer ``p``'s contribution: ``p + (i mod 7)``; means over any grid slice are exact."""
    return (p + np.arange(elements) % 7).astype(np.float32)


def grid_bits(n: int, group_size: int) -> int:
    """Bits of the initial group id: N = group_size * 2**bits, bits <= log2(group_size)."""
    groups = n // group_size
    if n % group_size or groups & (groups - 1):
        raise ValueError(f"--peers {n} must be --group-size {group_size} times a power of 2")
    bits = groups.bit_length() - 1
    if bits > math.log2(group_size):
        raise ValueError(f"{n} peers need more than 2 rounds of groups of {group_size}")
    return bits


def grid_rounds(n: int, group_size: int) -> int:
    """Rounds after which every peer holds the global mean: ceil(log_g N)."""
    return 1 if n <= group_size else 2


# ------------------------------------------------------------------------------ worker


class WorkerPeers:
    """The peers of one worker process and what they hold between rounds."""

    def __init__(self) -> None:
        self.peers: list[Any] = []  # (index, node, averager, server)
        self.tensors: dict[int, np.ndarray] = {}
        self.addresses: list[str] = []

    async def create(self, cmd: dict[str, Any], channels: Any) -> dict[str, Any]:
        import grpc

        from swarmavg.averaging import Averager, AveragerConfig
        from swarmavg.averaging.allreduce.config import AllReduceConfig
        from swarmavg.averaging.matchmaking.matchmaker import MatchmakerConfig
        from swarmavg.dht import DHTConfig, DHTNode

        rng = random.Random(cmd["seed"])
        known = list(cmd["join"])
        before = rss_mib()[0]
        started = time.perf_counter()
        for p in cmd["indices"]:
            initial = [rng.choice(known)] if known else []
            node = DHTNode(DHTConfig(run_id=RUN_ID, initial_peers=initial), channels=channels)
            server = grpc.aio.server()
            node.add_to_server(server)
            config = AveragerConfig(
                matchmaking_time=cmd["matchmaking_time"],
                target_group_size=cmd["group_size"],
                group_bits=format(p // cmd["group_size"], f"0{cmd['bits']}b")
                if cmd["bits"]
                else "",
                # every peer of this process shares one loop on shared cores: a member can
                # lag by seconds without being dead (as in tests/averaging/averager_swarm.py)
                allreduce=AllReduceConfig(min_stall=cmd["min_stall"]),
                # the leader's first reply is as slow as the loop it shares with N / processes
                # other peers: a follower that gives up on it after the default 2 s may leave
                # a seat it was already given (docs/benchmarks.md, "Scale")
                matchmaker=MatchmakerConfig(
                    join_timeout=cmd["join_timeout"], poll_interval=cmd["poll_interval"]
                ),
            )
            averager = Averager(node, config, channels)
            averager.add_to_server(server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            address = f"127.0.0.1:{port}"
            await node.start(address)
            await averager.start()
            self.peers.append((p, node, averager, server))
            self.tensors[p] = peer_tensor(p, cmd["elements"])
            known.append(address)
            self.addresses.append(address)
        return {
            "addresses": self.addresses,
            "create_s": time.perf_counter() - started,
            "rss_before_mib": before,
            "rss_after_mib": rss_mib()[0],
        }

    async def round(self, cmd: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, cmd["start_at"] - time.time()))
        served_before = sum(node.protocol.rpcs_received for _, node, _, _ in self.peers)
        cpu_before = os.times()
        t0 = time.time()

        async def one(p: int, averager: Any) -> dict[str, Any]:
            try:
                res = await averager.average(
                    [self.tensors[p]],
                    cmd["key"],
                    group_size=cmd["group_size"],
                    min_group_size=cmd["group_size"],
                    timeout=cmd["timeout"],
                )
            except Exception as error:  # reported to the coordinator, which judges it
                return {"p": p, "ok": False, "error": repr(error), "done": time.time() - t0}
            self.tensors[p] = res.tensors[0]
            return {
                "p": p,
                "ok": True,
                "done": time.time() - t0,
                "group": str(res.group_id),
                "group_size": res.group_size,
                "partial": res.partial,
                "matchmaking": res.timings["matchmaking"],
                "allreduce": res.timings["allreduce"],
                "bytes": res.bytes_sent + res.bytes_received,
                "local_fraction": res.local_fraction,
            }

        results = await asyncio.gather(*(one(p, a) for p, _, a, _ in self.peers))
        served = sum(node.protocol.rpcs_received for _, node, _, _ in self.peers) - served_before
        cpu = os.times()
        return {
            "cpu_s": (cpu.user - cpu_before.user) + (cpu.system - cpu_before.system),
            "results": results,
            "dht_served": served,
            "seconds": time.time() - t0,
            "routing_sizes": [node.num_known_peers() for _, node, _, _ in self.peers],
            "rss_mib": rss_mib()[0],
            "peak_rss_mib": rss_mib()[1],
        }

    def check(self, elements: int, n: int) -> dict[str, Any]:
        expected = ((n - 1) / 2 + np.arange(elements) % 7).astype(np.float32)
        exact = [p for p, t in self.tensors.items() if np.array_equal(t, expected)]
        return {"exact": len(exact), "peers": len(self.tensors)}

    async def close(self) -> None:
        for _, node, averager, server in self.peers:
            await server.stop(None)
            await averager.shutdown(grace=0.0)
            await node.shutdown()


async def worker(log_level: str) -> None:
    import gc
    import logging

    if log_level:
        # for a post-mortem of a round (which peers found no group, who closed with whom):
        # "info" or e.g. "info,swarmavg.averaging.matchmaking=debug"
        root, *loggers = log_level.split(",")
        logging.basicConfig(
            level=root.upper(),
            format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
        )
        for item in loggers:
            name, _, level = item.partition("=")
            logging.getLogger(name).setLevel(level.upper())

    from swarmavg.dht import ChannelPool

    loop = asyncio.get_running_loop()
    channels = ChannelPool()
    peers = WorkerPeers()
    print(json.dumps({"event": "ready"}), flush=True)
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                break
            if op == "create":
                out = await peers.create(cmd, channels)
                # dozens of peers' long-lived objects in one process would be rescanned by
                # every full collection (a daemon holds one peer): exempt them
                gc.collect()
                gc.freeze()
            elif op == "round":
                out = await peers.round(cmd)
            elif op == "check":
                out = peers.check(cmd["elements"], cmd["n"])
            else:
                out = {"error": f"unknown op {op}"}
            print(json.dumps(out), flush=True)
    finally:
        await peers.close()
        await channels.close()


# ------------------------------------------------------------------------------ coordinator


class Worker:
    """One worker process driven by JSON lines."""

    def __init__(self, log_dir: Path, name: str, log_level: str) -> None:
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", "--log-level", log_level],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
                env={**os.environ, "GRPC_VERBOSITY": "ERROR"},
            )
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.next(120.0)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def next(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                return dict(json.loads(self.lines.get(timeout=1.0)))
            if self.proc.poll() is not None and self.lines.empty():
                raise RuntimeError(f"worker exited; log: {self.log_path}")
        raise RuntimeError(f"no answer from worker; log: {self.log_path}")

    def ask(self, timeout: float, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.next(timeout)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.send(op="quit")
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.reader.join(5)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_swarm(n: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    g = args.group_size
    bits = grid_bits(n, g)
    processes = min(args.processes, n)
    workers = [Worker(log_dir, f"n{n}-w{i}", args.log_level) for i in range(processes)]
    try:
        common = {
            "group_size": g,
            "bits": bits,
            "elements": args.elements,
            "matchmaking_time": args.timeout / 2,
            "join_timeout": args.join_timeout,
            "poll_interval": args.poll_interval,
            "min_stall": args.min_stall,
        }
        # the first peer alone founds the DHT; each worker's peers then join through a
        # random peer created before them (the first, or an earlier one of their worker)
        first = workers[0].ask(120.0, op="create", indices=[0], join=[], seed=0, **common)
        created: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for i, w in enumerate(workers):
            indices = [p for p in range(n) if p % processes == i and p != 0]
            w.send(op="create", indices=indices, join=first["addresses"], seed=i + 1, **common)
        for w in workers:
            created.append(w.next(1200.0))
        create_s = time.perf_counter() - t0
        progress(f"{n} peers created in {create_s:.1f} s")
        rss_growth = [c["rss_after_mib"] - c["rss_before_mib"] for c in created]
        rss_growth[0] += first["rss_after_mib"] - first["rss_before_mib"]
        rounds = []
        for r in range(grid_rounds(n, g)):
            start_at = time.time() + 2.0
            for w in workers:
                w.send(
                    op="round",
                    key=f"round-{r}",
                    start_at=start_at,
                    timeout=args.timeout,
                    group_size=g,
                )
            answers = [w.next(args.timeout + 120.0) for w in workers]
            results = [x for a in answers for x in a["results"]]
            # every peer's outcome (its NoGroupError names who it expected, saw and refused)
            (log_dir / f"n{n}-round{r}.json").write_text(json.dumps(results, indent=1))
            ok = [x for x in results if x["ok"]]
            seconds = max(a["seconds"] for a in answers)
            served = sum(a["dht_served"] for a in answers)
            routing = [s for a in answers for s in a["routing_sizes"]]
            row = {
                "round": r,
                "ok": len(ok),
                "errors": sorted({x["error"] for x in results if not x["ok"]})[:3],
                "groups": len({x["group"] for x in ok}),
                "group_sizes": sorted({x["group_size"] for x in ok}),
                "partial": sum(x["partial"] for x in ok),
                # share of the elements that kept local values (parts whose reducer stalled)
                "local_fraction_mean": round(statistics.mean(x["local_fraction"] for x in ok), 4)
                if ok
                else None,
                "last_peer_s": round(max(x["done"] for x in results), 3),
                "matchmaking_median_s": round(statistics.median(x["matchmaking"] for x in ok), 3)
                if ok
                else None,
                "allreduce_median_s": round(statistics.median(x["allreduce"] for x in ok), 3)
                if ok
                else None,
                "bytes_per_peer_median": int(statistics.median(x["bytes"] for x in ok))
                if ok
                else None,
                "dht_requests_per_node_per_min": round(served / n / (seconds / 60), 1),
                "routing_table_mean": round(statistics.mean(routing), 1),
                "peak_rss_mib_per_peer": round(sum(a["peak_rss_mib"] for a in answers) / n, 2),
                # what the round costs each peer's CPU, whatever the machine's load
                "cpu_s_per_peer": round(sum(a["cpu_s"] for a in answers) / n, 3),
            }
            progress(f"N={n} round {r}: {json.dumps(row)}")
            rounds.append(row)
        checks = [w.ask(60.0, op="check", elements=args.elements, n=n) for w in workers]
        exact = sum(c["exact"] for c in checks)
        return {
            "n": n,
            "group_size": g,
            "processes": processes,
            "rounds": rounds,
            "create_s": round(create_s, 1),
            "rss_mib_per_peer": round(sum(rss_growth) / n, 2),
            "exact_global_mean_peers": exact,
            "exact_global_mean": exact == n,
            "round_s_median": round(statistics.median(r["last_peer_s"] for r in rounds), 3),
            "bytes_per_peer_per_round": int(
                statistics.median(r["bytes_per_peer_median"] or 0 for r in rounds)
            ),
            "dht_requests_per_node_per_min": round(
                statistics.median(r["dht_requests_per_node_per_min"] for r in rounds), 1
            ),
            "routing_table_mean": rounds[-1]["routing_table_mean"],
            "cpu_s_per_peer_per_round": round(
                statistics.median(r["cpu_s_per_peer"] for r in rounds), 3
            ),
        }
    finally:
        for w in workers:
            w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peers", default="16,64,128,256", help="comma-separated N")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--elements", type=int, default=4096, help="float32 per peer")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per round")
    parser.add_argument(
        "--join-timeout", type=float, default=10.0, help="MatchmakerConfig.join_timeout"
    )
    parser.add_argument(
        "--poll-interval", type=float, default=0.5, help="MatchmakerConfig.poll_interval"
    )
    parser.add_argument("--min-stall", type=float, default=20.0, help="AllReduceConfig.min_stall")
    parser.add_argument(
        "--log-level", default="", help="the workers' log level (their logs: the log folder)"
    )
    args = parser.parse_args()
    if args.worker:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(worker(args.log_level))
        return
    sizes = [int(n) for n in args.peers.split(",")]
    for n in sizes:
        grid_bits(n, args.group_size)  # fail before starting anything
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    log_dir = Path(tempfile.mkdtemp(prefix="scale-"))  # workers' stderr, kept for a post-mortem
    progress(f"worker logs in {log_dir}")
    runs = [run_swarm(n, args, log_dir) for n in sizes]
    print(
        json.dumps(
            {
                "benchmark": "scale",
                "elements_float32": args.elements,
                "join_timeout": args.join_timeout,
                "poll_interval": args.poll_interval,
                "min_stall": args.min_stall,
                "runs": runs,
                "cpu_count": os.cpu_count(),
                "load_avg_1m_start": load_start,
                "load_avg_1m_end": os.getloadavg()[0],
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
