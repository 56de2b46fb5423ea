"""A Byzantine trainer against robust aggregation: 4 trainers on digits, one attacking.

The setup of ``benchmarks/training.py`` (scikit-learn's digits, 64-32-10 MLP, one shard per
trainer, global batch 128, SGD lr 0.1 momentum 0.9, cosine schedule), each trainer behind
its own ``swarmavg peer`` process and its own client, the four trainers in threads of this
process. Trainer 3 multiplies its gradients by -10 before each step (``attacked``). The
scenarios:

* ``clean``: no attacker, ``aggregation="mean"``;
* ``mean``, ``centered-clip``, ``trimmed-mean``: the attacker, and that aggregation;
* ``centered-clip-clip-only``: the attacker, centered-clip without rejection (``reject=0``).

Every trainer applies the round's result, the attacker too, so all four end with the same
parameters; the figure is each trainer's test accuracy (and its failed rounds). Prints one
JSON line::

    python -m benchmarks.byzantine --steps 90

``tests/training/test_byzantine.py`` runs the same code, shorter.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from . import training as digits
from .common import parameters_sha256

TRAINERS = 4
ATTACKER = 3
ATTACK_FACTOR = -10.0
SCENARIOS = {
    "clean": ("mean", False),
    "mean": ("mean", True),
    "centered-clip": ("centered-clip", True),
    "centered-clip-clip-only": ("centered-clip:reject=0", True),
    "trimmed-mean": ("trimmed-mean", True),
}


def train(
    clients: list[Any],
    run_id: str,
    aggregation: str,
    attacked: bool,
    steps: int,
    digests: list[str] | None = None,
) -> list[tuple[float, int]]:
    """Train ``TRAINERS`` trainers to ``steps`` global steps, one thread each; return each
    one's (test accuracy, failed rounds), and append each one's parameters' sha256 to
    ``digests`` when given. Raises the first trainer's error."""
    import torch

    from swarmavg.averaging.optim import CollaborativeOptimizer

    x_tr, y_tr, x_te, y_te = digits.load_data()
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    shards = digits.shard_indices(len(x_tr), TRAINERS)
    results: list[tuple[float, int] | None] = [None] * TRAINERS
    shas: list[str | None] = [None] * TRAINERS
    errors: list[BaseException] = []

    def trainer(i: int) -> None:
        try:
            model = digits.make_model(0)
            inner = torch.optim.SGD(model.parameters(), lr=digits.LR, momentum=0.9)
            opt = CollaborativeOptimizer(
                model.parameters(),
                inner,
                clients[i],
                run_id,
                target_batch_size=digits.GLOBAL_BATCH,
                batch_size_per_step=digits.LOCAL_BATCH,
                codec="none",
                aggregation=aggregation,
                averaging_timeout=15.0,
                max_wait=15.0,
            )
            stream = digits.BatchStream(shards[i], digits.LOCAL_BATCH, 100 + i)
            with opt:
                while opt.epoch < steps:
                    for group in inner.param_groups:
                        group["lr"] = digits.cosine_lr(opt.epoch, steps)
                    idx = stream.next()
                    torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
                    if attacked and i == ATTACKER:
                        for p in model.parameters():
                            if p.grad is not None:
                                p.grad.mul_(ATTACK_FACTOR)
                    opt.step()
                    opt.zero_grad()
            results[i] = (digits.accuracy(model, x_te, y_te), int(opt.stats.failed))
            shas[i] = parameters_sha256(model)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=trainer, args=(i,), daemon=True) for i in range(TRAINERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if digests is not None:
        digests.extend(sha for sha in shas if sha is not None)
    return [r for r in results if r is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=90, help="global steps (9 per data pass)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    args = parser.parse_args()
    from swarmavg.peer import connect

    figures: dict[str, Any] = {"steps": args.steps, "attacker": ATTACKER}
    with tempfile.TemporaryDirectory() as workdir, ExitStack() as stack:
        log = stack.enter_context(open(Path(workdir) / "daemons.log", "wb"))
        daemons = digits.start_daemons(Path(workdir), TRAINERS, log)
        try:
            clients = [stack.enter_context(connect(control)) for _, control in daemons]
            for name in args.scenarios.split(","):
                aggregation, attacked = SCENARIOS[name]
                started = time.monotonic()
                digests: list[str] = []
                run = train(
                    clients, f"byzantine-{name}", aggregation, attacked, args.steps, digests
                )
                figures[name] = {
                    "aggregation": aggregation,
                    "attacked": attacked,
                    "accuracy_per_trainer": [round(a, 2) for a, _ in run],
                    "failed_rounds_per_trainer": [f for _, f in run],
                    # every trainer applies each round's result: one model, or the run is off
                    "parameters_identical": len(set(digests)) == 1 and len(digests) == TRAINERS,
                    "seconds": round(time.monotonic() - started, 1),
                }
        finally:
            stack.close()
            for proc, _ in daemons:
                proc.close()
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
