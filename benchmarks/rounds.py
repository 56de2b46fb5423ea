"""The round a user sees: real ``swarmavg peer`` daemons and client processes on loopback.

For each peer count N, starts N ``swarmavg peer`` daemons
through the CLI (each joins the first) and N client processes (this script with
``--worker``, one per daemon), each holding ``--mb`` MB of float32. Every round, the parent
tells all workers one shared ``CLOCK_MONOTONIC`` instant to start at; each worker calls

    client.average(tensors, key=..., timeout=120, codec=codec)                # "default"
    client.average(tensors, key=..., timeout=120, codec=codec, group_size=N)  # "given"

and times its own call. A round's time is its slowest worker's (``slowest``) and the
median of its workers (``median``); each figure is the median over ``--rounds`` rounds,
after one untimed warm-up round per (mode, codec). The two modes take turns round by
round, so the machine's drifting load weighs on both alike. Then the same worker
processes run torch gloo's ``all_reduce`` of a tensor of the same size (the reference,
as in benchmarks/allreduce.py). Each record also says what one daemon spent per round of
its codec (``daemon_cpu_per_round``: user and system CPU, minor page faults, from
``/proc``, warm-up rounds included). Prints ONE JSON line on stdout; progress on stderr.

    python -m benchmarks.rounds --peers 2,4,8 --codecs none,float16,uint8-blockwise
    python -m benchmarks.rounds --peers 4,8 --codecs none --modes given \
        --aggregations mean,centered-clip,trimmed-mean
    python -m benchmarks.rounds --stability 500

``--stability R`` instead runs 4 daemons and 4 workers for R consecutive rounds in the
default configuration (``--stability-mb``, 1 MB): each worker calls again as soon as its
previous call returned, with no parent in between, and counts ``NoGroupError``, other
errors and rounds whose group is smaller than 4; prints that as its ONE JSON line.

Correctness: member ``i`` holds ``base * (1 + i/10) + i`` (``base`` the same N(0,1) draw
everywhere), so the mean over a group's members ``R`` is ``a * base + b`` with
``a = mean(1 + r/10)`` and ``b = mean(r)``. Every worker checks its result against it
(max error relative to max |mean|, against a tolerance per codec) and hashes it: the
members of one group must hold bit-identical results. ``--aggregations`` adds the reducers'
rule as an axis: within each round of a codec every rule takes a turn (which goes first
rotates), so ratios between rules are A/B in one swarm. A robust rule's result is not the
mean of these members (their copies differ by design), so for those only bit-identity is
checked and ``rel_error`` says how far from the mean it landed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .common import emit as _emit
from .common import module_command, swarmavg_command

CALL_TIMEOUT = 120.0
START_LEAD = 0.3
"""Seconds between the parent's round command and the instant every worker calls."""
READY_TIMEOUT = 60.0
CHECK_BLOCK = 1 << 20
"""Elements per block when a worker checks its result (bounds the float64 temporaries)."""
TOLERANCE = {
    "none": 1e-5,
    "float16": 2e-3,
    "scaled-float16": 2e-3,
    "bfloat16": 1.6e-2,
    "uint8-blockwise": 5e-2,
    "uint8-uniform": 5e-2,
    "uint8-quantile": 5e-2,
    "uint4-blockwise": 0.15,
}
"""Largest accepted max |result - mean| / max |mean| per codec (two roundings: the parts a
peer sends and the averaged part it returns; the 8-bit dynamic code's gap near a block's
largest value is about 1/64 of it, and a member's values reach 1.5x the mean's). Codecs not
listed are reported, not judged."""
BIAS_TOLERANCE = 1e-3
"""Largest accepted |mean(result - mean)| / max |mean|, every codec."""


def log(message: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"{stamp} rounds: {message}", file=sys.stderr, flush=True)


def make_base(elements: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(elements, dtype=np.float32)


def member_data(base: np.ndarray, rank: int) -> np.ndarray:
    return (base * np.float32(1 + rank / 10) + np.float32(rank)).astype(np.float32)


def check_result(result: np.ndarray, base: np.ndarray, ranks: list[int]) -> dict[str, float | str]:
    """Max |error| and |mean error| (the bias), both relative to max |mean|, and the
    result's sha256. The bias catches a wrong member set that a lossy codec's max error
    could hide: leaving out one of 8 members shifts every value by about 0.5."""
    a = float(np.mean([1 + r / 10 for r in ranks]))
    b = float(np.mean(ranks))
    flat = np.ascontiguousarray(result).reshape(-1)
    digest = hashlib.sha256(flat.tobytes()).hexdigest()
    worst, scale, total = 0.0, 0.0, 0.0
    for lo in range(0, flat.size, CHECK_BLOCK):
        expected = base[lo : lo + CHECK_BLOCK].astype(np.float64) * a + b
        diff = flat[lo : lo + CHECK_BLOCK].astype(np.float64) - expected
        if not np.all(np.isfinite(diff)):
            return {"rel_error": float("inf"), "rel_bias": float("inf"), "sha256": digest}
        worst = max(worst, float(np.abs(diff).max()))
        total += float(diff.sum())
        scale = max(scale, float(np.abs(expected).max()))
    scale = max(scale, 1e-30)
    return {
        "rel_error": worst / scale,
        "rel_bias": abs(total) / max(flat.size, 1) / scale,
        "sha256": digest,
    }


# -- the worker: one training process stand-in per daemon ----------------------------------


def _error_kind(exc: BaseException) -> str:
    from swarmavg.peer import NoGroupError

    return "NoGroupError" if isinstance(exc, NoGroupError) else type(exc).__name__


def _gloo(
    rank: int, n: int, data: np.ndarray, port: int, rounds: int, barrier: bool = True
) -> list[float]:
    """Seconds of each of ``rounds`` ``all_reduce`` calls of ``data``; ``barrier``: every
    call starts at one instant (the synchronised reference), else back to back, each call
    absorbing what the ranks' ends differ by, as a loop of calls does."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=n, rank=rank)
    try:
        tensor = torch.from_numpy(data.copy())
        times = []
        for _ in range(rounds + 1):
            if barrier:
                dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        return times[1:]  # the first round sets up connections
    finally:
        dist.destroy_process_group()


def worker_main(args: argparse.Namespace) -> int:
    """Connect to the daemon, then serve one JSON command per stdin line until EOF."""
    from swarmavg.peer import connect

    rank, elements = args.rank, args.elements
    base = make_base(elements)
    data = member_data(base, rank)
    tensors = [data]
    last: Any = None
    with connect(args.control) as client:
        _emit({"event": "ready", "rank": rank})
        for line in sys.stdin:
            command = json.loads(line)
            op = command["op"]
            if op == "round":
                last = None  # free the previous result before this round allocates one
                late = time.monotonic() - command["start_at"]
                if late < 0:
                    time.sleep(-late)
                started = time.perf_counter()
                record: dict[str, Any] = {"late_s": max(0.0, late)}
                try:
                    last = client.average(
                        tensors,
                        key=command["key"],
                        timeout=command["timeout"],
                        codec=command["codec"],
                        aggregation=command.get("aggregation", "mean"),
                        **({"group_size": command["group_size"]} if command["group_size"] else {}),
                    )
                except Exception as exc:  # every failure is a figure, reported to the parent
                    record.update(error=_error_kind(exc), message=str(exc)[:500])
                record["seconds"] = time.perf_counter() - started
                if last is not None:
                    record.update(
                        group_size=last.group_size,
                        peers=last.peers,
                        group_id=last.group_id,
                        partial=last.partial,
                        codec=last.codec,
                        timings=last.timings,
                    )
                _emit(record)
            elif op == "check":
                # Only once every member returned: a check costs CPU the others would miss.
                if last is None:
                    _emit({"error": "no result to check"})
                    continue
                _emit(check_result(last.tensors[0], base, command["ranks"]))
            elif op == "stability":
                _stability_loop(client, tensors, base, command)
            elif op == "gloo":
                seconds = _gloo(
                    rank,
                    command["n"],
                    data,
                    command["port"],
                    command["rounds"],
                    command.get("barrier", True),
                )
                _emit({"seconds": seconds})
            else:
                _emit({"error": f"unknown op {op!r}"})
    return 0


def _stability_loop(
    client: Any, tensors: list[np.ndarray], base: np.ndarray, command: dict[str, Any]
) -> None:
    """``rounds`` calls back to back (default configuration); one JSON line per call."""
    ranks_of: dict[str, int] = command["ranks_of"]
    late = time.monotonic() - command["start_at"]
    if late < 0:
        time.sleep(-late)
    for i in range(command["rounds"]):
        started = time.perf_counter()
        record: dict[str, Any] = {"round": i}
        try:
            result = client.average(tensors, key=f"s{i}", timeout=command["timeout"])
        except Exception as exc:  # counted by the parent
            record.update(
                seconds=time.perf_counter() - started,
                error=_error_kind(exc),
                message=str(exc)[:300],
            )
            _emit(record)
            continue
        record["seconds"] = time.perf_counter() - started
        ranks = [ranks_of.get(p, -1) for p in result.peers]
        record.update(
            group_size=result.group_size,
            group_id=result.group_id,
            partial=result.partial,
            matchmaking_s=result.timings.get("matchmaking"),
            **(check_result(result.tensors[0], base, ranks) if -1 not in ranks else {}),
        )
        _emit(record)
    _emit({"done": True})


# -- the parent: processes, rounds, figures ----------------------------------------------


try:
    _LIBC: Any = ctypes.CDLL(None)  # loaded here: the child must not load anything after fork
except OSError:
    _LIBC = None


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if this benchmark dies (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """A child process whose stdout lines are read by a thread, so every read has a deadline."""

    def __init__(self, name: str, argv: list[str], stderr: Any, stdin: bool) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_die_with_parent,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def read(self, deadline: float) -> dict[str, Any]:
        """The next JSON line; RuntimeError at EOF or past ``deadline`` (monotonic)."""
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name}: no answer by the deadline") from None
            if line is None:
                self.lines.put(None)
                raise RuntimeError(f"{self.name} exited with {self.proc.wait(5)}")
            with contextlib.suppress(json.JSONDecodeError):
                record: dict[str, Any] = json.loads(line)
                if isinstance(record, dict):
                    return record

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def stop(self, grace: float) -> None:
        """Close stdin (a worker exits at EOF) and SIGTERM it if it is still there, then
        SIGKILL after ``grace`` seconds."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(min(3.0, grace))
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)


class Swarm:
    """N daemons (CLI) and N workers; ``close`` stops them all, whatever happened."""

    def __init__(
        self,
        n: int,
        elements: int,
        workdir: Path,
        daemon_log_level: str,
        daemon_flags: Callable[[int], list[str]] | None = None,
        run_id: str | None = None,
    ) -> None:
        """Args:
        daemon_flags: extra ``swarmavg peer`` flags of daemon ``i`` (e.g. a private run's
            credentials, benchmarks/tls_rounds.py).
        run_id: the run (default: a fresh name).
        """
        self.n = n
        self.workdir = workdir
        self.daemons: list[Child] = []
        self.workers: list[Child] = []
        self.ready: list[dict[str, Any]] = []
        self._logs: list[Any] = []
        self._daemon_flags = daemon_flags
        self.run_id = run_id or f"rounds-{os.getpid()}-{n}-{os.urandom(3).hex()}"
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start(elements, daemon_log_level)
        except BaseException:
            self.close()
            raise

    def _daemon(self, i: int, level: str, join: str | None) -> Child:
        argv = [*swarmavg_command(), "peer", "--listen", "127.0.0.1:0", "--run-id", self.run_id]
        argv += ["--control", str(self.workdir / f"p{i}.sock"), "--log-level", level]
        if self._daemon_flags is not None:
            argv += self._daemon_flags(i)
        if join is not None:
            argv += ["--join", join]
        stderr = open(self.workdir / f"daemon{i}.log", "w")  # noqa: SIM115 - closed in close()
        self._logs.append(stderr)
        return Child(f"daemon {i}", argv, stderr, stdin=False)

    def _start(self, elements: int, level: str) -> None:
        started = time.monotonic()
        self.daemons.append(self._daemon(0, level, None))
        self.ready.append(self.daemons[0].read(time.monotonic() + READY_TIMEOUT))
        first = self.ready[0]["address"]
        self.daemons += [self._daemon(i, level, first) for i in range(1, self.n)]
        deadline = time.monotonic() + READY_TIMEOUT
        self.ready += [d.read(deadline) for d in self.daemons[1:]]
        for d, ready in zip(self.daemons, self.ready, strict=True):
            if ready.get("event") != "ready":
                raise RuntimeError(f"{d.name}: unexpected first line {ready!r}")
        for i, ready in enumerate(self.ready):
            argv = [*module_command("benchmarks.rounds"), "--worker", "--rank", str(i)]
            argv += ["--control", ready["control"], "--elements", str(elements)]
            self.workers.append(Child(f"worker {i}", argv, None, stdin=True))
        deadline = time.monotonic() + READY_TIMEOUT
        for w in self.workers:
            w.read(deadline)
        log(f"{self.n} daemons + {self.n} workers ready in {time.monotonic() - started:.1f} s")

    @property
    def ranks_of(self) -> dict[str, int]:
        return {r["peer_id"]: i for i, r in enumerate(self.ready)}

    def daemon_warnings(self) -> int:
        """WARNING/ERROR lines the daemons logged so far (their logs are in the workdir)."""
        count = 0
        for i in range(len(self.daemons)):
            with contextlib.suppress(OSError):
                text = (self.workdir / f"daemon{i}.log").read_text(errors="replace")
                count += sum(" WARNING " in line or " ERROR " in line for line in text.splitlines())
        return count

    def close(self) -> None:
        for w in self.workers:
            w.stop(grace=10)
        for d in self.daemons:
            d.stop(grace=15)
        for f in self._logs:
            f.close()
        self.workers.clear()
        self.daemons.clear()


def one_round(
    swarm: Swarm,
    key: str,
    codec: str,
    group_size: int | None,
    timeout: float,
    aggregation: str = "mean",
) -> dict[str, Any]:
    """Every worker calls at one instant; then each checks its result."""
    start_at = time.monotonic() + START_LEAD
    for w in swarm.workers:
        w.send(
            {
                "op": "round",
                "key": key,
                "codec": codec,
                "aggregation": aggregation,
                "group_size": group_size,
                "timeout": timeout,
                "start_at": start_at,
            }
        )
    deadline = start_at + timeout + 60
    replies = [w.read(deadline) for w in swarm.workers]
    ranks_of = swarm.ranks_of
    for w, reply in zip(swarm.workers, replies, strict=True):
        if "error" not in reply:
            w.send({"op": "check", "ranks": [ranks_of.get(p, -1) for p in reply["peers"]]})
    for w, reply in zip(swarm.workers, replies, strict=True):
        if "error" not in reply:
            reply.update(w.read(time.monotonic() + 120))
    seconds = [r["seconds"] for r in replies]
    groups: dict[str, set[str]] = {}
    for r in replies:
        if "error" not in r:
            groups.setdefault(r["group_id"], set()).add(r["sha256"])
    return {
        "slowest": max(seconds),
        "median": statistics.median(seconds),
        "errors": [f"{r['error']}: {r['message']}" for r in replies if "error" in r],
        "group_sizes": [r.get("group_size", 0) for r in replies],
        "groups": len(groups),
        "bit_identical": all(len(digests) == 1 for digests in groups.values()),
        "rel_error": max((r["rel_error"] for r in replies if "rel_error" in r), default=None),
        "rel_bias": max((r["rel_bias"] for r in replies if "rel_bias" in r), default=None),
        "partial": any(r.get("partial") for r in replies),
        "codecs_used": sorted({r["codec"] for r in replies if "codec" in r}),
        "late_s": max(r["late_s"] for r in replies),
        "matchmaking": max(
            (r["timings"].get("matchmaking", 0.0) for r in replies if "timings" in r), default=None
        ),
        "phases": _phases(max(replies, key=lambda r: r["seconds"])),
    }


PHASES = (
    "client.prepare",
    "daemon.accept",
    "daemon.check",
    "matchmaking",
    "allreduce.prepare",
    "allreduce.exchange",
    "allreduce.finish",
    "daemon.write_back",
)
"""Where a call's time goes, in order: the client's checks and copy into shared
memory, the daemon mapping it, its checked copy of the inputs, matchmaking, the all-reduce's
three steps, the result's copy into shared memory; ``other`` is the rest of the call
(control RPC, the local combiner, scheduling)."""


def _phases(reply: dict[str, Any]) -> dict[str, float] | None:
    """One worker's call split into :data:`PHASES` (``None`` without timings)."""
    timings = reply.get("timings")
    if not timings:
        return None
    phases = {name: float(timings.get(name, 0.0)) for name in PHASES}
    phases["other"] = max(reply["seconds"] - sum(phases.values()), 0.0)
    return phases


def _med(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summarize(
    rounds: list[dict[str, Any]], warmup: dict[str, Any], codec: str, aggregation: str = "mean"
) -> dict[str, Any]:
    ok = [r for r in rounds if not r["errors"]]
    tolerance = TOLERANCE.get(codec) if aggregation == "mean" else None
    errors = [r["rel_error"] for r in rounds if r["rel_error"] is not None]
    biases = [r["rel_bias"] for r in rounds if r["rel_bias"] is not None]
    sizes = Counter(s for r in rounds for s in r["group_sizes"])
    return {
        "slowest_s": _med([r["slowest"] for r in ok]),
        "median_s": _med([r["median"] for r in ok]),
        "slowest_all": [round(r["slowest"], 4) for r in rounds],
        "median_all": [round(r["median"], 4) for r in rounds],
        "matchmaking_s": _med([r["matchmaking"] for r in ok if r["matchmaking"] is not None]),
        "phases_s": {  # the slowest worker's call, median per phase over the rounds
            name: _med([r["phases"][name] for r in ok if r["phases"] is not None])
            for name in (*PHASES, "other")
        },
        "group_sizes": {str(k): v for k, v in sorted(sizes.items())},
        "groups_per_round": sorted({r["groups"] for r in rounds}),
        "failed_rounds": len(rounds) - len(ok),
        "errors": [e for r in rounds for e in r["errors"]][:5],
        "partial_rounds": sum(r["partial"] for r in rounds),
        "bit_identical": all(r["bit_identical"] for r in rounds),
        "max_rel_error": float(f"{max(errors):.3g}") if errors else None,
        "max_rel_bias": float(f"{max(biases):.3g}") if biases else None,
        "tolerance": tolerance,
        "exact_within_tolerance": (
            None
            if tolerance is None or not errors
            else max(errors) <= tolerance and max(biases) <= BIAS_TOLERANCE
        ),
        "codecs_used": sorted({c for r in rounds for c in r["codecs_used"]}),
        "max_late_start_s": round(max(r["late_s"] for r in rounds), 4),
        "warmup": {
            "slowest_s": round(warmup["slowest"], 4),
            "group_sizes": warmup["group_sizes"],
            "errors": warmup["errors"][:2],
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _rule_ratios(this: list[dict[str, Any]], first: list[dict[str, Any]]) -> dict[str, Any]:
    """Slowest-worker round time of one rule against the first rule's: the ratio of the
    medians and each round's own ratio (round r of both ran back to back)."""
    pairs = [(a["slowest"], b["slowest"]) for a, b in zip(this, first, strict=True)]
    per_round = [round(a / b, 2) for a, b in pairs if b]
    return {
        "slowest_ratio_of_medians": _ratio(
            statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
        ),
        "per_round": per_round,
        "per_round_median": round(statistics.median(per_round), 2) if per_round else None,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def gloo(swarm: Swarm, rounds: int, barrier: bool = True) -> dict[str, float]:
    port = _free_port()
    for w in swarm.workers:
        w.send({"op": "gloo", "n": swarm.n, "port": port, "rounds": rounds, "barrier": barrier})
    deadline = time.monotonic() + 300
    runs = [w.read(deadline)["seconds"] for w in swarm.workers]
    per_round = list(zip(*runs, strict=True))
    return {
        "slowest_s": round(statistics.median(max(t) for t in per_round), 4),
        "median_s": round(statistics.median(statistics.median(t) for t in per_round), 4),
    }


def daemon_counters(swarm: Swarm) -> tuple[float, float, int] | None:
    """User seconds, system seconds and minor page faults of the swarm's daemons, summed
    (``/proc/PID/stat``); ``None`` where there is no ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    faults = 0
    try:
        for daemon in swarm.daemons:
            stat = Path(f"/proc/{daemon.proc.pid}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()  # from field 3 (state) on
            faults += int(fields[7])  # minflt
            user += int(fields[11]) / tick
            system += int(fields[12]) / tick
    except (OSError, ValueError, IndexError):
        return None
    return user, system, faults


def per_round(
    before: tuple[float, float, int] | None,
    after: tuple[float, float, int] | None,
    rounds: int,
    daemons: int,
) -> dict[str, float] | None:
    """What one daemon spent per round on average, between two ``daemon_counters``."""
    if before is None or after is None or rounds <= 0:
        return None
    scale = rounds * daemons
    return {
        "user_ms": round(1e3 * (after[0] - before[0]) / scale, 1),
        "system_ms": round(1e3 * (after[1] - before[1]) / scale, 1),
        "minor_faults": round((after[2] - before[2]) / scale),
    }


def bench_peers(
    n: int, args: argparse.Namespace, workdir: Path, results: list[dict[str, Any]]
) -> None:
    """Append one record per codec to ``results`` (kept there if a later step fails)."""
    elements = int(args.mb * 1e6) // 4
    codecs = [c for c in args.codecs.split(",") if c]
    aggregations = [a for a in args.aggregations.split(",") if a]
    modes = {m: {"default": None, "given": n}[m] for m in args.modes.split(",") if m}
    swarm = Swarm(n, elements, workdir / f"n{n}", args.daemon_log_level)
    mine: list[dict[str, Any]] = []
    try:
        # Untimed: connections, the daemons' first-use costs and latency estimates, so that
        # each family's warm-up round below shows what a first call costs in that mode.
        outcome = one_round(swarm, "prime-r0", codecs[0], n, args.timeout)
        log(f"N={n} prime round: slowest {outcome['slowest']:.3f} s, {outcome['group_sizes']}")
        for codec in codecs:
            families = [(a, m) for a in aggregations for m in modes]
            measured: dict[tuple[str, str], list[dict[str, Any]]] = {f: [] for f in families}
            warmups: dict[tuple[str, str], dict[str, Any]] = {}
            counters = daemon_counters(swarm)
            for r in range(args.rounds + 1):  # round 0 warms up each (rule, mode) family
                # The families take turns going first, so none always runs right after
                # another's checks.
                shift = r % len(families)
                for aggregation, mode in families[shift:] + families[:shift]:
                    group_size = modes[mode]
                    rule = "" if aggregation == "mean" else f"{aggregation}-"
                    key = f"{codec}-{rule}{mode}-r{r}"
                    outcome = one_round(swarm, key, codec, group_size, args.timeout, aggregation)
                    log(
                        f"N={n} {codec} {aggregation} {mode} round {r}: "
                        f"slowest {outcome['slowest']:.3f} s, "
                        f"median {outcome['median']:.3f} s, groups {outcome['group_sizes']}"
                        + (f", errors {outcome['errors']}" if outcome["errors"] else "")
                    )
                    if r == 0:
                        warmups[(aggregation, mode)] = outcome
                    else:
                        measured[(aggregation, mode)].append(outcome)
            # Every round of this codec, warm-ups included; the daemons are idle between them.
            spent = per_round(
                counters, daemon_counters(swarm), (args.rounds + 1) * len(families), n
            )
            for aggregation in aggregations:
                figures = {
                    m: summarize(
                        measured[(aggregation, m)], warmups[(aggregation, m)], codec, aggregation
                    )
                    for m in modes
                }
                record = {"peers": n, "codec": codec, "aggregation": aggregation, **figures}
                record["daemon_cpu_per_round"] = spent
                if aggregation != aggregations[0]:
                    first = measured[(aggregations[0], next(iter(modes)))]
                    this = measured[(aggregation, next(iter(modes)))]
                    record["vs_" + aggregations[0]] = _rule_ratios(this, first)
                mine.append(record)
                results.append(mine[-1])
        reference = gloo(swarm, args.rounds) if args.gloo else None
        if reference is not None:
            log(f"N={n} gloo: {reference}")
        for result in mine:
            result["gloo"] = reference
            if "default" not in result or "given" not in result:
                continue
            d, g = result["default"], result["given"]
            ref = reference or {}
            result["ratios"] = {
                "default/given": _ratio(d["slowest_s"], g["slowest_s"]),
                "default/gloo": _ratio(d["slowest_s"], ref.get("slowest_s")),
                "given/gloo": _ratio(g["slowest_s"], ref.get("slowest_s")),
                "default/given (worker median)": _ratio(d["median_s"], g["median_s"]),
            }
        warnings = swarm.daemon_warnings()
        for result in mine:
            result["daemon_warning_lines"] = warnings
    finally:
        swarm.close()


def stability(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    n, rounds = 4, args.stability
    elements = int(args.stability_mb * 1e6) // 4
    swarm = Swarm(n, elements, workdir / "stability", args.daemon_log_level)
    records: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    started = time.monotonic()
    try:
        start_at = time.monotonic() + START_LEAD
        for w in swarm.workers:
            w.send(
                {
                    "op": "stability",
                    "rounds": rounds,
                    "timeout": args.timeout,
                    "start_at": start_at,
                    "ranks_of": swarm.ranks_of,
                }
            )
        # Every call ends within its timeout (plus the client's margin): bound each line.
        per_line = args.timeout + 60
        pending = set(range(n))
        last_log = time.monotonic()
        while pending:
            for i in sorted(pending):
                w = swarm.workers[i]
                deadline = time.monotonic() + per_line
                while True:  # drain what this worker has printed so far, one line at least
                    record = w.read(deadline)
                    if record.get("done"):
                        pending.discard(i)
                        break
                    records[i].append(record)
                    if w.lines.empty():
                        break
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                log(f"stability: rounds done per worker {[len(r) for r in records]}")
        warnings = swarm.daemon_warnings()
    finally:
        swarm.close()
    per_worker = []
    for i, recs in enumerate(records):
        ok = [r for r in recs if "error" not in r]
        times = sorted(r["seconds"] for r in ok)
        per_worker.append(
            {
                "rank": i,
                "rounds": len(recs),
                "ok": len(ok),
                "no_group_errors": sum(r.get("error") == "NoGroupError" for r in recs),
                "other_errors": sum("error" in r and r["error"] != "NoGroupError" for r in recs),
                "small_groups": sum(r["group_size"] < n for r in ok),
                "partial": sum(bool(r["partial"]) for r in ok),
                "median_s": _med(times),
                "p90_s": round(float(np.percentile(times, 90)), 4) if times else None,
                "matchmaking_median_s": _med(
                    [r["matchmaking_s"] for r in ok if r.get("matchmaking_s") is not None]
                ),
                "errors": [
                    f"round {r['round']}: {r['error']}: {r['message']}"
                    for r in recs
                    if "error" in r
                ][:3],
            }
        )
    # Members of one group must hold the same bytes, each within the codec's tolerance.
    groups: dict[str, set[str]] = {}
    for recs in records:
        for r in recs:
            if "error" not in r:
                groups.setdefault(r["group_id"], set()).add(r["sha256"])
    errors = [r["rel_error"] for recs in records for r in recs if "rel_error" in r]
    biases = [r["rel_bias"] for recs in records for r in recs if "rel_bias" in r]
    unchecked = sum("error" not in r and "rel_error" not in r for recs in records for r in recs)
    sizes = Counter(r["group_size"] for recs in records for r in recs if "error" not in r)
    all_times = [r["seconds"] for recs in records for r in recs if "error" not in r]
    return {
        "benchmark": "rounds-stability",
        "path": "4 swarmavg peer daemons (CLI) + 4 client processes, loopback, "
        "default configuration (no group_size), calls back to back",
        "peers": n,
        "rounds": rounds,
        "mb": args.stability_mb,
        "timeout": args.timeout,
        "totals": {
            "no_group_errors": sum(w["no_group_errors"] for w in per_worker),
            "other_errors": sum(w["other_errors"] for w in per_worker),
            "small_groups": sum(w["small_groups"] for w in per_worker),
            "partial": sum(w["partial"] for w in per_worker),
            "median_s": _med(all_times),
            "p90_s": round(float(np.percentile(all_times, 90)), 4) if all_times else None,
            "max_s": round(max(all_times), 4) if all_times else None,
            "group_sizes": {str(k): v for k, v in sorted(sizes.items())},
            "groups_not_bit_identical": sum(len(d) != 1 for d in groups.values()),
            "max_rel_error": float(f"{max(errors):.3g}") if errors else None,
            "max_rel_bias": float(f"{max(biases):.3g}") if biases else None,
            "exact_within_tolerance": bool(errors)
            and max(errors) <= TOLERANCE["none"]
            and max(biases) <= BIAS_TOLERANCE,
            "unchecked_results": unchecked,
            "wall_s": round(time.monotonic() - started, 1),
        },
        "workers": per_worker,
        "daemon_warning_lines": warnings,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="2,4,8")
    parser.add_argument("--codecs", default="none,float16,uint8-blockwise")
    parser.add_argument("--mb", type=float, default=64.0, help="MB (1e6 bytes) of float32")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per (mode, codec)")
    parser.add_argument(
        "--aggregations",
        default="mean",
        help="reducer rules (mean, centered-clip, trimmed-mean), A/B in every round; "
        "ratios are against the first",
    )
    parser.add_argument(
        "--modes", default="default,given", help="default (no group_size) and/or given"
    )
    parser.add_argument("--timeout", type=float, default=CALL_TIMEOUT, help="average timeout")
    parser.add_argument(
        "--stability", type=int, default=0, metavar="R", help="run R back-to-back rounds only"
    )
    parser.add_argument("--stability-mb", type=float, default=1.0)
    parser.add_argument("--gloo", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--daemon-log-level", default="WARNING")
    parser.add_argument(
        "--log-dir", default=None, help="keep the daemons' logs here (default: discarded)"
    )
    # worker mode (started by the benchmark itself)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--control", default="", help=argparse.SUPPRESS)
    parser.add_argument("--elements", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    args = parse_args()
    if args.worker:
        try:
            return worker_main(args)
        except KeyboardInterrupt:
            return 130
    signal.signal(signal.SIGTERM, _raise_interrupt)  # cleanup runs on SIGTERM as on Ctrl+C
    figures: dict[str, Any] = {
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "cpu_cores": os.cpu_count(),
    }
    status = 0
    # Unix socket paths are capped at 107 bytes: keep the folder short.
    workdir = Path(tempfile.mkdtemp(prefix="rounds-", dir="/tmp"))
    try:
        if args.stability:
            figures = {**stability(args, workdir), **figures}
        else:
            figures = {
                "benchmark": "rounds",
                "path": "swarmavg peer daemons (CLI) + one client process each, loopback",
                "mb": args.mb,
                "rounds": args.rounds,
                "timeout": args.timeout,
                **figures,
                "configs": [],
            }
            for n in (int(x) for x in args.peers.split(",") if x):
                bench_peers(n, args, workdir, figures["configs"])
    except KeyboardInterrupt:
        figures["error"] = "interrupted"
        status = 130
    except Exception as exc:  # the line still comes out, with what was measured
        figures["error"] = f"{type(exc).__name__}: {exc}"
        log(f"failed: {exc!r}")
        status = 1
    finally:
        if args.log_dir:
            shutil.copytree(
                workdir, args.log_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock")
            )
        shutil.rmtree(workdir, ignore_errors=True)
    figures["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
