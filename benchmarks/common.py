"""What several benchmarks share: JSON output, child processes, daemons, CPU counters.

Every benchmark is a module of this package, run from the repository root as
``python -m benchmarks.<name>``; a benchmark that starts copies of itself as workers starts
them the same way (``module_command``), so the children import this module as their parent
does, with no ``sys.path`` edits. Nothing here imports ``tests``: the test suite and the
benchmarks share only the package they both measure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
"""The repository root: the folder a benchmark's workers must import ``benchmarks`` from."""

TICKS = os.sysconf("SC_CLK_TCK")


def emit(record: dict[str, Any]) -> None:
    """Print one JSON line on stdout: a benchmark's result, or a worker's report."""
    print(json.dumps(record), flush=True)


def log(name: str, message: str) -> None:
    """Progress on stderr, so that stdout stays one JSON line."""
    print(f"{time.strftime('%H:%M:%S')} {name}: {message}", file=sys.stderr, flush=True)


def module_command(module: str) -> list[str]:
    """The command that runs ``module`` (e.g. ``benchmarks.rounds``) with this interpreter."""
    return [sys.executable, "-m", module]


def worker_env() -> dict[str, str]:
    """This environment with the repository root first on ``PYTHONPATH``, so a worker
    started with another working directory (a test bed host, a temporary folder) still
    imports ``benchmarks``."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def swarmavg_command() -> list[str]:
    """The console script next to this interpreter (the venv's), else the module."""
    script = Path(sys.executable).with_name("swarmavg")
    return [str(script)] if script.exists() else [sys.executable, "-m", "swarmavg.peer.cli"]


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds so far of the processes ``pids`` (every thread)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / TICKS


def random_state(mb: float, tensors: int, seed: int = 0) -> list[Any]:
    """``tensors`` float32 arrays of ``mb`` MB (1e6 bytes) in all: a model's state."""
    import numpy as np

    rng = np.random.default_rng(seed)
    per = int(mb * 1e6 / 4 / tensors)
    return [rng.standard_normal(per).astype(np.float32) for _ in range(tensors)]


class PathCosts:
    """What calls cost along each of several paths (say shared memory and the socket): this
    process's CPU, the daemons' CPU and the wall time. CPU is kept as a total per path and
    divided by the count at the end, since /proc counts whole clock ticks."""

    def __init__(self, paths: Sequence[str], daemon_pids: Sequence[int]) -> None:
        self.paths = tuple(paths)
        self._pids = list(daemon_pids)
        self._client = dict.fromkeys(self.paths, 0.0)
        self._daemon = dict.fromkeys(self.paths, 0.0)
        self._walls: dict[str, list[float]] = {path: [] for path in self.paths}

    @contextlib.contextmanager
    def call(self, path: str, settle: float = 0.0) -> Iterator[None]:
        """Time the block as one call along ``path``; the daemons' CPU is read ``settle``
        seconds after it ends (work the call left running counts with it)."""
        daemon_before = cpu_seconds(self._pids)
        cpu_before, wall_before = time.process_time(), time.perf_counter()
        yield
        self._walls[path].append(time.perf_counter() - wall_before)
        self._client[path] += time.process_time() - cpu_before
        time.sleep(settle)
        self._daemon[path] += cpu_seconds(self._pids) - daemon_before

    def figures(self) -> dict[str, Any]:
        """Per path: client and daemon CPU per call (ms), the median call (ms); and the
        first path's ratios over the second's."""
        per_path = {
            path: {
                "client_cpu_ms": round(1000 * self._client[path] / len(self._walls[path]), 2),
                "daemon_cpu_ms": round(1000 * self._daemon[path] / len(self._walls[path]), 2),
                "wall_ms_median": round(1000 * statistics.median(self._walls[path]), 2),
            }
            for path in self.paths
        }
        first, second = (per_path[path] for path in self.paths[:2])
        ratios = {
            f"{what}_ratio": round(first[f"{what}_ms"] / max(second[f"{what}_ms"], 1e-9), 3)
            for what in ("client_cpu", "daemon_cpu")
        }
        ratios["wall_ratio"] = round(
            first["wall_ms_median"] / max(second["wall_ms_median"], 1e-9), 3
        )
        return {**per_path, **ratios}


def parameters_sha256(model: Any) -> str:
    """sha256 of a torch model's parameters' bytes: equal only for bit-identical parameters."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class Proc:
    """A child process whose JSON stdout lines are collected by a reader thread, so that
    every wait for a line has a deadline."""

    def __init__(
        self,
        command: list[str],
        stderr: Any,
        stdin: bool = False,
        cwd: Path | None = None,
    ) -> None:
        self.popen = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            env=worker_env(),
            cwd=cwd,
        )
        self.lines: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                with self.cond:
                    self.lines.append(record)
                    self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float, since: int = 0
    ) -> dict[str, Any]:
        """The first line (from index ``since``) that satisfies ``predicate``.

        Raises:
            RuntimeError: the process exited first.
            TimeoutError: no such line within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for record in self.lines[since:]:
                    if predicate(record):
                        return record
                if not self.reader.is_alive():
                    raise RuntimeError(f"{self.popen.args[-3:]} exited ({self.popen.poll()})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no expected line from {self.popen.args[-3:]} in {timeout}s"
                    )
                self.cond.wait(left)

    def ready(self, timeout: float) -> dict[str, Any]:
        """A daemon's JSON ready line (address, control socket, peer id)."""
        return self.wait_for(lambda r: r.get("event") == "ready", timeout)

    def send(self, record: dict[str, Any]) -> int:
        """Write one JSON line to stdin; return the index of the next output line."""
        assert self.popen.stdin is not None
        with self.cond:
            mark = len(self.lines)
        self.popen.stdin.write((json.dumps(record) + "\n").encode())
        self.popen.stdin.flush()
        return mark

    def position(self, since: int = 0) -> int:
        """The newest training position this process reported (from line ``since`` on)."""
        with self.cond:
            lines = self.lines[since:]
        return max((int(r["position"]) for r in lines if "position" in r), default=-1)

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def close(self, timeout: float = 15.0, *, terminate: bool = True) -> None:
        """Stop the process (SIGTERM unless ``terminate`` is False: already signalled),
        SIGKILL after ``timeout`` seconds."""
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()
        if terminate:
            self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout)
        self.reader.join(timeout)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def start_daemons(
    workdir: Path,
    count: int,
    log_file: Any,
    run_id: str,
    join: str = "",
    ready_timeout: float = 60.0,
) -> list[tuple[Proc, str]]:
    """Start ``count`` ``swarmavg peer`` daemons on loopback (the first founds the swarm
    unless ``join``); return (process, control socket) of each, once each printed its
    ready line within ``ready_timeout`` seconds."""
    started: list[tuple[Proc, str]] = []

    def start(index: int, join_address: str) -> tuple[Proc, str]:
        control = str(workdir / f"peer-{time.monotonic_ns()}-{index}.sock")
        command = [*swarmavg_command(), "peer", "--listen", "127.0.0.1:0"]
        command += ["--control", control, "--run-id", run_id, "--log-level", "WARNING"]
        if join_address:
            command += ["--join", join_address]
        return Proc(command, log_file), control

    if not join:
        first = start(0, "")
        join = str(first[0].ready(ready_timeout)["address"])
        started.append(first)
    rest = [start(i, join) for i in range(len(started), count)]
    for proc, _ in rest:
        proc.ready(ready_timeout)
    return started + rest


class Daemon:
    """A ``swarmavg`` daemon started by a ``DaemonPool``: its process, its ready line (address,
    control endpoint, peer id) and the file its stderr goes to."""

    def __init__(self, proc: Proc, ready: dict[str, Any], stderr_path: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.ready = ready
        self.address = str(ready["address"])
        self.control = str(ready["control"])
        self.peer_id = str(ready["peer_id"])
        self.stderr_path = stderr_path


class DaemonPool:
    """Daemons whose commands the caller builds (e.g. inside a test bed host's network
    namespace), each logging to its own file in ``workdir``; ``close`` stops them all."""

    def __init__(self, workdir: Path, ready_timeout: float = 60.0) -> None:
        self.workdir = workdir
        self.ready_timeout = ready_timeout
        self.processes: list[Daemon] = []

    def start(self, args: Sequence[str], executable: Sequence[str] | None = None) -> Daemon:
        """Run ``swarmavg *args`` (``executable`` replaces ``swarmavg``); return once it
        printed its ready line.

        Raises:
            RuntimeError, TimeoutError: it exited or printed no ready line in time.
        """
        command = [*(executable or swarmavg_command()), *args]
        with tempfile.NamedTemporaryFile(
            dir=self.workdir, prefix="stderr-", suffix=".log", delete=False
        ) as stderr:
            proc = Proc(command, stderr, cwd=self.workdir)
        try:
            ready = proc.ready(self.ready_timeout)
        except Exception:
            proc.close(timeout=5)
            raise
        daemon = Daemon(proc, ready, Path(stderr.name))
        self.processes.append(daemon)
        return daemon

    def close(self) -> None:
        for daemon in self.processes:
            daemon.proc.close(timeout=10)
        self.processes.clear()
