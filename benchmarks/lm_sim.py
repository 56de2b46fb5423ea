"""DiLoCo's math on benchmarks/lm.py's workload in one process: where the loss gap comes from.

``lm.py`` runs every method through 4 real daemons; this runs the same model, data,
shards, schedule and seeds with 4 in-process replicas and no network, so a sweep over the
sync interval H takes seconds per point. Every H inner AdamW steps, the anchor takes an
outer SGD step (``--outer-lr``, Nesterov ``--outer-momentum``) on the mean of the replicas'
pseudo-gradients ``anchor - replica`` (full precision: no codec), and the replicas restart
from the anchor with their own AdamW moments. ``--share-adam`` also averages the replicas'
AdamW moments at every sync (what a single optimizer over the 4 shards would hold; it is
not DiLoCo, it bounds what syncing parameters alone can reach).

Prints one JSON line for the single-process reference (batch ``4 x --batch``) and one per
H in ``--intervals``: validation loss and its ratio to the reference. The question it
answers (docs/benchmarks.md, "Training"): is the gap to the single
process the interval, the codec, or the replicas' small batches?

    python -m benchmarks.lm_sim --steps 1200 --intervals 1,2,10,50
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from typing import Any

from .lm import (
    PEERS,
    Config,
    Windows,
    corpus,
    lm_loss,
    lr_at,
    make_model,
    shard,
    train_reference,
    validation_batch,
    validation_loss,
)


def run_diloco(
    cfg: Config,
    interval: int,
    inner_lr: float,
    outer_lr: float,
    outer_momentum: float,
    share_adam: bool,
) -> float:
    """Validation loss of the anchor after ``cfg.steps`` inner steps on every replica."""
    import torch

    train, val = corpus(cfg.max_bytes)
    anchor = make_model(cfg)
    replicas = [copy.deepcopy(anchor) for _ in range(PEERS)]
    inner = [torch.optim.AdamW(r.parameters(), lr=inner_lr, weight_decay=0.01) for r in replicas]
    windows = [Windows(shard(train, i, cfg.split), cfg.context, 11 + i) for i in range(PEERS)]
    outer = torch.optim.SGD(
        anchor.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
    )
    schedule = dataclasses.replace(cfg, lr=inner_lr)
    for step in range(cfg.steps):
        for replica, opt, source in zip(replicas, inner, windows, strict=True):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, schedule)
            lm_loss(replica, source.batch(cfg.batch)).backward()
            opt.step()
            opt.zero_grad()
        if (step + 1) % interval and step + 1 != cfg.steps:
            continue
        with torch.no_grad():
            for index, param in enumerate(anchor.parameters()):
                mean = sum(list(r.parameters())[index].detach() for r in replicas) / PEERS
                param.grad = param.detach() - mean
        outer.step()
        outer.zero_grad()
        with torch.no_grad():
            for replica in replicas:
                for mine, theirs in zip(replica.parameters(), anchor.parameters(), strict=True):
                    mine.copy_(theirs)
        if share_adam:
            _average_moments(inner, replicas)
    return validation_loss(anchor, validation_batch(val, cfg))


def _average_moments(optimizers: list[Any], replicas: list[Any]) -> None:
    params = [list(r.parameters()) for r in replicas]
    for index in range(len(params[0])):
        states = [opt.state[p[index]] for opt, p in zip(optimizers, params, strict=True)]
        for name in ("exp_avg", "exp_avg_sq"):
            mean = sum(s[name] for s in states) / len(states)
            for state in states:
                state[name].copy_(mean)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", default="1,2,10,50", help="comma-separated H")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=4, help="windows per replica step")
    parser.add_argument("--lr", type=float, default=6e-3, help="the reference's AdamW lr")
    parser.add_argument("--inner-lr", type=float, default=None, help="default: --lr")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.0)
    parser.add_argument("--share-adam", action="store_true")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    cfg = Config(
        steps=args.steps,
        batch=args.batch,
        context=64,
        d_model=64,
        layers=2,
        lr=args.lr,
        warmup=args.warmup,
        split="interleaved",
    )
    reference = train_reference(cfg)
    print(json.dumps({"method": "single-process", "val_loss": round(reference["val_loss"], 4)}))
    for interval in (int(h) for h in args.intervals.split(",")):
        started = time.monotonic()
        loss = run_diloco(
            cfg,
            interval,
            args.inner_lr or args.lr,
            args.outer_lr,
            args.outer_momentum,
            args.share_adam,
        )
        record = {
            "method": f"diloco-sim-h{interval}",
            "steps": cfg.steps,
            "inner_lr": args.inner_lr or args.lr,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "share_adam": args.share_adam,
            "val_loss": round(loss, 4),
            "val_loss_vs_single": round(loss / reference["val_loss"], 4),
            "seconds": round(time.monotonic() - started, 1),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
