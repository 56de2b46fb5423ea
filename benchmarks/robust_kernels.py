"""The robust rules' kernels per chunk: this tree against a baseline commit, A/B alternating.

One process, one thread: for ``--senders`` copies of one chunk of ``--kib`` KiB of float32
(N(0, 1), the last copy -10 x, as an attacker), times CenteredClip (tau 1, 5 iterations)
and the trimmed mean (trim 0.25), with equal and unequal weights (``1 + i % 3``), and the
plain sum the mean does, in this tree's ``averaging/allreduce/robust.py`` and in the
baseline's (``git show BASELINE:averaging/allreduce/robust.py``), and in this tree with
its compiled kernels (compression/_native.c) switched off (``numpy_ms``), taking turns
``--repeats`` times. Times are the thread's CPU time (``time.thread_time``), which a
loaded machine inflates far less than wall time. Also the largest difference between the
two versions' results. Then, per ``--senders`` count ``n``, the CPU time of one reducer's
part of a ``--part-mb`` MB round (``PartReducer``: every sender's chunks added, each chunk
combined) under each rule, compiled and numpy, the rules taking turns: on a machine with
fewer cores than peers, what a robust rule adds to a round is about ``n`` times the
difference. Prints ONE JSON line.

    python benchmarks/robust_kernels.py --baseline main --senders 4,8 --repeats 15
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from swarmavg.averaging.aggregation import parse_aggregation
from swarmavg.averaging.allreduce import robust
from swarmavg.averaging.allreduce.partition import PartPlan
from swarmavg.averaging.allreduce.reducer import PartReducer

ROOT = Path(__file__).resolve().parent.parent


def load_baseline(commit: str, folder: Path) -> ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:averaging/allreduce/robust.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = folder / "robust_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("robust_baseline", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_ms(call: Callable[[ModuleType], Any], module: ModuleType) -> float:
    started = time.thread_time()
    call(module)
    return (time.thread_time() - started) * 1e3


def numpy_ms(call: Callable[[ModuleType], Any]) -> float:
    """``cpu_ms`` of this tree's robust.py with its compiled kernels switched off."""
    saved, robust.native = robust.native, None
    try:
        return cpu_ms(call, robust)
    finally:
        robust.native = saved


def first(result: Any) -> np.ndarray:
    return np.asarray(result[0] if isinstance(result, tuple) else result)


def bench(n: int, kib: int, repeats: int, baseline: ModuleType) -> dict[str, Any]:
    stack = np.random.default_rng(0).standard_normal((n, kib * 256)).astype(np.float32)
    stack[-1] *= -10.0
    equal, unequal = np.ones(n), 1.0 + np.arange(n) % 3
    k = n // 4
    cases: dict[str, Callable[[ModuleType], Any]] = {
        "centered-clip": lambda m: m.centered_clip(stack, equal, 1.0, 5),
        "centered-clip, unequal weights": lambda m: m.centered_clip(stack, unequal, 1.0, 5),
        "trimmed-mean": lambda m: m.trimmed_mean(stack, equal, k),
        "trimmed-mean, unequal weights": lambda m: m.trimmed_mean(stack, unequal, k),
    }
    sum_ms = statistics.median(cpu_ms(lambda m: stack.sum(axis=0), robust) for _ in range(repeats))
    out: dict[str, Any] = {"senders": n, "sum_ms": round(sum_ms, 3)}
    for name, case in cases.items():
        before, after, plain = [], [], []
        for _ in range(repeats):
            before.append(cpu_ms(case, baseline))
            after.append(cpu_ms(case, robust))
            plain.append(numpy_ms(case))
        diff = np.abs(first(case(baseline)) - first(case(robust))).max()
        out[name] = {
            "baseline_ms": round(statistics.median(before), 3),
            "this_ms": round(statistics.median(after), 3),
            "numpy_ms": round(statistics.median(plain), 3),
            "speedup": round(
                statistics.median(b / a for b, a in zip(before, after, strict=True)), 2
            ),
            "this_over_sum": round(statistics.median(after) / sum_ms, 1),
            "max_abs_difference": float(f"{diff:.3g}"),
        }
    return out


def reduce_part(n: int, plan: PartPlan, data: list[np.ndarray], rule: str) -> None:
    """What one reducer does with its part: take every sender's chunks, combine each."""
    reducer = PartReducer(plan, 0, np.dtype(np.float32), range(n), parse_aggregation(rule))
    for sender in range(n):
        reducer.set_weight(sender, 1.0)
    for chunk in range(plan.num_chunks(0)):
        start, end = plan.chunk_bounds(0, chunk)
        for sender in range(n):
            reducer.add(sender, chunk, data[sender][start:end], finite=True)
        reducer.aggregate(chunk)


def bench_part(n: int, mb: int, kib: int, repeats: int) -> dict[str, Any]:
    """CPU time of one reducer's part of a ``mb`` MB round of ``n`` peers (``mb / n``) per
    rule, the rules taking turns; ``/numpy``: this tree with its compiled kernels off."""
    size = mb * 2**20 // 4 // n
    plan = PartPlan.build([size] * n, kib * 256)
    rng = np.random.default_rng(1)
    data = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    data[-1] *= -10.0
    rules = ["mean", "centered-clip", "trimmed-mean"]
    times: dict[str, list[float]] = {
        name: [] for name in [*rules, *(r + "/numpy" for r in rules[1:])]
    }
    for _ in range(repeats):
        for rule in rules:
            times[rule].append(cpu_ms(lambda _m, r=rule: reduce_part(n, plan, data, r), robust))
            if rule != "mean":
                times[rule + "/numpy"].append(
                    numpy_ms(lambda _m, r=rule: reduce_part(n, plan, data, r))
                )
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    mean = medians["mean"]
    return {
        "senders": n,
        "part_mb": round(size * 4 / 2**20, 2),
        "chunks": plan.num_chunks(0),
        **{f"{name}_ms": round(ms, 2) for name, ms in medians.items()},
        **{
            f"{name}_over_mean": round(ms / mean, 2)
            for name, ms in medians.items()
            if name != "mean"
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main")
    parser.add_argument("--senders", default="4,8")
    parser.add_argument("--kib", type=int, default=1024, help="chunk size (the data plane's)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--part-mb", type=int, default=64, help="round size for the per-part figures (0: none)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        baseline = load_baseline(args.baseline, Path(folder))
        results = [
            bench(int(n), args.kib, args.repeats, baseline) for n in args.senders.split(",") if n
        ]
    senders = [int(n) for n in args.senders.split(",") if n]
    parts = (
        [bench_part(n, args.part_mb, args.kib, args.repeats) for n in senders]
        if args.part_mb
        else []
    )
    figures = {
        "benchmark": "robust_kernels",
        "compiled": robust.native is not None and hasattr(robust.native, "median_gram"),
        "baseline": args.baseline,
        "kib": args.kib,
        "load_average": round(os.getloadavg()[0], 2),
        "results": results,
        "part_mb": args.part_mb,
        "parts": parts,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
