"""Rounds the way a user runs them: workers that start apart and compute between calls.

benchmarks/rounds.py starts every call of every
worker at one shared instant, which hides what users see: real training processes start
seconds apart and compute for their own time between calls. For each peer count N this
starts N ``swarmavg peer`` daemons through the CLI on loopback (each joins the first;
default configuration, no ``group_size`` unless ``--group-size`` gives one), then N
client processes (this script with ``--worker``), each on its own: worker i starts a
seeded random ``[0, --stagger]`` seconds after worker i-1, connects to its daemon and
runs its own loop with no shared start instant and no parent in between::

    for codec in codecs:
        for r in range(rounds):
            time.sleep(uniform(0, compute))  # seeded per worker; --compute 0: back to back
            client.average(tensors, key=f"{codec}-{r}", timeout=timeout, codec=codec)

Each call is a record: group size, group id, partial, the error's class and message, the
call's duration and the result's check (rounds.py's member data and check: max error and
bias relative to the exact mean of the members the result names, and its sha256, which the
members of one group must share). Workers stream their records to the parent; after the
loops, ``--gloo`` runs torch gloo's ``all_reduce`` of the same size in the same worker
processes, twice: behind a barrier before every call (rounds.py's synchronised reference,
``gloo``) and back to back (``gloo_back_to_back``: a loop of calls, each absorbing what the
ranks' ends differ by, as ours do). The result's check takes time between two calls (0.4-2 s
for 64 MB on a loaded machine): ``--check-every K`` checks every K-th round and the last, so
that ``--compute 0`` means no work between calls. Prints ONE JSON line on stdout (progress
on stderr): per
(peer count, codec) how many rounds were one group of N (every worker's call succeeded with
group size N and one group id), the rounds' shapes (``"4+3+1"``), the histogram of group
sizes over calls, NoGroupError and other errors, partial results, bit-identity within
groups, the median and p90 call time, the gloo median and the ratio of the two; and
where the time goes: the medians of the result's phase timings over all calls and over
each round's last caller (``phases_median_s``, ``last_caller_phases_median_s``), the
round once its last caller is there (``last_caller_median_s``) and the spread of the
calls' ends (``call_end_spread_median_s``).

    python -m benchmarks.unsync_rounds --peers 4,8 --rounds 20 --mb 16 --codecs none \
        --compute 2 --seed 1
    python -m benchmarks.unsync_rounds --peers 2,4 --rounds 10 --mb 64 --codecs none \
        --compute 0 --gloo
    python -m benchmarks.unsync_rounds --peers 8 --daemon-log-level DEBUG --log-dir /tmp/u8

With ``--daemon-log-level DEBUG`` each record also counts the daemons' group closes by
reason and size (their ``closing KEY with N member(s) (REASON)`` lines); ``--log-dir``
keeps the daemons' logs. The line's ``swarmavg_from`` says where swarmavg was imported from
(daemons and workers inherit this interpreter's environment): to measure the committed code
while the working tree holds edits, export it (``git archive HEAD | tar -x -C /tmp/head``,
plus the built ``compression/_native*.so``), link its five folders (proto, compression, dht,
averaging, peer) under ``/tmp/link/swarmavg/`` and run with ``PYTHONPATH=/tmp/link``
(benchmarks/results/unsync-baseline.jsonl was measured that way).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from . import rounds  # the loopback swarm, member data and checks, gloo
from .common import module_command

DEFAULT_TIMEOUT = 60.0
LINE_MARGIN = 60.0
"""Seconds past a call's compute time and timeout within which its worker must report."""
CLOSE_LINE = re.compile(r"closing (\S+) with (\d+) member\(s\) \((\w+)\) after ([\d.]+)s")
REJECT_LINE = re.compile(r"matchmaker: \w+ rejected us: (.*)$", re.MULTILINE)


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} unsync_rounds: {message}", file=sys.stderr, flush=True)


# -- the worker: one training process stand-in, on its own -------------------------------


def worker_main(spec: dict[str, Any]) -> int:
    """Connect, run the whole loop, then serve gloo commands from stdin until EOF."""
    from swarmavg.peer import connect

    rank = spec["rank"]
    base = rounds.make_base(spec["elements"])
    data = rounds.member_data(base, rank)
    tensors = [data]
    rng = np.random.default_rng([spec["seed"], rank])
    ranks_of: dict[str, int] = spec["ranks_of"]
    with connect(spec["control"]) as client:
        rounds._emit({"event": "ready", "rank": rank, "wall": time.time()})
        for codec in spec["codecs"]:
            for r in range(spec["rounds"]):
                compute = float(rng.uniform(0.0, spec["compute"])) if spec["compute"] > 0 else 0.0
                time.sleep(compute)
                record: dict[str, Any] = {
                    "rank": rank,
                    "codec": codec,
                    "round": r,
                    "compute_s": compute,
                    "wall_start": time.time(),
                }
                result = None
                started = time.perf_counter()
                try:
                    result = client.average(
                        tensors,
                        key=f"{codec}-{r}",
                        timeout=spec["timeout"],
                        codec=codec,
                        **({"group_size": spec["group_size"]} if spec["group_size"] else {}),
                    )
                except Exception as exc:  # every failure is a figure, reported to the parent
                    record.update(error=rounds._error_kind(exc), message=str(exc)[:500])
                record["seconds"] = time.perf_counter() - started
                record["wall_end"] = time.time()
                if result is not None:
                    ranks = [ranks_of.get(p, -1) for p in result.peers]
                    record.update(
                        group_size=result.group_size,
                        group_id=result.group_id,
                        ranks=ranks,
                        partial=result.partial,
                        codec_used=result.codec,
                        matchmaking_s=result.timings.get("matchmaking"),
                        timings=dict(result.timings),
                    )
                    checks = -1 not in ranks and (
                        (r + 1) % spec["check_every"] == 0 or r == spec["rounds"] - 1
                    )
                    if checks:  # outside the timed call, like a training step
                        checked = time.perf_counter()
                        record.update(rounds.check_result(result.tensors[0], base, ranks))
                        record["check_s"] = time.perf_counter() - checked
                    del result  # free it before the next round allocates one
                rounds._emit(record)
        rounds._emit({"done": True})
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("op") == "gloo":
                seconds = rounds._gloo(
                    rank,
                    command["n"],
                    data,
                    command["port"],
                    command["rounds"],
                    command.get("barrier", True),
                )
                rounds._emit({"seconds": seconds})
            else:
                rounds._emit({"error": f"unknown op {command!r}"})
    return 0


# -- the parent ----------------------------------------------------------------------------


class Daemons(rounds.Swarm):
    """rounds.py's swarm of N CLI daemons, without its workers: ours start on their own."""

    def _start(self, elements: int, level: str) -> None:
        started = time.monotonic()
        self.daemons.append(self._daemon(0, level, None))
        self.ready.append(self.daemons[0].read(time.monotonic() + rounds.READY_TIMEOUT))
        first = self.ready[0]["address"]
        self.daemons += [self._daemon(i, level, first) for i in range(1, self.n)]
        deadline = time.monotonic() + rounds.READY_TIMEOUT
        self.ready += [d.read(deadline) for d in self.daemons[1:]]
        for d, ready in zip(self.daemons, self.ready, strict=True):
            if ready.get("event") != "ready":
                raise RuntimeError(f"{d.name}: unexpected first line {ready!r}")
        log(f"{self.n} daemons ready in {time.monotonic() - started:.1f} s")

    def start_workers(self, spec: dict[str, Any], staggers: list[float]) -> None:
        """Worker i after ``staggers[i]`` seconds more than worker i-1. From this (the
        main) thread: a child's PR_SET_PDEATHSIG fires when the thread that forked it ends."""
        for i, (ready, pause) in enumerate(zip(self.ready, staggers, strict=True)):
            time.sleep(pause)
            mine = {**spec, "rank": i, "control": ready["control"]}
            argv = [*module_command("benchmarks.unsync_rounds"), "--worker", json.dumps(mine)]
            self.workers.append(rounds.Child(f"worker {i}", argv, None, stdin=True))

    def log_lines(self) -> tuple[list[tuple[str, int, str, float]], Counter[str]]:
        """``(key, members, reason, seconds)`` of every DEBUG ``closing`` line so far, and
        the reasons leaders gave when they refused a follower (DEBUG ``rejected us``)."""
        closes = []
        rejections: Counter[str] = Counter()
        for i in range(len(self.daemons)):
            path = self.workdir / f"daemon{i}.log"
            if path.exists():
                text = path.read_text(errors="replace")
                for m in CLOSE_LINE.finditer(text):
                    closes.append((m[1], int(m[2]), m[3], float(m[4])))
                rejections.update(m[1].strip() for m in REJECT_LINE.finditer(text))
        return closes, rejections


def collect(swarm: Daemons, per_line: float, total: int) -> list[list[dict[str, Any]]]:
    """Every worker's records until each said ``done``; RuntimeError when a worker stays
    silent for ``per_line`` seconds or exits early."""
    records: list[list[dict[str, Any]]] = [[] for _ in swarm.workers]
    heard = [time.monotonic()] * len(swarm.workers)
    pending = set(range(len(swarm.workers)))
    last_log = time.monotonic()
    while pending:
        for i in sorted(pending):
            w = swarm.workers[i]
            while not w.lines.empty():
                record = w.read(time.monotonic() + 5)
                heard[i] = time.monotonic()
                if record.get("done"):
                    pending.discard(i)
                    break
                if "round" in record:
                    records[i].append(record)
                    if "error" in record:
                        log(
                            f"worker {i} {record['codec']} round {record['round']}: "
                            f"{record['error']}: {record['message'][:200]}"
                        )
            if i in pending and time.monotonic() - heard[i] > per_line:
                raise RuntimeError(f"{w.name}: silent for {per_line:.0f} s")
        if time.monotonic() - last_log > 15:
            last_log = time.monotonic()
            log(f"N={swarm.n}: calls done per worker {[len(r) for r in records]} of {total}")
        time.sleep(0.05)
    return records


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def summarize(
    n: int,
    codec: str,
    rounds_n: int,
    records: list[list[dict[str, Any]]],
    group_size: int | None = None,
) -> dict[str, Any]:
    """Per round: one group of ``n``, or (``group_size`` below ``n``) the balanced split:
    every call in a group, ``ceil(n / group_size)`` groups whose sizes differ by one."""
    mine = [r for recs in records for r in recs if r["codec"] == codec]
    ok = [r for r in mine if "error" not in r]
    by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in mine:
        by_round[r["round"]].append(r)
    one_group: list[int] = []
    balanced: list[int] = []
    cap = min(group_size or n, n)
    groups_wanted = -(-n // cap)
    shapes: Counter[str] = Counter()
    in_order: list[str] = []
    spreads = []
    end_spreads = []
    last_callers = []
    slowest = []
    for r in range(rounds_n):
        calls = by_round.get(r, [])
        good = [c for c in calls if "error" not in c]
        sizes = {c["group_id"]: c["group_size"] for c in good}
        failed = len(calls) - len(good)
        shape = "+".join(str(s) for s in sorted(sizes.values(), reverse=True)) or "-"
        shape += f" ({failed} failed)" if failed else ""
        shapes[shape] += 1
        in_order.append(shape)
        if len(good) == n and len(sizes) == 1 and all(c["group_size"] == n for c in good):
            one_group.append(r)
        counted = list(sizes.values())
        if (
            len(good) == n
            and len(counted) == groups_wanted
            and max(counted) <= cap
            and max(counted) - min(counted) <= 1
        ):
            balanced.append(r)
        if calls:
            starts = [c["wall_start"] for c in calls]
            spreads.append(max(starts) - min(starts))
            ends = [c["wall_end"] for c in calls]
            end_spreads.append(max(ends) - min(ends))
            if good:
                last_callers.append(max(good, key=lambda c: c["wall_start"]))
            slowest.append(max(c["seconds"] for c in calls))
    groups: dict[str, set[str]] = defaultdict(set)
    for r in ok:
        if "sha256" in r:
            groups[r["group_id"]].add(r["sha256"])
    judged = [r for r in ok if "rel_error" in r and not r["partial"]]
    errors = [r["rel_error"] for r in judged]
    biases = [r["rel_bias"] for r in judged]
    tolerance = rounds.TOLERANCE.get(codec)
    times = [r["seconds"] for r in ok]
    failures = [r for r in mine if "error" in r]
    return {
        "peers": n,
        "codec": codec,
        "rounds": rounds_n,
        "calls": len(mine),
        "one_group_rounds": len(one_group),
        "one_group_rounds_after_first": sum(r > 0 for r in one_group),
        "not_one_group": [r for r in range(rounds_n) if r not in one_group],
        "group_size_given": group_size,
        "balanced_rounds": len(balanced),
        "round_shapes": dict(shapes.most_common()),
        "shape_by_round": in_order,
        "group_sizes": {str(k): v for k, v in sorted(Counter(r["group_size"] for r in ok).items())},
        "no_group_errors": sum(r["error"] == "NoGroupError" for r in failures),
        "other_errors": sum(r["error"] != "NoGroupError" for r in failures),
        "errors": [
            f"rank {r['rank']} round {r['round']}: {r['error']}: {r['message']}"
            for r in failures[:5]
        ],
        "partial": sum(bool(r["partial"]) for r in ok),
        "groups": len(groups),
        "groups_not_bit_identical": sum(len(d) != 1 for d in groups.values()),
        "bit_identical": all(len(d) == 1 for d in groups.values()),
        "unchecked_results": sum("rel_error" not in r for r in ok),
        "max_rel_error": float(f"{max(errors):.3g}") if errors else None,
        "max_rel_bias": float(f"{max(biases):.3g}") if biases else None,
        "tolerance": tolerance,
        "exact_within_tolerance": (
            None
            if tolerance is None or not errors
            else max(errors) <= tolerance and max(biases) <= rounds.BIAS_TOLERANCE
        ),
        "median_s": rounds._med(times),
        "p90_s": _pct(times, 90),
        "max_s": round(max(times), 4) if times else None,
        "failed_call_median_s": rounds._med([r["seconds"] for r in failures]),
        "round_slowest_median_s": rounds._med(slowest),
        "matchmaking_median_s": rounds._med(
            [r["matchmaking_s"] for r in ok if r.get("matchmaking_s") is not None]
        ),
        "matchmaking_p90_s": _pct(
            [r["matchmaking_s"] for r in ok if r.get("matchmaking_s") is not None], 90
        ),
        "call_start_spread_median_s": rounds._med(spreads),
        "call_end_spread_median_s": rounds._med(end_spreads),
        "phases_median_s": phase_medians(ok),
        # The round once its last caller is there: what is not waiting for a peer.
        "last_caller_median_s": rounds._med([c["seconds"] for c in last_callers]),
        "last_caller_phases_median_s": phase_medians(last_callers),
        "compute_median_s": rounds._med([r["compute_s"] for r in mine]),
        "check_median_s": rounds._med([r["check_s"] for r in ok if "check_s" in r]),
    }


def phase_medians(calls: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median seconds of each phase the result's timings name, over ``calls``; the
    matchmaking search also by role (``.led``, ``.followed``); ``client.handover``: the
    call as the client timed it less the daemon's round (``total``): the hand-over of
    the inputs and the result through shared memory and the control stream."""
    timed = [c for c in calls if c.get("timings")]
    names = sorted({name for c in timed for name in c["timings"]})
    out = {
        name: rounds._med([c["timings"][name] for c in timed if name in c["timings"]])
        for name in names
    }
    for role, flag in (("led", 1.0), ("followed", 0.0)):
        out[f"matchmaking.search.{role}"] = rounds._med(
            [
                c["timings"]["matchmaking.search"]
                for c in timed
                if c["timings"].get("matchmaking.led") == flag
                and "matchmaking.search" in c["timings"]
            ]
        )
    out["client.handover"] = rounds._med(
        [c["seconds"] - c["timings"]["total"] for c in timed if "total" in c["timings"]]
    )
    return out


def close_summary(lines: list[tuple[str, int, str, float]], codec: str) -> dict[str, Any] | None:
    # The logged key is the run's, the call's and the group bits': "RUN.none-3.0b".
    mine = [line for line in lines if f".{codec}-" in line[0]]
    if not mine:
        return None
    return {
        "by_reason_and_size": {
            f"{reason} {size}": count
            for (reason, size), count in sorted(Counter((m[2], m[1]) for m in mine).items())
        },
        "median_close_after_s": rounds._med([m[3] for m in mine]),
    }


def bench_peers(
    n: int, args: argparse.Namespace, workdir: Path, results: list[dict[str, Any]]
) -> None:
    """Append one record per codec to ``results``."""
    elements = int(args.mb * 1e6) // 4
    codecs = [c for c in args.codecs.split(",") if c]
    rng = np.random.default_rng([args.seed, n])
    staggers = [0.0] + [float(rng.uniform(0.0, args.stagger)) for _ in range(n - 1)]
    swarm = Daemons(n, elements, workdir / f"n{n}", args.daemon_log_level)
    try:
        spec = {
            "elements": elements,
            "seed": args.seed,
            "rounds": args.rounds,
            "compute": args.compute,
            "codecs": codecs,
            "timeout": args.timeout,
            "check_every": args.check_every,
            "ranks_of": swarm.ranks_of,
            "group_size": args.group_size,
        }
        log(f"N={n}: starting workers, staggers {[round(s, 2) for s in staggers]} s")
        started = time.monotonic()
        swarm.start_workers(spec, staggers)
        # Start-up (imports, data) plus one call's compute time, timeout and margin.
        per_line = rounds.READY_TIMEOUT + args.compute + args.timeout + LINE_MARGIN
        records = collect(swarm, per_line, args.rounds * len(codecs))
        wall = time.monotonic() - started
        reference = rounds.gloo(swarm, args.rounds) if args.gloo else None
        back_to_back = rounds.gloo(swarm, args.rounds, barrier=False) if args.gloo else None
        if reference is not None:
            log(f"N={n} gloo: {reference}, back to back: {back_to_back}")
        closes, rejections = swarm.log_lines()
        for codec in codecs:
            record = summarize(n, codec, args.rounds, records, args.group_size)
            record["staggers_s"] = [round(s, 3) for s in staggers]
            record["wall_s"] = round(wall, 1)
            record["gloo"] = reference
            record["median_over_gloo"] = rounds._ratio(
                record["median_s"], (reference or {}).get("median_s")
            )
            record["gloo_back_to_back"] = back_to_back
            record["median_over_gloo_back_to_back"] = rounds._ratio(
                record["median_s"], (back_to_back or {}).get("median_s")
            )
            record["daemon_closes"] = close_summary(closes, codec)
            record["daemon_rejections"] = dict(rejections.most_common()) or None  # all codecs
            record["daemon_warning_lines"] = swarm.daemon_warnings()
            log(
                f"N={n} {codec}: one group of {n} in {record['one_group_rounds']} of "
                f"{args.rounds} rounds, balanced {record['balanced_rounds']}, "
                f"shapes {record['round_shapes']}, "
                f"NoGroupError {record['no_group_errors']}, other {record['other_errors']}, "
                f"median {record['median_s']} s"
            )
            results.append(record)
    finally:
        swarm.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="2,4,8,16")
    parser.add_argument("--rounds", type=int, default=20, help="calls per worker per codec")
    parser.add_argument("--mb", type=float, default=16.0, help="MB (1e6 bytes) of float32")
    parser.add_argument("--codecs", default="none", help="e.g. none,float16,uint8-blockwise")
    parser.add_argument(
        "--compute", type=float, default=2.0, help="most seconds of compute before each call"
    )
    parser.add_argument(
        "--stagger", type=float, default=3.0, help="most seconds between two workers' starts"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="average timeout")
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="the calls' group_size (default: not given); below the peer count, a round is "
        "counted balanced when every call is in one of ceil(N / group_size) groups whose "
        "sizes differ by at most one",
    )
    parser.add_argument("--gloo", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument(
        "--check-every",
        type=int,
        default=1,
        help="check every K-th round's result (and the last); the check of 64 MB (its sha256 "
        "and error) takes 0.4-2 s, which with --compute 0 acts as compute between calls",
    )
    parser.add_argument("--daemon-log-level", default="WARNING")
    parser.add_argument(
        "--log-dir", default=None, help="keep the daemons' logs here (default: discarded)"
    )
    parser.add_argument("--worker", default=None, metavar="SPEC", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _package_folder() -> str:
    """Where this interpreter (and so every daemon and worker) imports swarmavg from: an A/B
    run of committed against working-tree code puts one on ``PYTHONPATH``."""
    import swarmavg.averaging

    return str(Path(swarmavg.averaging.__file__).resolve().parent.parent)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        try:
            return worker_main(json.loads(args.worker))
        except KeyboardInterrupt:
            return 130
    signal.signal(signal.SIGTERM, rounds._raise_interrupt)  # cleanup as on ^C
    figures: dict[str, Any] = {
        "benchmark": "unsync-rounds",
        "argv": sys.argv[1:] if argv is None else argv,
        "path": "swarmavg peer daemons (CLI) + one client process each, loopback, default "
        "configuration; workers start apart and compute between calls",
        "mb": args.mb,
        "rounds": args.rounds,
        "compute": args.compute,
        "stagger": args.stagger,
        "seed": args.seed,
        "timeout": args.timeout,
        "swarmavg_from": _package_folder(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "cpu_cores": os.cpu_count(),
        "configs": [],
    }
    status = 0
    # Unix socket paths are capped at 107 bytes: keep the folder short.
    workdir = Path(tempfile.mkdtemp(prefix="unsync-", dir="/tmp"))
    try:
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
