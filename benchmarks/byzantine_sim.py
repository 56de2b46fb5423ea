"""benchmarks/byzantine.py's training without daemons: the aggregators on four gradients.

The digits setup of ``benchmarks/training.py`` (64-32-10 MLP, 4 shards, 32 samples per
trainer and step, SGD lr 0.1 momentum 0.9, cosine schedule) in one process and one model:
every step computes the four trainers' gradients on their own shards, trainer 3 multiplies
its gradient by ``--factor``, the flat gradients are split into 4 parts as the butterfly
splits them, and each part is combined by the reducer's own code
(:mod:`swarmavg.averaging.allreduce.robust`). Since every member of a daemon run applies
the same combined gradient, one model stands for all four. Seconds instead of minutes per
run, so many data orders and parameters can be compared; the daemons' run is the figure
that counts (``benchmarks/byzantine.py``). Prints one JSON line::

    python benchmarks/byzantine_sim.py --steps 90 --orders 3 \\
        --rules "clean;honest-only;centered-clip:reject=0;centered-clip;trimmed-mean"

A rule is ``clean`` (no attacker, the mean), ``honest-only`` (the attacker's gradient left
out: the mean of the other three), or an aggregation name with the attacker present.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks.` as a package

from benchmarks import training as digits
from swarmavg.averaging.aggregation import CENTERED_CLIP, MEAN, parse_aggregation
from swarmavg.averaging.allreduce.robust import centered_clip, trimmed_mean

TRAINERS = 4
ATTACKER = 3
PARTS = 4


def combine(rule: str, stack: np.ndarray) -> np.ndarray:
    """One part's four copies combined by ``rule`` (equal weights, as in the daemon run)."""
    weights = np.ones(len(stack))
    if rule == "honest-only":
        return stack[:ATTACKER].mean(axis=0)
    aggregation = parse_aggregation(MEAN if rule == "clean" else rule)
    if aggregation.kind == MEAN:
        return stack.mean(axis=0)
    if aggregation.kind == CENTERED_CLIP:
        return centered_clip(
            stack, weights, aggregation.tau, aggregation.iters, aggregation.reject
        )[0]
    return trimmed_mean(stack, weights, aggregation.trimmed_per_side(len(stack)))


def train(rule: str, factor: float, steps: int, order: int) -> float:
    """Test accuracy (%) after ``steps`` steps under ``rule``, data order ``order``."""
    import torch

    x_tr, y_tr, x_te, y_te = digits.load_data()
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    shards = digits.shard_indices(len(x_tr), TRAINERS)
    model = digits.make_model(0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=digits.LR, momentum=0.9)
    streams = [
        digits.BatchStream(shards[i], digits.LOCAL_BATCH, 100 + i + order * digits.SEED_STRIDE)
        for i in range(TRAINERS)
    ]
    attacked = rule != "clean"
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = digits.cosine_lr(step, steps)
        grads = []
        for i, stream in enumerate(streams):
            model.zero_grad()
            idx = stream.next()
            torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
            grads.append(flat.numpy() * (factor if attacked and i == ATTACKER else 1.0))
        stack = np.stack(grads).astype(np.float32)
        parts = np.array_split(stack, PARTS, axis=1)
        combined = np.concatenate([combine(rule, part).astype(np.float32) for part in parts])
        offset = 0
        for p in params:
            p.grad = torch.from_numpy(combined[offset : offset + p.numel()].reshape(p.shape))
            offset += p.numel()
        opt.step()
    return digits.accuracy(model, x_te, y_te)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--orders", type=int, default=3, help="data orders (seeds) per rule")
    parser.add_argument("--factor", type=float, default=-10.0, help="the attacker's multiplier")
    parser.add_argument(
        "--rules",
        default="clean;honest-only;centered-clip:reject=0;centered-clip;trimmed-mean",
        help="';'-separated (aggregation names contain commas)",
    )
    args = parser.parse_args()
    started = time.monotonic()
    figures: dict[str, object] = {"steps": args.steps, "factor": args.factor}
    for rule in args.rules.split(";"):
        accuracies = [train(rule, args.factor, args.steps, o) for o in range(args.orders)]
        figures[rule] = {
            "accuracy_per_order": [round(a, 2) for a in accuracies],
            "mean": round(float(np.mean(accuracies)), 2),
        }
    figures["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
