"""Human-readable rendering of a run's view (``swarmavg peers`` without ``--json``)."""

from __future__ import annotations

import math
from typing import Any

PEER_ID_CHARS = 12
"""Hex characters of a peer id shown in the table (``--json`` has them whole)."""


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _metric(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def progress_line(run_id: str, progress: dict[str, Any]) -> str:
    """``run r (collaborative): epoch 3, 96/128 samples, 40.0 samples/s, next step in 0.8 s,
    2 peers``."""
    target = progress["target"]
    gathered = f"{progress['samples']}/{target}" if target else str(progress["samples"])
    eta = progress["eta"]
    if eta is None:
        when = "next step: unknown (no target or no progress)"
    elif eta == 0:
        when = "next step: due now"
    else:
        when = f"next step in {_duration(eta)}"
    peers = progress["peers"]
    return (
        f"run {run_id} ({progress['method']}): epoch {progress['epoch']}, {gathered} samples, "
        f"{progress['samples_per_second']:.1f} samples/s, {when}, "
        f"{peers} peer{'s' if peers != 1 else ''}"
    )


def training_run_text(run: dict[str, Any]) -> str:
    """``'my-run' (collaborative): 3 trainers, 1 alone``."""
    n, alone = run["trainers"], run["alone"]
    lonely = f", {alone} alone" if alone else ""
    return f"{run['run']!r} ({run['method']}): {n} trainer{'s' if n != 1 else ''}{lonely}"


def format_peers(view: dict[str, Any]) -> str:
    """A run summary per training method, then one row per peer (``*``: the daemon asked)."""
    lines = [progress_line(view["run_id"], p) for p in view["progress"]]
    if not view["progress"]:
        lines.append(f"run {view['run_id']}: no trainer reports progress yet")
    runs = view.get("training_runs") or []
    if runs:
        lines.append("training runs: " + "; ".join(training_run_text(r) for r in runs))
        if not view["progress"]:
            lines.append("(swarmavg peers --training-run NAME shows the progress of one of them)")
    header = ("PEER", "ADDRESS", "MODE", "METHOD", "EPOCH", "SAMPLES/S", "PROCS", "SEEN", "METRICS")
    rows = [header]
    for r in view["peers"]:
        trains = r["method"] is not None
        rows.append(
            (
                r["peer_id"][:PEER_ID_CHARS] + ("*" if r["this_peer"] else ""),
                r["address"] or "-",
                r["mode"],
                r["method"] or "-",
                str(r["epoch"]) if trains else "-",
                f"{r['samples_per_second']:.1f}" if trains else "-",
                str(r["processes"]) if trains else "-",
                f"{_duration(r['last_seen'])} ago",
                " ".join(f"{k}={_metric(v)}" for k, v in r["metrics"].items()) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {4, 5, 6, 7}  # numbers line up on the right
    lines.append("")
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    if view["ignored_records"]:
        lines.append(f"({view['ignored_records']} malformed or implausible record(s) ignored)")
    return "\n".join(lines)
