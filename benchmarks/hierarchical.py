"""Hierarchical mode vs every process through its own daemon: swarm bytes and round time.

A: 2 "machines" x 2 ranks (2 real ``swarmavg peer`` daemons, 4 trainer processes, one
gloo group per machine, ``process_group="world"``). B: 4 processes, each with its own
daemon (the flat swarm). Both train ``CollaborativeOptimizer`` (gradients, codec
``none``) on a linear model of ``2 * dim + 2`` parameters for ``--epochs`` global steps,
every rank 8 samples per step, one step per epoch for the whole swarm. The runs
alternate A, B, A, B, ... (``--repeats``).

Figures per run: bytes sent by all daemons per round (from ``swarmavg status``), and the
median over epochs 1.. of the rank-0 processes' time in the ``step()`` that took the
global step (reduce, round, broadcast; epoch 0 is left out: it includes the first
matchmaking). Prints one JSON line with every run and the medians.

    .venv/bin/python benchmarks/hierarchical.py --dim 250000 --epochs 5 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmavg.peer import connect
from tests.harness import ProcessPool
from tests.training import hier_machines

BATCH = 8


def run_once(hierarchical: bool, args: argparse.Namespace) -> dict[str, Any]:
    machines, ranks = (2, 2) if hierarchical else (4, 1)
    run_id = f"hier-bench-{'a' if hierarchical else 'b'}"
    with tempfile.TemporaryDirectory(prefix="hier-bench-") as tmp:
        workdir = Path(tmp)
        pool = ProcessPool(workdir)
        try:
            daemons = hier_machines.start_daemons(pool, machines, run_id)
            records = hier_machines.run_machines(
                workdir,
                daemons,
                ranks,
                args.timeout,
                run_id=run_id,
                batch_of=lambda m, r: BATCH,
                wrapper="collaborative",
                target=BATCH * 4,
                epochs=args.epochs,
                dim=args.dim,
                flat=not hierarchical,
                model_seed=0,
                averaging_timeout=60.0,
            )
            failed = {k: r.get("message") for k, r in records.items() if not r.get("ok")}
            if failed:
                raise RuntimeError(f"ranks failed: {failed}")
            sent = received = rounds = 0
            for daemon in daemons:
                with connect(daemon.control) as client:
                    status = client.status()
                sent += int(status["bytes_sent"])
                received += int(status["bytes_received"])
                rounds += int(status["rounds_done"])
        finally:
            pool.close()
    leaders = [r for (m, rank), r in records.items() if rank == 0]
    times = [t for r in leaders for t in r["round_seconds"][1:]]
    return {
        "mode": "hierarchical-2x2" if hierarchical else "flat-4",
        "daemons": machines,
        "daemon_rounds": rounds,
        "bytes_sent_per_round": sent / args.epochs,
        "bytes_received_per_round": received / args.epochs,
        "group_sizes": sorted({g for r in leaders for g in r["group_sizes"]}),
        "round_seconds_median": statistics.median(times) if times else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=250_000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=400.0)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        for hierarchical in (True, False):
            runs.append(run_once(hierarchical, args))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress

    def med(mode: str, field: str) -> float:
        values = [r[field] for r in runs if r["mode"] == mode and r[field] is not None]
        return statistics.median(values)

    a, b = "hierarchical-2x2", "flat-4"
    print(
        json.dumps(
            {
                "benchmark": "hierarchical",
                "params": 2 * args.dim + 2,
                "model_bytes": 4 * (2 * args.dim + 2),
                "epochs": args.epochs,
                "runs": runs,
                "bytes_ratio_hier_over_flat": med(a, "bytes_sent_per_round")
                / med(b, "bytes_sent_per_round"),
                "round_time_ratio_hier_over_flat": med(a, "round_seconds_median")
                / med(b, "round_seconds_median"),
            }
        )
    )


if __name__ == "__main__":
    main()
