"""One rank of a "machine" in the hierarchical-mode tests (and the benchmark).

Run as ``python hier_worker.py '<json spec>'`` for one scenario, or as
``python hier_worker.py --serve`` to run one scenario per JSON line of stdin until it ends
(starting Python and torch costs far more than a scenario's training, so tests run several
scenarios on one set of ranks). In a scenario the rank joins its machine's gloo group (a
FileStore per machine and scenario), builds a wrapper with ``process_group="world"`` (or,
with ``spec["flat"]``, as a process of its own with its own daemon), trains a tiny linear
model on one fixed batch and writes ``spec["out"]``: a ``.pt`` file with the final
parameters and a ``.json`` file with what the test checks (or the exception's class and
message).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LR = 0.1


def fixed_batch(seed: int, size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, dim, generator=g), torch.randn(size, 2, generator=g)


def make_model(seed: int, dim: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(dim, 2)


def backward(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = data
    torch.nn.functional.mse_loss(model(x), y).backward()


def linear_backward(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A loss linear in the parameters: its gradient is the same wherever they are, so a
    test knows the swarm's result whenever each delayed update landed."""
    x, y = data
    (model(x) * y).mean().backward()


def build(spec: dict[str, Any], model: torch.nn.Module, client: Any) -> Any:
    from swarmavg.averaging.optim import (
        CollaborativeOptimizer,
        DiLoCo,
        PowerSGDOptimizer,
        StreamingDiLoCo,
        sgd_outer_optimizer,
    )

    group: Any = None if spec.get("flat") else "world"
    common: dict[str, Any] = {
        "codec": "none",
        "averaging_timeout": spec.get("averaging_timeout", 30.0),
        "process_group": group,
        "peer_id": None,
        "final_round": spec.get("final_round", True),
    }
    if spec["wrapper"] == "diloco":
        return DiLoCo(
            model.parameters(),
            torch.optim.SGD(model.parameters(), lr=LR),
            client,
            spec["run_id"],
            local_steps=spec["local_steps"],
            batch_size_per_step=spec["batch"],
            outer_optimizer=sgd_outer_optimizer,
            **common,
        )
    if spec["wrapper"] == "streaming":
        return StreamingDiLoCo(
            model.parameters(),
            torch.optim.SGD(model.parameters(), lr=LR),
            client,
            spec["run_id"],
            local_steps=spec["local_steps"],
            batch_size_per_step=spec["batch"],
            outer_optimizer=sgd_outer_optimizer,
            fragments=2,
            overlap_steps=1,
            **common,
        )
    if spec["wrapper"] == "powersgd":
        return PowerSGDOptimizer(
            model.parameters(),
            torch.optim.SGD(model.parameters(), lr=LR),
            client,
            spec["run_id"],
            target_batch_size=spec["target"],
            batch_size_per_step=spec["batch"],
            rank=1,
            max_wait=spec.get("max_wait", 10.0),
            **common,
        )
    return CollaborativeOptimizer(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=LR),
        client,
        spec["run_id"],
        target_batch_size=spec["target"],
        batch_size_per_step=spec["batch"],
        max_wait=spec.get("max_wait", 10.0),
        delay_updates=bool(spec.get("delay_updates")),
        **common,
    )


def start_barrier(out: Path, go: Path, deadline: float = 120.0) -> None:
    """Say this rank is built (every leader has reported epoch 0), then wait for the test
    to start every rank at once, so that no machine trains before the others exist."""
    out.with_suffix(".ready").write_text("ready")
    until = time.monotonic() + deadline
    while not go.exists():
        if time.monotonic() > until:
            raise TimeoutError(f"no start signal ({go}) within {deadline}s")
        time.sleep(0.01)


def run_scenario(spec: dict[str, Any], *, served: bool) -> None:
    """One scenario: train, then write its record. ``served``: more scenarios follow in
    this process, so the gloo group goes also after a failure (the next scenario makes a
    group of its own, on a store of its own)."""
    from swarmavg.peer import connect

    out = Path(spec["out"])
    record: dict[str, Any] = {"rank": spec["rank"]}
    flat = bool(spec.get("flat"))
    if not flat:
        store = dist.FileStore(spec["store"], spec["size"])
        dist.init_process_group(
            "gloo",
            store=store,
            rank=spec["rank"],
            world_size=spec["size"],
            timeout=timedelta(seconds=spec.get("gloo_timeout", 120)),
        )
    talks = flat or spec["rank"] == 0
    client = connect(spec["control"]) if talks else None
    model = make_model(spec["model_seed"], spec.get("dim", 3))
    data = fixed_batch(spec["data_seed"], spec["batch"], spec.get("dim", 3))
    caught: list[str] = []
    steps_per_epoch: list[int] = []
    round_seconds: list[float] = []
    anchors: list[list[Any]] = []  # DiLoCo's anchor after each epoch
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt = build(spec, model, client)
            record["initial"] = [p.detach().tolist() for p in model.parameters()]
            if spec.get("go_file"):
                start_barrier(out, Path(spec["go_file"]))
            steps = 0
            last_epoch = opt.epoch
            while opt.epoch < spec["epochs"]:
                if spec.get("die_after") is not None and steps >= spec["die_after"]:
                    os._exit(3)  # the leader vanishes: its followers must not hang
                (linear_backward if spec.get("linear_loss") else backward)(model, data)
                if spec.get("nan_grad"):  # a rank with a bug: the daemon refuses NaN
                    first = next(model.parameters())
                    assert first.grad is not None
                    first.grad.view(-1)[0] = float("nan")
                started = time.monotonic()
                opt.step()
                opt.zero_grad()
                steps += 1
                if opt.epoch != last_epoch:
                    if hasattr(opt, "anchor"):
                        anchors.append([a.tolist() for a in opt.anchor])
                    round_seconds.append(time.monotonic() - started)
                    steps_per_epoch.append(steps)
                    steps = 0
                    last_epoch = opt.epoch
                if len(steps_per_epoch) + steps > 500:
                    raise RuntimeError("no global step after 500 local steps")
            opt.close()  # lands a round still in the background (delay_updates)
            record["progress_processes"] = opt.global_progress().num_processes
            record["group_sizes"] = list(opt.stats.group_sizes)
            record["failed"] = opt.stats.failed
            if hasattr(opt, "anchor"):  # DiLoCo's synchronised parameters
                record["anchor"] = [a.tolist() for a in opt.anchor]
            if hasattr(opt, "powersgd"):  # the shared Q and the machine's error feedback
                record["q"] = {str(k): v.tolist() for k, v in opt.powersgd.q.items()}
                record["residual"] = {str(k): v.tolist() for k, v in opt.powersgd.residual.items()}
        caught = [f"{w.category.__name__}: {w.message}" for w in seen]
        record["ok"] = True
    except Exception as exc:  # the test reads the failure from the record
        record["ok"] = False
        record["error"] = type(exc).__name__
        record["message"] = str(exc)
    record["epoch"] = opt.epoch if "opt" in locals() else None
    record["steps_per_epoch"] = steps_per_epoch
    record["round_seconds"] = round_seconds
    record["anchors"] = anchors
    record["warnings"] = caught
    torch.save([p.detach().clone() for p in model.parameters()], out.with_suffix(".pt"))
    # The test waits for the record's file to exist: it must appear whole (written under
    # another name, then renamed), or the test may read it empty.
    partial = out.with_suffix(".json.partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, out.with_suffix(".json"))
    if client is not None:
        client.close()
    if not flat and (record["ok"] or served):
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    faulthandler.register(signal.SIGUSR1)  # a stuck rank shows where, when the test asks
    if argv == ["--serve"]:
        for line in sys.stdin:
            run_scenario(json.loads(line), served=True)
        return 0
    run_scenario(json.loads(argv[0]), served=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
