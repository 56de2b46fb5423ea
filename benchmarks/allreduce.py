"""Butterfly all-reduce vs torch.distributed gloo, one process per peer, on loopback.

For each group size, spawns that many worker processes. Each runs a grpc.aio server with
an :class:`AllReduceService` (uvloop) and holds ``--mb`` MB of float32. The parent forms
the group by hand from their addresses and starts every round at the same monotonic
instant; a round's time is the slowest member's. Then the same processes run gloo's
``all_reduce`` on a tensor of the same size. Prints ONE JSON line.

    python -m benchmarks.allreduce --peers 2,4,8 --codecs none,float16,uint8-blockwise
    python -m benchmarks.allreduce --peers 4,8 --codecs none \
        --aggregations mean,centered-clip,trimmed-mean

``--aggregations``: the reducers' rules (docs/averaging.md, "Aggregation"), run A/B in one
process set: every round runs each rule in turn, so a load change hits them all. The
robust rules do not give the weighted mean of this data (its members differ by design),
so their ``max_error`` is only reported, not a check.

Data: member ``i`` holds ``base * (1 + i/10) + i`` with weight ``1 + i % 3``; the exact
weighted mean is then ``a * base + b`` and every worker checks its result against it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import hashlib
import itertools
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np

ROUND_TIMEOUT = 120.0


def _weight(rank: int) -> float:
    return 1.0 + rank % 3


def _data(base: np.ndarray, rank: int) -> np.ndarray:
    return (base * np.float32(1 + rank / 10) + np.float32(rank)).astype(np.float32)


def _expected(base: np.ndarray, n: int) -> np.ndarray:
    w = np.array([_weight(i) for i in range(n)])
    a = float((w * (1 + np.arange(n) / 10)).sum() / w.sum())
    b = float((w * np.arange(n)).sum() / w.sum())
    return base.astype(np.float64) * a + b


def _send(conn: mp.connection.Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn: mp.connection.Connection) -> dict[str, Any]:
    try:
        message: dict[str, Any] = json.loads(conn.recv_bytes())
    except EOFError:
        raise RuntimeError("a benchmark worker died (see its traceback above)") from None
    return message


async def _worker(rank: int, n: int, elements: int, conn: mp.connection.Connection) -> None:
    import logging

    logging.basicConfig(level=os.environ.get("BENCH_LOG", "WARNING"))
    import grpc

    from swarmavg.averaging.aggregation import canonical_aggregation
    from swarmavg.averaging.allreduce.config import AllReduceConfig
    from swarmavg.averaging.allreduce.runner import run_allreduce
    from swarmavg.averaging.allreduce.service import AllReduceService
    from swarmavg.averaging.group import GroupInfo, Member, Mode, schema_hash
    from swarmavg.averaging.service import reduce_method_handler
    from swarmavg.dht import Authenticator, ChannelPool, Identity, RequestSigner

    class Servicer:
        def __init__(self) -> None:
            self.service: AllReduceService | None = None

        async def Reduce(self, request_iterator: Any, context: Any) -> None:
            assert self.service is not None
            await self.service.rpc_reduce(request_iterator, context)

    loop = asyncio.get_running_loop()
    identity = Identity.generate()
    servicer = Servicer()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "swarmavg.v1.Averaging", {"Reduce": reduce_method_handler(servicer.Reduce)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    pool = ChannelPool()
    base = np.random.default_rng(0).standard_normal(elements).astype(np.float32)
    tensors = [_data(base, rank)]
    expected = _expected(base, n)
    del base
    _send(conn, {"address": address, "peer_id": identity.peer_id.hex()})
    service: AllReduceService | None = None
    profiler: cProfile.Profile | None = None
    last: Any = None  # the latest round's outcome, until the parent asks for its check
    try:
        while True:
            command = await loop.run_in_executor(None, _recv, conn)
            if command["op"] == "stop":
                break
            if command["op"] == "config":
                if service is not None:
                    await service.close()
                service = AllReduceService(
                    Authenticator(identity, "bench"),
                    AllReduceConfig(
                        chunk_bytes=command["chunk_bytes"],
                        executor_threads=command["threads"],
                        data_plane=command["transport"] == "data",
                    ),
                )
                servicer.service = service
                data_port = await service.start_data_plane("127.0.0.1")
                if command.get("profile") and rank == 0:
                    profiler = cProfile.Profile(time.thread_time)  # CPU, not wall
                _send(conn, {"ok": True, "data_port": data_port})
                continue
            if command["op"] == "round":
                assert service is not None
                members = tuple(
                    Member(bytes.fromhex(pid), addr, Mode.NODE, 1.0, data_port=data_port)
                    for pid, addr, data_port in command["members"]
                )
                group = GroupInfo(
                    bytes.fromhex(command["group_id"]),
                    members,
                    schema_hash(tensors),
                    command["codec"],
                    canonical_aggregation(command.get("aggregation", "mean")),
                )
                await asyncio.sleep(max(0.0, command["start_at"] - time.monotonic()))
                start = time.monotonic()
                cpu_before = resource.getrusage(resource.RUSAGE_SELF)
                if profiler is not None:
                    profiler.enable()
                outcome = await run_allreduce(
                    group,
                    rank,
                    tensors,
                    _weight(rank),
                    deadline=start + ROUND_TIMEOUT,
                    service=service,
                    channels=pool,
                    signer=RequestSigner(identity, "bench", lambda: address),
                )
                if profiler is not None:
                    profiler.disable()
                end = time.monotonic()
                cpu_after = resource.getrusage(resource.RUSAGE_SELF)
                cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (
                    cpu_after.ru_stime - cpu_before.ru_stime
                )
                last = outcome
                _send(
                    conn,
                    {
                        "start": start,
                        "end": end,
                        "partial": outcome.partial,
                        "cpu": cpu,
                        "bytes_sent": outcome.bytes_sent,
                        "timings": outcome.timings,
                    },
                )
                continue
            if command["op"] == "check":
                # Only once every member finished: checking costs ~0.1 s of CPU per peer,
                # which would otherwise slow down the members still in the round.
                assert last is not None
                result = last.tensors[0]
                error = float(np.abs(result.astype(np.float64) - expected).max())
                digest = hashlib.sha1(result.tobytes()).hexdigest()
                last = None
                _send(conn, {"error": error, "digest": digest})
                continue
            if command["op"] == "gloo":
                _send(conn, {"seconds": _gloo(rank, n, elements, command)})
                continue
            if command["op"] == "profile-dump" and profiler is not None:
                profiler.dump_stats(command["path"])
                profiler = None
                _send(conn, {"ok": True})
                continue
            _send(conn, {"ok": False})
    finally:
        if service is not None:
            await service.close()
        await pool.close()
        await server.stop(None)


def _gloo(rank: int, n: int, elements: int, command: dict[str, Any]) -> list[float]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{command['port']}", world_size=n, rank=rank
    )
    try:
        tensor = torch.from_numpy(
            np.random.default_rng(rank).standard_normal(elements).astype(np.float32)
        )
        times = []
        for _ in range(command["rounds"] + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        return times[1:]  # the first round sets up connections
    finally:
        dist.destroy_process_group()


def _worker_main(rank: int, n: int, elements: int, conn: mp.connection.Connection) -> None:
    try:
        import uvloop

        uvloop.run(_worker(rank, n, elements, conn))
    except ImportError:
        asyncio.run(_worker(rank, n, elements, conn))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def bench_group(
    n: int,
    elements: int,
    codecs: list[str],
    aggregations: list[str],
    chunk_kib: list[int],
    executor_threads: list[int],
    transports: list[str],
    rounds: int,
    profile: str | None,
) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(n)]
    procs = [
        ctx.Process(target=_worker_main, args=(i, n, elements, pipes[i][1]), daemon=True)
        for i in range(n)
    ]
    for p in procs:
        p.start()
    for _, child in pipes:
        child.close()  # so that a worker that dies reads as EOF here instead of a hang
    conns = [parent for parent, _ in pipes]
    results: list[dict[str, Any]] = []
    try:
        hello = [_recv(c) for c in conns]
        peers = [(h["peer_id"], h["address"]) for h in hello]
        gloo_port = _free_port()
        for c in conns:
            _send(c, {"op": "gloo", "port": gloo_port, "rounds": rounds})
        gloo_runs = [_recv(c)["seconds"] for c in conns]
        gloo = statistics.median(max(t) for t in zip(*gloo_runs, strict=True))
        for transport, kib, threads in itertools.product(transports, chunk_kib, executor_threads):
            for codec in codecs:
                want_profile = profile is not None and codec == codecs[0] and kib == chunk_kib[0]
                members = []
                for c, (peer_id, address) in zip(conns, peers, strict=True):
                    _send(
                        c,
                        {
                            "op": "config",
                            "chunk_bytes": kib * 1024,
                            "profile": want_profile,
                            "threads": threads,
                            "transport": transport,
                        },
                    )
                    members.append([peer_id, address, _recv(c)["data_port"]])
                runs: dict[str, dict[str, Any]] = {
                    rule: {"times": [], "errors": [], "partial": False, "identical": True}
                    | {"timings": [], "cpus": []}
                    for rule in aggregations
                }
                for r in range(rounds + 1):  # round 0 warms up channels and caches
                    for rule in aggregations:  # A/B: every rule in every round
                        run = runs[rule]
                        start_at = time.monotonic() + 0.3
                        group_id = os.urandom(16).hex()
                        for c in conns:
                            _send(
                                c,
                                {
                                    "op": "round",
                                    "members": members,
                                    "codec": codec,
                                    "aggregation": rule,
                                    "group_id": group_id,
                                    "start_at": start_at,
                                },
                            )
                        replies = [_recv(c) for c in conns]
                        for c in conns:
                            _send(c, {"op": "check"})
                        for reply, c in zip(replies, conns, strict=True):
                            reply.update(_recv(c))
                        if r == 0:
                            continue
                        run["times"].append(max(x["end"] for x in replies) - start_at)
                        run["errors"].append(max(x["error"] for x in replies))
                        run["partial"] |= any(x["partial"] for x in replies)
                        run["identical"] &= len({x["digest"] for x in replies}) == 1
                        run["timings"].append(replies[0]["timings"])
                        run["cpus"].append(sum(x["cpu"] for x in replies))
                if want_profile and profile is not None:
                    os.makedirs(profile, exist_ok=True)
                    path = f"{profile}/allreduce-{n}peers-{codec}-{transport}.prof"
                    _send(conns[0], {"op": "profile-dump", "path": path})
                    _recv(conns[0])
                mean_seconds = statistics.median(runs[aggregations[0]]["times"])
                for rule, run in runs.items():
                    times, timings = run["times"], run["timings"]
                    seconds = statistics.median(times)
                    results.append(
                        {
                            "peers": n,
                            "codec": codec,
                            "aggregation": rule,
                            "transport": transport,
                            "chunk_kib": kib,
                            "executor_threads": threads,
                            "seconds_median": round(seconds, 4),
                            "seconds_all": [round(t, 4) for t in times],
                            "ratio_vs_first_aggregation": round(seconds / mean_seconds, 3),
                            "ratio_vs_first_per_round": [
                                round(t / f, 3)
                                for t, f in zip(times, runs[aggregations[0]]["times"], strict=True)
                            ],
                            "cpu_seconds_all_peers_median": round(
                                statistics.median(run["cpus"]), 4
                            ),
                            "max_error": run["errors"] and max(run["errors"]),
                            "partial": run["partial"],
                            "bit_identical": run["identical"],
                            "gloo_seconds_median": round(gloo, 4),
                            "ratio_vs_gloo": round(seconds / gloo, 2),
                            "rank0_phases_median": {
                                k: round(statistics.median(t[k] for t in timings), 4)
                                for k in timings[0]
                            },
                        }
                    )
    finally:
        for c in conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                _send(c, {"op": "stop"})
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="2,4,8")
    parser.add_argument("--codecs", default="none,float16,uint8-blockwise")
    parser.add_argument(
        "--aggregations",
        default="mean",
        help="reducer rules, A/B in every round; ratios are against the first",
    )
    parser.add_argument("--mb", type=float, default=64.0, help="MB of float32 per peer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-kib", default="1024", help="encoded chunk target(s), KiB")
    parser.add_argument("--threads", default="2", help="executor thread count(s) per peer")
    parser.add_argument("--profile", default=None, help="folder for rank 0's cProfile dumps")
    parser.add_argument(
        "--transports",
        default="data,grpc",
        help="Reduce over the framed-TCP data plane (data) and/or gRPC (grpc)",
    )
    args = parser.parse_args()
    elements = int(args.mb * 1e6) // 4
    results = []
    for n in (int(x) for x in args.peers.split(",")):
        results += bench_group(
            n,
            elements,
            args.codecs.split(","),
            args.aggregations.split(","),
            [int(x) for x in args.chunk_kib.split(",")],
            [int(x) for x in args.threads.split(",")],
            args.transports.split(","),
            args.rounds,
            args.profile,
        )
    print(
        json.dumps(
            {
                "benchmark": "allreduce",
                "mb_per_peer": args.mb,
                "rounds": args.rounds,
                "load_average": os.getloadavg(),
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
