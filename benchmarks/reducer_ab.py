"""The reducer's mean path, this tree against a git revision, A/B in one process.

Loads ``averaging/allreduce/reducer.py`` of ``--baseline`` (``git show``) beside this
tree's, and times the reducer side of one part as the all-reduce drives it: every sender
announces its weight, then delivers its chunks interleaved with the others', and every
chunk's result is read once it is final. Alternates baseline and current ``--repeats``
times and prints one JSON line with the medians and their ratio::

    python benchmarks/reducer_ab.py --baseline main --mb 16 --senders 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from swarmavg.averaging.allreduce import reducer as current
from swarmavg.averaging.allreduce.partition import PartPlan

ROOT = Path(__file__).resolve().parent.parent


def load_baseline(ref: str, folder: Path) -> ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:averaging/allreduce/reducer.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = folder / "baseline_reducer.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_reducer", path)
    if spec is None or spec.loader is None:
        raise RuntimeError("cannot load the baseline reducer")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_part(
    module: Any, plan: PartPlan, chunks: list[list[np.ndarray]], weights: list[float]
) -> float:
    started = time.perf_counter()
    reducer = module.PartReducer(plan, 0, np.dtype(np.float32), range(len(weights)))
    for sender, weight in enumerate(weights):
        reducer.set_weight(sender, weight)
    for chunk in range(plan.num_chunks(0)):
        for sender in range(len(weights)):
            for final in reducer.add(sender, chunk, chunks[sender][chunk], finite=True):
                reducer.result(final)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main", help="git revision to compare with")
    parser.add_argument("--mb", type=float, default=16.0, help="MB of float32 in the part")
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--chunk-kib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    elements = int(args.mb * 1e6) // 4
    plan = PartPlan.build([elements], args.chunk_kib * 256)
    rng = np.random.default_rng(0)
    vector = [rng.standard_normal(elements).astype(np.float32) for _ in range(args.senders)]
    chunks = [
        [v[slice(*plan.chunk_bounds(0, c))] for c in range(plan.num_chunks(0))] for v in vector
    ]
    figures: dict[str, Any] = {"baseline": args.baseline, "mb": args.mb, "senders": args.senders}
    with tempfile.TemporaryDirectory() as folder:
        baseline = load_baseline(args.baseline, Path(folder))
        for label, weights in (
            ("equal_weights", [1.0] * args.senders),
            ("unequal_weights", [1.0 + i % 3 for i in range(args.senders)]),
        ):
            times: dict[str, list[float]] = {"baseline": [], "current": []}
            one_part(current, plan, chunks, weights)  # warm up caches and allocators
            for _ in range(args.repeats):
                times["baseline"].append(one_part(baseline, plan, chunks, weights))
                times["current"].append(one_part(current, plan, chunks, weights))
            base, now = statistics.median(times["baseline"]), statistics.median(times["current"])
            figures[label] = {
                "baseline_seconds_median": round(base, 5),
                "current_seconds_median": round(now, 5),
                "ratio_current_vs_baseline": round(now / base, 3),
                "ratios_per_repeat": [
                    round(c / b, 3)
                    for b, c in zip(times["baseline"], times["current"], strict=True)
                ],
            }
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
