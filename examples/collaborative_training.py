"""Collaborative training with swarmavg: a local demo swarm in one command, or one peer of a
swarm that spans real machines.

Local demo (3 peers on this machine, each with its own daemon and its own data shard)::

    python examples/collaborative_training.py

Across machines (see docs/training.md): on every machine, one peer::

    # the first machine founds the swarm
    python examples/collaborative_training.py --peer --listen 0.0.0.0:31337 \\
        --announce 203.0.113.7:31337 --run-id digits-demo --shard 0 --num-shards 3
    # every other machine joins it
    python examples/collaborative_training.py --peer --listen 0.0.0.0:31337 \\
        --announce THIS_MACHINE:31337 --join 203.0.113.7:31337 --run-id digits-demo \\
        --shard 1 --num-shards 3

``--peer`` starts this machine's daemon in a background thread of this script
(``swarmavg.peer.start_peer``; or uses a running one with ``--control``) and trains on one
shard of scikit-learn's digits (shipped with the package; nothing is downloaded). Peers that
start late load the swarm's state and catch up. Ctrl+C stops every peer with one graceful
shutdown.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

GLOBAL_BATCH = 128


def load_shard(shard: int, num_shards: int) -> tuple[Any, Any, Any, Any]:
    """This peer's train shard and the common test set, as torch tensors."""
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, digits.target, test_size=0.3, random_state=0, stratify=digits.target
    )
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    mine = np.array_split(np.random.default_rng(1).permutation(len(x_tr)), num_shards)[shard]
    return (
        torch.from_numpy(x_tr[mine]),
        torch.from_numpy(y_tr[mine].astype(np.int64)),
        torch.from_numpy(x_te),
        torch.from_numpy(y_te.astype(np.int64)),
    )


def train(args: argparse.Namespace, control: str) -> float:
    """Train this peer through the daemon at ``control``; return its test accuracy."""
    import torch

    from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo
    from swarmavg.peer import connect

    torch.manual_seed(0)  # the same initial parameters on every peer
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    x, y, x_test, y_test = load_shard(args.shard, args.num_shards)
    batch = math.ceil(GLOBAL_BATCH / args.num_shards)  # the shards together fill a global batch
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(args.shard)
    with connect(control) as client:
        opt: Any
        if args.mode == "diloco":
            opt = DiLoCo(
                model.parameters(),
                inner,
                client,
                args.run_id,
                local_steps=args.local_steps,
                batch_size_per_step=batch,
                codec=args.codec,
            )
        else:
            opt = CollaborativeOptimizer(
                model.parameters(),
                inner,
                client,
                args.run_id,
                target_batch_size=GLOBAL_BATCH,
                batch_size_per_step=batch,
                average=args.mode,
                codec=args.codec,
            )
        name = f"peer {args.shard}"
        print(f"{name}: starting at epoch {opt.epoch}", file=sys.stderr, flush=True)
        last_print = 0.0
        with opt:
            while (position := _position(opt, args)) < args.steps:
                for group in inner.param_groups:  # cosine schedule over the swarm's steps
                    group["lr"] = 0.05 * (1 + math.cos(math.pi * position / args.steps))
                idx = torch.randint(len(x), (batch,), generator=generator)
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
                opt.zero_grad()
                if time.monotonic() - last_print > 2.0:
                    last_print = time.monotonic()
                    _print_progress(name, opt)
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean() * 100)
        print(
            f"{name}: done at step {_position(opt, args)}, test accuracy {accuracy:.2f}%, "
            f"{opt.stats.rounds} rounds ({opt.stats.failed} failed), "
            f"{client.status()['bytes_sent']} bytes sent by its daemon",
            file=sys.stderr,
            flush=True,
        )
    return accuracy


def _position(opt: Any, args: argparse.Namespace) -> int:
    """Global steps done (DiLoCo: inner steps, counted across outer steps)."""
    if args.mode == "diloco":
        return int(opt.epoch * args.local_steps + opt.inner_steps)
    return int(opt.epoch)


def _print_progress(name: str, opt: Any) -> None:
    progress = opt.global_progress()
    rates = ", ".join(
        f"{peer[:8]} {rate:.0f}/s" for peer, rate in progress.samples_per_peer().items()
    )
    print(
        f"{name}: epoch {progress.epoch}, {progress.samples}/{progress.target} samples, "
        f"swarm {progress.samples_per_second:.0f} samples/s ({rates}), "
        f"next global step in {progress.eta:.1f}s",
        file=sys.stderr,
        flush=True,
    )


def run_peer(args: argparse.Namespace) -> float:
    """One peer: this machine's daemon (unless --control names a running one) and a trainer.

    The daemon runs in a background thread of this process (``start_peer``); Ctrl+C is one
    ``KeyboardInterrupt`` here, and leaving the ``with`` block is its one graceful shutdown.
    """
    if args.control:
        return train(args, args.control)
    from swarmavg.peer import start_peer

    with (
        tempfile.TemporaryDirectory(prefix="swarmavg-example-") as tmp,
        start_peer(
            run_id=args.run_id,
            join=args.join,
            listen=args.listen,
            announce=args.announce or None,
            control=str(Path(tmp) / "control.sock"),
        ) as daemon,
    ):
        print(f"peer {args.shard}: daemon at {daemon.address}", file=sys.stderr, flush=True)
        if args.address_file:  # the demo's first peer tells the others where to join
            Path(args.address_file).write_text(daemon.address or "")
        return train(args, daemon.control)


def run_demo(args: argparse.Namespace) -> None:
    """A local swarm: ``--peers`` copies of this script in ``--peer`` mode."""

    def peer_command(shard: int) -> list[str]:
        return [
            sys.executable, __file__, "--peer", "--listen", "127.0.0.1:0",
            "--run-id", args.run_id, "--shard", str(shard), "--num-shards", str(args.peers),
            "--mode", args.mode, "--codec", args.codec, "--steps", str(args.steps),
            "--local-steps", str(args.local_steps),
        ]  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="swarmavg-demo-") as tmp:
        # The first peer founds the swarm; its daemon's address is what the others join.
        address_file = Path(tmp) / "first-address"
        procs = [subprocess.Popen([*peer_command(0), "--address-file", str(address_file)])]
        deadline = time.monotonic() + 120
        while not address_file.exists() or not address_file.read_text().strip():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                procs[0].kill()
                raise SystemExit("the first peer did not start")
            time.sleep(0.1)
        first_address = address_file.read_text().strip()
        for shard in range(1, args.peers):
            procs.append(subprocess.Popen([*peer_command(shard), "--join", first_address]))
        try:
            codes = [p.wait() for p in procs]
        except KeyboardInterrupt:  # the peers got the same Ctrl+C: let them shut down
            codes = [p.wait(30) for p in procs]
    if any(codes):
        raise SystemExit(f"peers exited with codes {codes}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=3, help="demo: peers to start on this machine")
    parser.add_argument(
        "--peer", action="store_true", help="run ONE peer (daemon + trainer) instead of the demo"
    )
    parser.add_argument(
        "--listen", default="0.0.0.0:31337", help="--peer: the daemon's public HOST:PORT"
    )
    parser.add_argument(
        "--announce",
        default="",
        help="--peer: the address others should dial (behind NAT or 0.0.0.0)",
    )
    parser.add_argument(
        "--join",
        action="append",
        default=[],
        help="--peer: an existing peer's HOST:PORT (repeatable)",
    )
    parser.add_argument(
        "--control",
        default="",
        help="--peer: use an already running daemon at this control endpoint",
    )
    parser.add_argument(
        "--run-id", default="digits-demo", help="the training run (same on every peer)"
    )
    parser.add_argument(
        "--shard", type=int, default=0, help="--peer: which part of the data this peer trains on"
    )
    parser.add_argument(
        "--num-shards", type=int, default=1, help="--peer: how many parts the data is cut into"
    )
    parser.add_argument(
        "--mode", choices=["gradients", "parameters", "diloco"], default="gradients"
    )
    parser.add_argument("--codec", default="float16", help="codec of the averaging rounds")
    parser.add_argument(
        "--steps", type=int, default=120, help="global steps to train (DiLoCo: inner steps)"
    )
    parser.add_argument(
        "--local-steps", type=int, default=20, help="DiLoCo: inner steps per outer step (H)"
    )
    parser.add_argument("--address-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        if not args.peer:
            run_demo(args)
            return
        run_peer(args)
    except KeyboardInterrupt:
        print("interrupted: stopped cleanly", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
