"""A byte-level transformer language model trained by 4 peers through real daemons.

The text is the Python standard library's own source files (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, present on every machine, nothing downloaded; the
regression suite under ``test/`` and ``site-packages`` left out). Files are
sorted by relative path and split by file: one whose path's sha256 ends in a byte below 26
(about 10%) is validation, the rest is training. The training bytes (the first
``--max-bytes``, default 8 MB) are concatenated and cut
into 4 contiguous disjoint shards, one per trainer. Validation loss is the mean cross entropy
(nats per byte) over ``--val-windows`` fixed windows of the validation text.

The model: byte embedding, learned positions, ``--layers`` pre-LayerNorm transformer blocks
(``--d-model``, 4 heads, MLP 4x), tied output; context ``--context`` bytes. The inner
optimizer is AdamW (lr ``--lr``, cosine to 10%, no warm-up; weight decay 0.01).

Reference: one process on all the training text, global batch ``4 x --batch`` windows,
``--steps`` steps. Every method runs 4 ``swarmavg peer`` daemons and 4 trainer processes
(``--worker``), each trainer ``--steps`` steps of ``--batch`` windows from its shard: the same
total tokens and the same number of optimizer steps as the reference. Methods:

* ``grad-none``, ``grad-uint8-blockwise``: ``CollaborativeOptimizer`` averaging gradients
  every step (a global batch of 4 x ``--batch``), AdamW on the mean;
* ``diloco-h20``, ``diloco-h50``: ``DiLoCo`` with H = 20 or 50 inner AdamW steps, outer
  Nesterov SGD (lr 0.7, momentum ``--outer-momentum``, default the paper's 0.9),
  ``uint8-blockwise`` pseudo-gradients;
* ``sparseloco-h20``, ``sparseloco-h50``: ``DiLoCo`` H = 20 or 50 with codec ``sparseloco``
  (``--sparse-fraction`` of every 4096, default 1/32; 2-bit values; error feedback) and a
  plain SGD outer step (lr ``--sparse-outer-lr``, default 1);
* ``streaming-h50``: ``StreamingDiLoCo``, H = 50 in 5 fragments (one sync every 10 inner
  steps), each round overlapped with ``--overlap-steps`` (2) inner steps, ``uint4-blockwise``
  outer gradients, outer Nesterov SGD as for DiLoCo; its final model is the anchor (the
  swarm's model);
* ``powersgd-r4``: ``PowerSGDOptimizer``, rank-4 factors of every gradient matrix (error
  feedback, warm-started Q) through two rounds per step, codec ``none``, AdamW on the
  result.

Prints one JSON line per method (and one for the reference): final validation loss, its
ratio to the reference, bytes sent per peer (from each daemon's status counters, mean over
the 4), the ratio of ``grad-none``'s bytes to the method's, whether the 4 trainers end with
bit-identical parameters (sha256), seconds. ``--smoke`` shrinks everything to run in about a
minute. The daemon and trainer plumbing is benchmarks/training.py's (imported).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import re
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .common import Proc, emit, module_command, parameters_sha256
from .common import start_daemons as start_loopback_daemons

PEERS = 4
HEADS = 4
STREAMING_FRAGMENTS = 5
"""Streaming DiLoCo's fragments: H = 50 -> a fragment sync every 10 inner steps."""
SPLIT_BLOCK = 16384
"""Bytes per block of the ``interleaved`` split (a few files' worth, far above a window)."""
VAL_SHARE = 26
"""A file is validation when the last byte of its path's sha256 is below this (~10%)."""
METHODS = (
    "grad-none",
    "grad-uint8-blockwise",
    "diloco-h20",
    "diloco-h50",
    "sparseloco-h20",
    "sparseloco-h50",
    "streaming-h50",
    "powersgd-r4",
)
"""The default methods; any ``diloco-hN``, ``sparseloco-hN``, ``streaming-hN`` (N a multiple
of the fragments), ``powersgd-rN`` or ``grad-CODEC`` is accepted too."""
METHOD_PATTERN = re.compile(
    r"(diloco|sparseloco|streaming)-h[1-9][0-9]*|(diloco|streaming)-auto|powersgd-r[1-9][0-9]*"
    r"|grad-.+|compute-only"
)
"""``diloco-auto`` / ``streaming-auto``: ``local_steps="auto"`` (H, and streaming's overlap,
chosen from the measured step and round times); ``compute-only``: the inner steps alone, no
daemon traffic (the step time the others are compared with on the test bed)."""


@dataclass(frozen=True)
class Config:
    """The run's sizes, shared by the reference and every trainer."""

    steps: int = 300
    batch: int = 4
    context: int = 128
    d_model: int = 128
    layers: int = 2
    lr: float = 3e-3
    max_bytes: int = 8_000_000
    """Training text used (the first bytes of the concatenated training files)."""
    val_windows: int = 128
    seed: int = 0
    sparse_outer_lr: float = 1.0
    sparse_fraction: float = 1 / 32
    outer_momentum: float = 0.9
    """DiLoCo's and streaming DiLoCo's outer Nesterov momentum (the paper's 0.9)."""
    outer_lr: float = 0.7
    """DiLoCo's and streaming DiLoCo's outer Nesterov lr (the paper's 0.7)."""
    sparse_decay: float = 1.0
    """SparseLoCo's error-feedback decay (1: classic error feedback)."""
    warmup: int = 0
    """Inner steps of linear lr warm-up before the cosine (the reference's too)."""
    split: str = "contiguous"
    """How the training text becomes 4 shards: ``contiguous`` (4 runs of files: each
    trainer sees other modules, non-iid) or ``interleaved`` (blocks of ``SPLIT_BLOCK``
    bytes dealt round robin: disjoint, but every trainer sees every module)."""
    timeout: float = 60.0
    ready_timeout: float = 120.0
    overlap_steps: int = 2
    publish_every: int = 1
    """DiLoCo-family wrappers' ``publish_state_every`` (streaming: in fragment syncs)."""
    """Streaming DiLoCo: inner steps each fragment's round overlaps (below H / fragments)."""
    """Seconds a daemon or trainer may take to come up (raise it on a loaded machine)."""


# ---------------------------------------------------------------- data


@functools.lru_cache(maxsize=2)
def corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) bytes of the standard library's sources, split by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[bytes] = []
    val: list[bytes] = []
    size = 0
    for path in sorted(root.rglob("*.py"), key=lambda p: str(p.relative_to(root))):
        rel = str(path.relative_to(root))
        if rel.split("/")[0] in ("site-packages", "test"):
            continue  # third-party code and the regression suite: not the library itself
        try:
            text = path.read_bytes()
        except OSError:
            continue
        if hashlib.sha256(rel.encode()).digest()[-1] < VAL_SHARE:
            val.append(text)
        elif size < max_bytes:
            train.append(text)
            size += len(text)
    as_array = lambda chunks: np.frombuffer(b"\n".join(chunks), np.uint8).copy()  # noqa: E731
    return as_array(train)[:max_bytes], as_array(val)


def shard(
    train: np.ndarray, index: int, split: str = "contiguous", peers: int = PEERS
) -> np.ndarray:
    """Trainer ``index``'s disjoint part of the training text (``Config.split``)."""
    if split == "interleaved":
        blocks = train.size // SPLIT_BLOCK
        mine = [train[b * SPLIT_BLOCK : (b + 1) * SPLIT_BLOCK] for b in range(index, blocks, peers)]
        return np.concatenate(mine)
    if split != "contiguous":
        raise ValueError(f"unknown split {split!r}")
    bounds = np.linspace(0, train.size, peers + 1).astype(np.int64)
    return train[bounds[index] : bounds[index + 1]]


class Windows:
    """Random training windows of ``context + 1`` bytes from one text, seeded."""

    def __init__(self, text: np.ndarray, context: int, seed: int) -> None:
        self.text, self.context = text, context
        self.rng = np.random.default_rng(seed)

    def batch(self, size: int) -> Any:
        import torch

        starts = self.rng.integers(0, self.text.size - self.context - 1, size)
        rows = np.stack([self.text[s : s + self.context + 1] for s in starts])
        return torch.from_numpy(rows.astype(np.int64))


def validation_batch(val: np.ndarray, cfg: Config) -> Any:
    """The fixed validation windows (evenly spaced over the validation text)."""
    import torch

    starts = np.linspace(0, val.size - cfg.context - 2, cfg.val_windows).astype(np.int64)
    rows = np.stack([val[s : s + cfg.context + 1] for s in starts])
    return torch.from_numpy(rows.astype(np.int64))


# ---------------------------------------------------------------- model


def make_model(cfg: Config) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
            self.attn = nn.MultiheadAttention(cfg.d_model, HEADS, batch_first=True)
            self.mlp = nn.Sequential(
                nn.Linear(cfg.d_model, 4 * cfg.d_model),
                nn.GELU(),
                nn.Linear(4 * cfg.d_model, cfg.d_model),
            )

        def forward(self, x: Any, mask: Any) -> Any:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class ByteLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, cfg.d_model)
            # GPT-2's 0.02: with N(0, 1) the tied output's logits start at std sqrt(d).
            nn.init.normal_(self.embed.weight, std=0.02)
            self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.d_model))
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.ln = nn.LayerNorm(cfg.d_model)
            mask = torch.triu(torch.full((cfg.context, cfg.context), float("-inf")), 1)
            self.register_buffer("mask", mask, persistent=False)

        def forward(self, tokens: Any) -> Any:
            n = tokens.shape[1]
            x = self.embed(tokens) + self.pos[:n]
            for block in self.blocks:
                x = block(x, self.mask[:n, :n])
            return self.ln(x) @ self.embed.weight.T  # tied output

    torch.manual_seed(cfg.seed)  # every trainer starts from the same parameters
    return ByteLM()


def lm_loss(model: Any, rows: Any) -> Any:
    import torch

    logits = model(rows[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), rows[:, 1:].reshape(-1))


def validation_loss(model: Any, rows: Any) -> float:
    import torch

    with torch.no_grad():
        return float(lm_loss(model, rows))


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then cosine from ``cfg.lr`` to 10%."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    done = min(step - cfg.warmup, span) / span
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def adamw(model: Any, cfg: Config) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)


def train_reference(cfg: Config) -> dict[str, Any]:
    """One process, all the training text, global batch 4 x ``cfg.batch``."""
    train, val = corpus(cfg.max_bytes)
    model = make_model(cfg)
    opt = adamw(model, cfg)
    windows = Windows(train, cfg.context, 7 + cfg.seed)
    started = time.monotonic()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        lm_loss(model, windows.batch(PEERS * cfg.batch)).backward()
        opt.step()
        opt.zero_grad()
    return {
        "val_loss": validation_loss(model, validation_batch(val, cfg)),
        "seconds": time.monotonic() - started,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


# ---------------------------------------------------------------- one trainer


@dataclass(frozen=True)
class Job:
    """What one trainer runs; one JSON line on its stdin."""

    method: str
    control: str
    shard: int
    run_id: str
    config: dict[str, Any]


def build_wrapper(
    method: str, model: Any, inner: Any, client: Any, run_id: str, cfg: Config
) -> Any:
    import torch

    from swarmavg.averaging.optim import (
        CollaborativeOptimizer,
        DiLoCo,
        PowerSGDOptimizer,
        StreamingDiLoCo,
        sgd_outer_optimizer,
    )

    common: dict[str, Any] = {"averaging_timeout": cfg.timeout, "progress_ttl": 2 * cfg.timeout}
    if method.startswith("grad-"):
        return CollaborativeOptimizer(
            model.parameters(),
            inner,
            client,
            run_id,
            target_batch_size=PEERS * cfg.batch,
            batch_size_per_step=cfg.batch,
            codec=method.removeprefix("grad-"),
            max_wait=cfg.timeout,
            **common,
        )
    if method.startswith("powersgd-r"):
        return PowerSGDOptimizer(
            model.parameters(),
            inner,
            client,
            run_id,
            target_batch_size=PEERS * cfg.batch,
            batch_size_per_step=cfg.batch,
            codec="none",
            rank=int(method.removeprefix("powersgd-r")),
            max_wait=cfg.timeout,
            **common,
        )
    common["publish_state_every"] = cfg.publish_every
    family, _, h = method.partition("-h")
    if method.endswith("-auto"):
        family, h = method.removesuffix("-auto"), "auto"
    options: dict[str, Any] = {
        "local_steps": h if h == "auto" else int(h),
        "batch_size_per_step": cfg.batch,
    }
    momentum = cfg.outer_momentum
    nesterov = lambda p: torch.optim.SGD(  # noqa: E731
        p, lr=cfg.outer_lr, momentum=momentum, nesterov=momentum > 0
    )
    if family == "diloco":
        options.update(codec="uint8-blockwise", outer_optimizer=nesterov)
    elif family == "sparseloco":
        lr = cfg.sparse_outer_lr
        options["codec"] = f"sparseloco:fraction={cfg.sparse_fraction}" + (
            f",decay={cfg.sparse_decay}" if cfg.sparse_decay != 1.0 else ""
        )
        options["outer_optimizer"] = (
            sgd_outer_optimizer if lr == 1.0 else lambda p: torch.optim.SGD(p, lr=lr)
        )
    elif family == "streaming":
        options.update(
            codec="uint4-blockwise",
            fragments=STREAMING_FRAGMENTS,
            overlap_steps=cfg.overlap_steps,
            outer_optimizer=nesterov,
        )
        return StreamingDiLoCo(model.parameters(), inner, client, run_id, **options, **common)
    else:
        raise ValueError(f"unknown method {method!r}")
    return DiLoCo(model.parameters(), inner, client, run_id, **options, **common)


WRAPPER_PARTS = ("_start_sync", "_apply_pending", "_outer_sync", "_maybe_publish")
"""The wrapper methods whose seconds a trainer reports (``parts``): where its time goes.
``_maybe_publish`` (the state handed to the daemon for late joiners) runs inside the others."""


def time_parts(opt: Any) -> dict[str, float]:
    """Wrap ``opt``'s methods of ``WRAPPER_PARTS`` (those it has) to sum their seconds."""
    seconds: dict[str, float] = {}
    for name in WRAPPER_PARTS:
        method = getattr(opt, name, None)
        if method is None:
            continue
        seconds[name] = 0.0

        def timed(*args: Any, _name: str = name, _method: Any = method, **kw: Any) -> Any:
            entered = time.monotonic()
            try:
                return _method(*args, **kw)
            finally:
                seconds[_name] += time.monotonic() - entered

        setattr(opt, name, timed)
    return seconds


class InnerUpdateTimer:
    """Seconds the inner optimizer's ``step()`` took, summed (through its step hooks)."""

    def __init__(self, inner: Any) -> None:
        self.seconds = 0.0
        self._entered = 0.0

        def before(*_: Any) -> None:
            self._entered = time.monotonic()

        def after(*_: Any) -> None:
            self.seconds += time.monotonic() - self._entered

        self._hooks = [inner.register_step_pre_hook(before), inner.register_step_post_hook(after)]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def train_peer(job: Job) -> dict[str, Any]:
    import torch

    from swarmavg.peer import connect

    cfg = Config(**job.config)
    train, val = corpus(cfg.max_bytes)
    windows = Windows(
        shard(train, job.shard, cfg.split), cfg.context, 100 + job.shard + 1000 * cfg.seed
    )
    model = make_model(cfg)
    inner = adamw(model, cfg)
    auto = job.method.endswith("-auto")
    with connect(job.control) as client:
        sent_before = int(client.status()["bytes_sent"])
        opt = (
            None
            if job.method == "compute-only"
            else build_wrapper(job.method, model, inner, client, job.run_id, cfg)
        )
        emit({"event": "started"})
        sys.stdin.readline()  # every trainer starts at the same moment
        started = time.monotonic()
        # Gradient averaging counts global steps (a fast trainer may take two local steps
        # in one); DiLoCo counts this trainer's inner steps (H per outer step); with
        # local_steps="auto" H changes between outer steps, so the trainer counts its own.
        h = getattr(opt, "local_steps", 0)
        local = 0
        if opt is None or auto:
            position = lambda: local  # noqa: E731
        elif not h:
            position = lambda: opt.epoch  # noqa: E731
        else:
            position = lambda: opt.epoch * h + opt.inner_steps  # noqa: E731
        inner_update = InnerUpdateTimer(inner)
        parts = {} if opt is None else time_parts(opt)
        in_step = 0.0  # seconds inside the wrapper's step(), its inner update included
        added: list[float] = []  # each step's seconds beyond its inner update
        while (step := position()) < cfg.steps:
            for group in inner.param_groups:
                group["lr"] = lr_at(step, cfg)
            lm_loss(model, windows.batch(cfg.batch)).backward()
            entered, updating = time.monotonic(), inner_update.seconds
            (inner if opt is None else opt).step()
            in_step += time.monotonic() - entered
            added.append(time.monotonic() - entered - (inner_update.seconds - updating))
            (inner if opt is None else opt).zero_grad()
            local += 1
        train_seconds = time.monotonic() - started
        inner_update.remove()
        if opt is not None:
            opt.close()
        sent = int(client.status()["bytes_sent"]) - sent_before
    chosen: dict[str, Any] = {}
    if opt is not None and (auto or hasattr(opt, "fragments")):
        # Streaming, and "auto" (whose last outer step need not fall on the last inner
        # step): the swarm's model is the anchor (each member's parameters add its
        # progress since each fragment's, or the model's, last sync).
        with torch.no_grad():
            for p, a in zip(model.parameters(), opt.anchor, strict=True):
                p.copy_(a)
        if auto:
            streaming = hasattr(opt, "fragments")
            chosen = {
                "local_steps": opt.cycle_steps if streaming else opt.local_steps,
                "overlap_steps": opt.overlap_steps if streaming else None,
                "agreed_ratio": opt.agreed_ratio,
                "steps_after_last_sync": opt.inner_steps,
            }
    return {
        "event": "done",
        "val_loss": validation_loss(model, validation_batch(val, cfg)),
        "bytes_sent": sent,
        "rounds": 0 if opt is None else opt.stats.rounds,
        "failed": 0 if opt is None else opt.stats.failed,
        "sha256": parameters_sha256(model),
        "train_seconds": train_seconds,
        # What the wrapper adds to the inner steps on this trainer's own clock: syncs
        # started and applied, waits for rounds, progress reports (0 for compute-only).
        "wrapper_seconds": 0.0 if opt is None else max(0.0, in_step - inner_update.seconds),
        "steps": local,
        "parts": {k: round(v, 3) for k, v in parts.items()},
        # Spread over every step (contention) or in a few (the syncs)? The median step's
        # added milliseconds, and the seconds added by the steps above 20 ms.
        "added_ms_median": round(1000 * float(np.median(added)), 2) if added else 0.0,
        "added_seconds_over_20ms": round(sum(a for a in added if a > 0.02), 3),
        **chosen,
    }


def worker() -> None:
    """A trainer process: runs the jobs it reads from stdin, one JSON line each."""
    import torch

    import swarmavg.averaging.optim
    import swarmavg.peer  # noqa: F401  (imported once, before the first job)

    torch.set_num_threads(1)
    emit({"event": "idle"})
    for line in sys.stdin:
        if not line.strip():
            continue
        record = json.loads(line)
        if "reference" in record:
            emit({"event": "reference", **train_reference(Config(**record["reference"]))})
        else:
            emit(train_peer(Job(**record)))


# ---------------------------------------------------------------- the run


def run_method(
    method: str, cfg: Config, workers: list[Proc], log: Any, workdir: Path
) -> dict[str, Any]:
    """``method`` on 4 fresh daemons on this machine (loopback)."""
    started = time.monotonic()
    daemons = start_loopback_daemons(workdir, PEERS, log, "lm", ready_timeout=cfg.ready_timeout)
    try:
        out = run_jobs(method, cfg, workers, [control for _, control in daemons])
    finally:
        for proc, _ in daemons:
            proc.close()
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def run_jobs(method: str, cfg: Config, workers: list[Proc], controls: list[str]) -> dict[str, Any]:
    """``method`` on the trainers ``workers``, trainer i on the daemon at ``controls[i]``,
    all started at once; the summary line's figures."""
    started = time.monotonic()
    run_id = f"lm-{method}-{time.monotonic_ns()}"
    marks = [
        w.send(asdict(Job(method, control, i, run_id, asdict(cfg))))
        for i, (w, control) in enumerate(zip(workers, controls, strict=True))
    ]
    budget = 60 + 10 * cfg.steps
    for w, m in zip(workers, marks, strict=True):
        w.wait_for(lambda r: r.get("event") in ("started", "done"), cfg.ready_timeout, m)
    for w in workers:
        w.send({"go": True})
    results = [
        w.wait_for(lambda r: r.get("event") == "done", budget, m)
        for w, m in zip(workers, marks, strict=True)
    ]
    chosen = {k: results[0][k] for k in ("local_steps", "overlap_steps") if k in results[0]}
    if "agreed_ratio" in results[0]:
        chosen["agreed_ratio"] = results[0]["agreed_ratio"]
        chosen["steps_after_last_sync"] = results[0]["steps_after_last_sync"]
    slowest = max(results, key=lambda r: r["train_seconds"])
    # The trainer whose wrapper added the largest share (the one wall_vs_compute reports):
    # often not the slowest one, but one that waits at its syncs for the slower ones.
    waiter = max(results, key=lambda r: r["wrapper_seconds"] / max(r["train_seconds"], 1e-9))
    return {
        **chosen,
        "val_loss": round(float(np.mean([r["val_loss"] for r in results])), 4),
        "slowest_trainer_parts_seconds": slowest.get("parts", {}),
        "slowest_trainer_added_ms_median": slowest.get("added_ms_median", 0.0),
        "slowest_trainer_added_seconds_over_20ms": slowest.get("added_seconds_over_20ms", 0.0),
        "waiting_trainer": {
            k: waiter.get(k)
            for k in ("parts", "added_ms_median", "added_seconds_over_20ms", "train_seconds")
        }
        | {"wrapper_seconds": round(waiter["wrapper_seconds"], 3)},
        "bytes_sent_per_peer": int(np.mean([r["bytes_sent"] for r in results])),
        "rounds_per_peer": float(np.mean([r["rounds"] for r in results])),
        "failed_rounds": sum(r["failed"] for r in results),
        "parameters_identical": len({r["sha256"] for r in results}) == 1,
        "train_seconds": round(max(r["train_seconds"] for r in results), 1),
        # Wall time per inner step (the slowest trainer's): what a user waits per step.
        "step_seconds": round(max(r["train_seconds"] / max(r["steps"], 1) for r in results), 4),
        # Wall time over the same run's compute (wall minus what the wrapper added), the
        # slowest trainer's: a ratio the machine's load cannot shift between two runs.
        "wall_vs_compute": round(
            max(
                r["train_seconds"] / max(r["train_seconds"] - r["wrapper_seconds"], 1e-9)
                for r in results
            ),
            4,
        ),
        "seconds": round(time.monotonic() - started, 1),
    }


REFERENCE_FIELDS = (
    "steps",
    "batch",
    "context",
    "d_model",
    "layers",
    "lr",
    "max_bytes",
    "val_windows",
    "seed",
    "warmup",
)
"""The settings the single process depends on (the split and the outer settings do not)."""


def reference_key(cfg: Config) -> str:
    return json.dumps({f: getattr(cfg, f) for f in REFERENCE_FIELDS}, sort_keys=True)


def load_cache(path: Path | None) -> dict[str, Any]:
    if path is None or not path.exists():
        return {}
    loaded = json.loads(path.read_text())
    return loaded if isinstance(loaded, dict) else {}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = Config()
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument(
        "--batch", type=int, default=defaults.batch, help="windows per trainer step"
    )
    parser.add_argument("--context", type=int, default=defaults.context)
    parser.add_argument("--d-model", type=int, default=defaults.d_model)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--max-bytes", type=int, default=defaults.max_bytes)
    parser.add_argument("--val-windows", type=int, default=defaults.val_windows)
    parser.add_argument("--sparse-outer-lr", type=float, default=defaults.sparse_outer_lr)
    parser.add_argument("--sparse-fraction", type=float, default=defaults.sparse_fraction)
    parser.add_argument("--outer-momentum", type=float, default=defaults.outer_momentum)
    parser.add_argument("--outer-lr", type=float, default=defaults.outer_lr)
    parser.add_argument("--sparse-decay", type=float, default=defaults.sparse_decay)
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="lr warm-up steps")
    parser.add_argument("--split", choices=("contiguous", "interleaved"), default=defaults.split)
    parser.add_argument("--timeout", type=float, default=defaults.timeout, help="s per round")
    parser.add_argument(
        "--overlap-steps",
        type=int,
        default=defaults.overlap_steps,
        help="inner steps a streaming round overlaps",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=defaults.ready_timeout,
        help="s a daemon or trainer may take to start (raise it on a loaded machine)",
    )
    parser.add_argument(
        "--reference-cache",
        type=Path,
        help="a JSON file of single-process results by configuration: read if it holds "
        "this one, else written (the reference does not depend on the methods' settings)",
    )
    parser.add_argument("--smoke", action="store_true", help="a one-minute configuration")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    cfg = Config(
        steps=args.steps,
        batch=args.batch,
        context=args.context,
        d_model=args.d_model,
        layers=args.layers,
        lr=args.lr,
        max_bytes=args.max_bytes,
        val_windows=args.val_windows,
        sparse_outer_lr=args.sparse_outer_lr,
        sparse_fraction=args.sparse_fraction,
        outer_momentum=args.outer_momentum,
        outer_lr=args.outer_lr,
        sparse_decay=args.sparse_decay,
        warmup=args.warmup,
        split=args.split,
        timeout=args.timeout,
        ready_timeout=args.ready_timeout,
        overlap_steps=args.overlap_steps,
    )
    if args.smoke:
        cfg = Config(
            steps=100,
            batch=2,
            context=32,
            d_model=32,
            layers=1,
            max_bytes=500_000,
            val_windows=16,
            sparse_outer_lr=args.sparse_outer_lr,
            sparse_fraction=args.sparse_fraction,
            outer_momentum=args.outer_momentum,
            outer_lr=args.outer_lr,
            sparse_decay=args.sparse_decay,
            warmup=args.warmup,
            split=args.split,
            timeout=args.timeout,
            ready_timeout=args.ready_timeout,
            overlap_steps=args.overlap_steps,
        )
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if not METHOD_PATTERN.fullmatch(m):
            parser.error(f"unknown method {m!r}; known: {', '.join(METHODS)} (any H, r, codec)")
    with tempfile.TemporaryDirectory(prefix="swarmavg-lm-") as tmp:
        workdir = Path(tmp)
        with open(workdir / "log.txt", "wb") as log:
            workers = [
                Proc([*module_command("benchmarks.lm"), "--worker"], log, stdin=True)
                for _ in range(PEERS)
            ]
            try:
                for w in workers:
                    w.wait_for(lambda r: r.get("event") == "idle", max(300, cfg.ready_timeout))
                cache = load_cache(args.reference_cache)
                reference = cache.get(reference_key(cfg))
                if reference is None:
                    mark = workers[0].send({"reference": asdict(cfg)})
                    reference = workers[0].wait_for(
                        lambda r: r.get("event") == "reference", 60 + 10 * cfg.steps, mark
                    )
                    if args.reference_cache is not None:
                        cache[reference_key(cfg)] = reference
                        args.reference_cache.write_text(json.dumps(cache, indent=1))
                emit({"method": "single-process", "config": asdict(cfg), **reference})
                base_bytes: int | None = None
                for method in methods:
                    out = run_method(method, cfg, workers, log, workdir)
                    if method == "grad-none":
                        base_bytes = out["bytes_sent_per_peer"]
                    out["val_loss_vs_single"] = round(out["val_loss"] / reference["val_loss"], 4)
                    if base_bytes:
                        out["bytes_reduction_vs_grad_none"] = round(
                            base_bytes / max(out["bytes_sent_per_peer"], 1), 1
                        )
                    emit({"method": method, **out})
            finally:
                for w in workers:
                    w.close()


if __name__ == "__main__":
    main()
