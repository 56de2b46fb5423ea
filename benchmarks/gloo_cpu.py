"""CPU of one torch gloo rank per all-reduce: the reference our daemons' CPU is compared with.

N processes on loopback (one thread each, as ``benchmarks/rounds.py`` runs gloo) all-reduce
``--mb`` MB of float32 ``--rounds`` times after a warm-up; each reads its own user and
system CPU (``getrusage``) around the timed rounds. On 2 cores a round is CPU-bound, so
per-round CPU says where a system spends what gloo does not (docs/benchmarks.md, session
18). Prints one JSON line: per rank count, the medians of user and system milliseconds per
round and of the round's seconds.

    python benchmarks/gloo_cpu.py --peers 4,8 --mb 64 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import socket
import statistics
import time
from multiprocessing.queues import Queue
from typing import Any


def _rank(rank: int, n: int, port: int, elements: int, rounds: int, out: Queue[Any]) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=n, rank=rank)
    try:
        data = np.random.default_rng(rank).standard_normal(elements, dtype=np.float32)
        tensor = torch.from_numpy(data)
        dist.all_reduce(tensor)  # the first round sets up connections
        dist.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF)
        seconds = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            seconds.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        user_ms = (after.ru_utime - before.ru_utime) / rounds * 1e3
        system_ms = (after.ru_stime - before.ru_stime) / rounds * 1e3
        out.put((user_ms, system_ms, statistics.median(seconds)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def measure(n: int, elements: int, rounds: int, timeout: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out: Queue[Any] = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_rank, args=(r, n, port, elements, rounds, out)) for r in range(n)]
    for p in ranks:
        p.start()
    try:
        results = [out.get(timeout=timeout) for _ in ranks]
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return {
        "user_ms": round(statistics.median(r[0] for r in results), 1),
        "system_ms": round(statistics.median(r[1] for r in results), 1),
        "round_s": round(statistics.median(r[2] for r in results), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="4,8", help="comma-separated rank counts")
    parser.add_argument("--mb", type=float, default=64.0, help="MB (1e6 bytes) of float32")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    elements = int(args.mb * 1e6 / 4)
    per_n = {
        n: measure(n, elements, args.rounds, args.timeout)
        for n in (int(x) for x in args.peers.split(","))
    }
    record = {"benchmark": "gloo_cpu", "mb": args.mb, "rounds": args.rounds, "ranks": per_n}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
