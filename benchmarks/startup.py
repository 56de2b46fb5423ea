"""Daemon start-up cost, two source trees A/B interleaved in one run.

For each tree (a checkout with its own ``.venv``, the package installed editable there):

- ``python -c "import swarmavg.peer.cli"``: CPU (user + system, from the child's rusage)
  and wall time, median of ``--imports`` runs;
- ``swarmavg peer --listen 127.0.0.1:0``: wall time from spawning it to its JSON ready
  line on stdout (how tests/harness.py detects readiness), and the CPU it had used by
  then (``/proc/PID/stat``), median of ``--daemons`` runs.

The trees take turns run by run, so a change of load on a shared machine hits both alike.
Prints ONE JSON line: the medians per tree and B/A ratios.

    python benchmarks/startup.py --tree A=/work/main --tree B=.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

READY_TIMEOUT = 120.0
TICKS = os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_import(python: Path, env: dict[str, str]) -> tuple[float, float]:
    """(CPU s, wall s) of one interpreter importing the CLI module and exiting."""
    cpu0, t0 = children_cpu(), time.perf_counter()
    subprocess.run([str(python), "-c", "import swarmavg.peer.cli"], env=env, check=True)
    return children_cpu() - cpu0, time.perf_counter() - t0


def process_cpu(pid: int) -> float:
    """User + system CPU seconds a live process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14, 15


def time_daemon(python: Path, env: dict[str, str], workdir: Path) -> tuple[float, float]:
    """(CPU s, wall s) from spawning ``swarmavg peer`` to its ready line."""
    command = [str(python), "-m", "swarmavg.peer.cli", "peer", "--listen", "127.0.0.1:0"]
    command += ["--control", str(workdir / "bench.sock"), "--run-id", "startup-bench", "-q"]
    ready = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=workdir
    )
    marks: list[float] = []

    def read_stdout() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:  # the first JSON "ready" record ends the wait
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(raw)
                if isinstance(record, dict) and record.get("event") == "ready":
                    marks.extend([time.perf_counter() - t0, process_cpu(proc.pid)])
                    ready.set()
        ready.set()  # EOF: the waiter sees no marks

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        if not ready.wait(READY_TIMEOUT) or not marks:
            raise RuntimeError(f"no ready line from {' '.join(command)} (exit {proc.poll()})")
        wall, cpu = marks[:2]
        return cpu, wall
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH, twice")
    parser.add_argument("--imports", type=int, default=7)
    parser.add_argument("--daemons", type=int, default=5)
    args = parser.parse_args()
    trees = {name: Path(path).resolve() for name, path in (t.split("=", 1) for t in args.tree)}
    samples: dict[str, dict[str, list[float]]] = {
        name: {"import_cpu": [], "import_wall": [], "ready_cpu": [], "ready_wall": []}
        for name in trees
    }
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="startup-") as tmp:
        # HOME in a fresh folder: the daemons keep nothing in the user's ~/.swarmavg.
        env = {**os.environ, "HOME": tmp}
        for tree in trees.values():  # a warm-up each: bytecode caches, page cache
            time_import(tree / ".venv/bin/python", env)
        for _ in range(args.imports):
            for name, tree in trees.items():
                cpu, wall = time_import(tree / ".venv/bin/python", env)
                samples[name]["import_cpu"].append(cpu)
                samples[name]["import_wall"].append(wall)
        for _ in range(args.daemons):
            for name, tree in trees.items():
                workdir = Path(tempfile.mkdtemp(dir=tmp))
                cpu, wall = time_daemon(tree / ".venv/bin/python", env, workdir)
                samples[name]["ready_cpu"].append(cpu)
                samples[name]["ready_wall"].append(wall)
    result: dict[str, Any] = {
        "imports": args.imports,
        "daemons": args.daemons,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "trees": {name: str(tree) for name, tree in trees.items()},
    }
    for name in trees:
        result[name] = {key: median(values) for key, values in samples[name].items()}
    if len(trees) == 2:
        a, b = trees
        result[f"{b}/{a}"] = {
            key: round(result[b][key] / result[a][key], 3) for key in samples[a] if result[a][key]
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
