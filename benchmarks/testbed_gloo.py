"""torch gloo's ``all_reduce`` on the multi-host test bed: one rank per host.

The reference beside our rounds in ``benchmarks.bandwidth --gloo``: the same hosts, links and
number of float32 elements, in the same run. Each rank is a process inside its host's network
namespace, started the way the bed starts the daemons and their workers (``ip netns exec``)
and run as ``python -m benchmarks.testbed_gloo``. The ranks meet through a FileStore on the
filesystem the namespaces share: a TCP store would need a port picked ahead of time on host
0's address, where port 0 cannot be asked for. Gloo connects over the host's bed interface
(``GLOO_SOCKET_IFNAME``): left to itself it takes the address the machine's hostname
resolves to, which no namespace of the bed has.

The parent asks for one round at a time (a JSON line on each rank's stdin). Every rank
copies its input into the tensor, waits at a barrier, times its own ``all_reduce`` (sum),
then checks the sum against the exact one before it answers, so a wrong sum is seen and
the check costs no timed second. A round's time is its slowest rank's, as in
``benchmarks.rounds``; ``span`` is the first rank's start to the last rank's end, the way
``benchmarks.bandwidth`` times our rounds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deploy.testbed import Host

from .common import Proc, emit, module_command

MODULE = "benchmarks.testbed_gloo"
SUM_TOLERANCE = 1e-5
"""Largest error of gloo's float32 sum relative to the largest exact sum: a ring's order of
additions costs a few float32 ulps; a rank's part missing or counted twice costs ~0.1."""


def rank_input(rank: int, elements: int) -> np.ndarray:
    """Rank ``rank``'s tensor, a seeded N(0, 1) draw: every rank can make every rank's."""
    return np.random.default_rng(rank).standard_normal(elements, dtype=np.float32)


# -- one rank (runs inside its host's namespace) ------------------------------------------


def exact_sum(world: int, elements: int) -> np.ndarray:
    """The sum of every rank's input in float64, rounded once to float32."""
    total = np.zeros(elements, dtype=np.float64)
    for rank in range(world):
        total += rank_input(rank, elements)
    return total.astype(np.float32)


def rank_main(argv: Sequence[str]) -> int:
    """Join the group, then run one timed and checked ``all_reduce`` per stdin line."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--elements", type=int, required=True)
    parser.add_argument("--store", required=True, help="the FileStore's file, shared by all")
    parser.add_argument("--interface", required=True, help="the host's bed interface")
    parser.add_argument("--timeout", type=float, required=True, help="seconds per collective")
    args = parser.parse_args(argv)
    os.environ["GLOO_SOCKET_IFNAME"] = args.interface  # read when the group is made
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the daemons and workers of this host share its cores
    expected = exact_sum(args.world, args.elements)
    scale = max(float(np.abs(expected).max()), 1e-30)
    mine = torch.from_numpy(rank_input(args.rank, args.elements))
    tensor = torch.empty_like(mine)
    timeout = datetime.timedelta(seconds=args.timeout)  # every barrier and all_reduce's
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=args.world, timeout=timeout
    )
    try:
        emit({"event": "ready", "rank": args.rank})
        for _ in sys.stdin:
            tensor.copy_(mine)  # all_reduce sums in place: each round starts from the input
            dist.barrier()
            started = time.monotonic()
            dist.all_reduce(tensor)
            ended = time.monotonic()
            error = float(np.abs(tensor.numpy() - expected).max()) / scale
            emit({"started_at": started, "ended_at": ended, "rel_error": error})
    finally:
        dist.destroy_process_group()
    return 0


# -- the parent's side -----------------------------------------------------------------------


@dataclass(frozen=True)
class GlooRound:
    seconds: float  # the slowest rank's all_reduce, each timed from its own barrier exit
    span: float  # from the first rank's start to the last rank's end
    tx_bytes: list[int]  # per host, Ethernet bytes its link carried out during the round
    rel_error: float  # the worst rank's, against the exact sum


class GlooRanks:
    """One gloo rank per host of a started test bed, in one process group.

    Raises (on construction): RuntimeError or TimeoutError when a rank exits or the group
    does not form within ``timeout`` seconds; the ranks started so far are stopped.
    """

    def __init__(self, hosts: Sequence[Host], elements: int, workdir: Path, timeout: float) -> None:
        self.hosts = list(hosts)
        self.timeout = timeout
        self.procs: list[Proc] = []
        self.logs: list[Path] = []
        store = workdir / "gloo-store"
        try:
            for rank, host in enumerate(self.hosts):
                args = ["--rank", str(rank), "--world", str(len(self.hosts))]
                args += ["--elements", str(elements), "--store", str(store)]
                args += ["--interface", host.link_ends[0][1], "--timeout", str(timeout)]
                log = workdir / f"gloo-rank{rank}.log"
                self.logs.append(log)
                with log.open("wb") as stderr:  # the child holds its own copy
                    command = host.command([*module_command(MODULE), *args])
                    self.procs.append(Proc(command, stderr, stdin=True))
            for rank in range(len(self.procs)):
                self._wait(rank, lambda r: r.get("event") == "ready", 0)
        except BaseException:
            self.close()
            raise

    def _wait(
        self, rank: int, predicate: Callable[[dict[str, Any]], bool], since: int
    ) -> dict[str, Any]:
        try:
            return self.procs[rank].wait_for(predicate, self.timeout, since)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.logs[rank].read_text(errors="replace")[-1500:]
            raise RuntimeError(f"gloo rank {rank}: {exc}; its stderr ends: {tail}") from exc

    def round(self) -> GlooRound:
        """One barrier and ``all_reduce`` on every rank.

        Raises:
            RuntimeError: a rank exited or did not answer within the timeout.
        """
        before = [host.link_bytes()[0] for host in self.hosts]
        marks = [proc.send({"op": "round"}) for proc in self.procs]
        records = [
            self._wait(rank, lambda r: "rel_error" in r, mark) for rank, mark in enumerate(marks)
        ]
        after = [host.link_bytes()[0] for host in self.hosts]
        return GlooRound(
            seconds=max(r["ended_at"] - r["started_at"] for r in records),
            span=max(r["ended_at"] for r in records) - min(r["started_at"] for r in records),
            tx_bytes=[a - b for a, b in zip(after, before, strict=True)],
            rel_error=max(float(r["rel_error"]) for r in records),
        )

    def close(self) -> None:
        """Stop every rank (EOF on stdin ends it; SIGTERM after). Idempotent."""
        for proc in self.procs:
            proc.close(timeout=10)
        self.procs.clear()


def summarize(
    done: Sequence[GlooRound], failed: Sequence[str], link_bound_s: float
) -> dict[str, Any]:
    """The JSON figures of gloo's timed rounds; ``link_bound_s``: the payload's time at the
    link's rate, for ``goodput_fraction``."""
    if not done:
        return {"error": "; ".join(failed) or "no round"}
    seconds = statistics.median(r.seconds for r in done)
    return {
        "seconds": round(seconds, 3),
        "rounds_seconds": [round(r.seconds, 3) for r in done],
        "span_seconds": round(statistics.median(r.span for r in done), 3),
        "goodput_fraction": round(link_bound_s / seconds, 3),
        "wire_mb_per_host": round(
            statistics.median(statistics.mean(r.tx_bytes) for r in done) / 1e6, 2
        ),
        "max_rel_error": float(f"{max(r.rel_error for r in done):.3g}"),
        "sum_ok": all(r.rel_error <= SUM_TOLERANCE for r in done),
        "failed_rounds": list(failed),
    }


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
