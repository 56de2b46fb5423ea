"""The loss-vs-bytes front of the language-model methods, as a PNG.

Reads JSON lines as ``benchmarks/lm.py`` prints them (one per method; extra keys
``settings``, ``split`` and ``session`` label them, single-process lines are skipped),
plots validation loss relative to the single process against bytes sent per peer (log
scale), one marker per method family and one colour per data split, and draws the
Pareto front (no other point has both fewer bytes and a lower loss). Runs with failed
rounds are left out (their bytes and loss are not the method's) and listed, and so are runs of
another length than ``--steps`` (a row's ``steps`` key, 300 when absent: a ratio to a longer
run's reference is not on the same scale).

    python -m benchmarks.lm_plot benchmarks/results/lm-front.jsonl --out docs/lm-front.png

Needs matplotlib (``pip install matplotlib``; not a dependency of the package). Prints one
JSON line: the points on the front and the runs left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MARKERS = {"grad": "o", "powersgd": "s", "diloco": "^", "streaming": "D", "sparseloco": "v"}
COLOURS = {"contiguous": "tab:blue", "interleaved": "tab:orange"}


def load(paths: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("method") != "single-process":
                    rows.append(row)
    return rows


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows no other row beats on both bytes and loss, by increasing bytes."""
    ordered = sorted(rows, key=lambda r: (r["bytes_sent_per_peer"], r["val_loss_vs_single"]))
    front: list[dict[str, Any]] = []
    for row in ordered:
        if not front or row["val_loss_vs_single"] < front[-1]["val_loss_vs_single"]:
            front.append(row)
    return front


def label(row: dict[str, Any]) -> str:
    return f"{row['method']} ({row.get('settings', '')}, {row.get('split', '?')})"


def plot_title(steps: int) -> str:
    return f"benchmarks/lm.py: 4 peers, {steps} steps, 120k parameters"


def plot(rows: list[dict[str, Any]], front: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    for row in rows:
        family = row["method"].split("-")[0]
        ax.scatter(
            row["bytes_sent_per_peer"] / 1e6,
            row["val_loss_vs_single"],
            marker=MARKERS.get(family, "x"),
            color=COLOURS.get(row.get("split", ""), "tab:gray"),
            s=50,
        )
        ax.annotate(
            row["method"],
            (row["bytes_sent_per_peer"] / 1e6, row["val_loss_vs_single"]),
            textcoords="offset points",
            xytext=(4, 3),
            fontsize=7,
        )
    ax.plot(
        [r["bytes_sent_per_peer"] / 1e6 for r in front],
        [r["val_loss_vs_single"] for r in front],
        color="black",
        linewidth=0.8,
        linestyle="--",
        label="front (no point has fewer bytes and lower loss)",
    )
    ax.axhline(1.02, color="tab:green", linewidth=0.8, label="goal: within 2% of one process")
    if rows and "grad-none" in {r["method"] for r in rows}:
        base = max(r["bytes_sent_per_peer"] for r in rows if r["method"] == "grad-none")
        ax.axvline(
            base / 1000 / 1e6, color="tab:red", linewidth=0.8, label="goal: 1000x fewer bytes"
        )
    for family, marker in MARKERS.items():
        ax.scatter([], [], marker=marker, color="tab:gray", label=family)
    for split, colour in COLOURS.items():
        ax.scatter([], [], marker="s", color=colour, label=f"split {split}")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per peer (MB, log scale)")
    ax.set_ylabel("validation loss / single process's")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, which="both", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="JSON-lines files")
    parser.add_argument("--out", type=Path, default=Path("docs/lm-front.png"))
    parser.add_argument("--steps", type=int, default=300, help="plot the runs of this length")
    args = parser.parse_args()
    rows = [r for r in load(args.inputs) if r.get("steps", 300) == args.steps]
    clean = [r for r in rows if not r.get("failed_rounds")]
    left_out = [label(r) for r in rows if r.get("failed_rounds")]
    front = pareto_front(clean)
    plot(clean, front, args.out, plot_title(args.steps))
    print(
        json.dumps(
            {
                "png": str(args.out),
                "points": len(clean),
                "front": [
                    {
                        "run": label(r),
                        "val_loss_vs_single": r["val_loss_vs_single"],
                        "bytes_sent_per_peer": r["bytes_sent_per_peer"],
                    }
                    for r in front
                ],
                "left_out_failed_rounds": left_out,
            }
        )
    )


if __name__ == "__main__":
    main()
