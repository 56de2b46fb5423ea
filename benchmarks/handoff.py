"""CPU of the client-daemon handoff of one call, before and after issue 21.

Times, in one process and in turns (A/B interleaved, ``--repeats`` times), the passes over
memory that a shared-memory ``average`` call of ``--mb`` MB of float32 makes outside the
all-reduce itself, with the real functions of both versions where they still exist:

- ``client``: before, the NaN/Inf check (``validate_arrays``) then the copy into an already
  mapped segment; after, the copy with the check on each block as it lands
  (``ClientSegment.fill``).
- ``daemon``: before (sessions 8-11), the checked copy out of the segment into a reused
  buffer (``copy_checked``), the round writing its averages into the segment (modelled by
  one ``copyto``); after (session 12), the round in place: the NaN/Inf check of the
  segment (``check_finite``), read-only, and the same writes. (Session 7's path, a fresh
  result vector and a copy back, is gone; its figures are in docs/benchmarks-allreduce.md.)
- ``accumulator``: a reducer's weighted sums for its part (1/N of the vector): before,
  ``np.zeros`` per round; after, a pooled buffer (``BufferPool``); each then takes one
  ``np.multiply(..., out=)`` as the first copy of every chunk does.

The figure is thread CPU time (``time.thread_time``), which the machine's load from other
processes barely changes; wall time is printed too. Prints ONE JSON line.

    python benchmarks/handoff.py --mb 64 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from swarmavg.averaging.allreduce.buffers import BufferPool
from swarmavg.averaging.request import check_finite
from swarmavg.peer import shm
from swarmavg.peer.handoff import copy_checked
from swarmavg.peer.validation import validate_arrays


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    cpu, wall = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - cpu, time.perf_counter() - wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--peers", type=int, default=2, help="for the accumulator's size")
    args = parser.parse_args(argv)
    elements = int(args.mb * 1e6) // 4
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal(elements).astype(np.float32)]
    dtypes, shapes = [t.dtype for t in tensors], [t.shape for t in tensors]
    segment = shm.ClientSegment.holding(tensors)  # mapped and faulted in, as when reused
    daemon_side = shm.DaemonSegment(segment.name, segment.size)
    inputs = daemon_side.inputs(dtypes, shapes)
    pool = BufferPool()
    accumulators = BufferPool()
    part = elements // args.peers
    chunk = np.ones(part, np.float32)
    averages = tensors[0].copy()  # what the round writes (the inputs' own values)

    def client_before() -> None:
        validate_arrays(tensors)
        views = segment.results(dtypes, shapes)
        for view, t in zip(views, tensors, strict=True):
            view[...] = t

    def client_after() -> None:
        segment.fill(tensors)

    def daemon_before() -> None:
        copy = pool.take(elements, np.float32)
        copy_checked(inputs, [copy])
        np.copyto(inputs[0], copy)  # the round writes into the segment
        daemon_side.write_results(inputs)  # a no-op: the result is already there
        pool.give(copy)

    def daemon_after() -> None:
        check_finite(inputs)
        np.copyto(inputs[0], averages)  # the round writes over the inputs
        daemon_side.write_results(inputs)  # a no-op: the result is already there

    def accumulator_before() -> None:
        acc = np.zeros(part, np.float32)
        np.multiply(chunk, np.float32(0.5), out=acc)

    def accumulator_after() -> None:
        acc = accumulators.take(part, np.float32)
        np.multiply(chunk, np.float32(0.5), out=acc)
        accumulators.give(acc)

    cases = {
        "client": (client_before, client_after),
        "daemon": (daemon_before, daemon_after),
        "accumulator": (accumulator_before, accumulator_after),
    }
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {
        name: {"before": [], "after": []} for name in cases
    }
    for before, after in cases.values():  # untimed: first-touch of every buffer
        before()
        after()
    for repeat in range(args.repeats):
        for name, (before, after) in cases.items():
            order = [("before", before), ("after", after)]
            for label, fn in order if repeat % 2 == 0 else reversed(order):
                samples[name][label].append(_timed(fn))
    figures = {}
    for name, by_label in samples.items():
        row = {}
        for label, values in by_label.items():
            row[f"{label}_cpu_ms"] = round(statistics.median(c for c, _ in values) * 1e3, 2)
            row[f"{label}_wall_ms"] = round(statistics.median(w for _, w in values) * 1e3, 2)
        row["after/before_cpu"] = round(row["after_cpu_ms"] / row["before_cpu_ms"], 3)
        figures[name] = row
    daemon_side.close()
    segment.unlink()
    print(
        json.dumps(
            {
                "benchmark": "handoff",
                "mb": args.mb,
                "repeats": args.repeats,
                "peers_for_accumulator": args.peers,
                "load_average": round(os.getloadavg()[0], 1),
                "figures": figures,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
