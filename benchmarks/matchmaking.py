"""Matchmaking and fault-tolerance figures, one process per peer; prints ONE JSON line.

    python -m benchmarks.matchmaking [--peers 8] [--rounds 7] [--elements 4194304] [--timeout 15]
                                     [--state-elements 16777216]

1. Matchmaking time: every peer calls ``Averager.average`` at the same wall-clock moment
   (tiny tensors, ``group_size = min_group_size = peers``); per round the time until the
   last peer had its group, and the median over peers; medians over ``--rounds`` rounds.
2. Faults: one member is SIGKILLed during matchmaking (by the coordinator, while the
   leader still waits for more peers), during sending and during reducing (the victim
   kills itself a fraction of a baseline all-reduce after its group formed). Every
   survivor must return within ``timeout + 2 s``, every element of its result must be
   the exact mean of the surviving contributions, or of all contributions (chunks the
   victim delivered before dying), or its own value (the part whose reducer died). The
   figures: the worst return time relative to the timeout, and the element categories.
3. State sharing: a late joiner loads a 64 MiB state (8 float32 tensors) from one donor,
   another from three donors holding the same version (chunks served by each), and then
   reloads after one tensor changed (chunks fetched).

Each peer is a real process with a DHT node, an Averager and one gRPC server, wired like
the daemon (``--worker`` mode of this script), driven by JSON lines on stdin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

# ------------------------------------------------------------------------------ worker


async def worker(join: list[str], fault: str | None) -> None:
    import grpc

    from swarmavg.averaging import Averager, AveragerConfig
    from swarmavg.averaging.allreduce.faults import Fault, FaultPlan
    from swarmavg.averaging.matchmaking.matchmaker import MatchmakingEvent
    from swarmavg.dht import ChannelPool, DHTConfig, DHTNode

    loop = asyncio.get_running_loop()
    kill_after: dict[str, float | None] = {"delay": None}

    def observe(event: MatchmakingEvent, key: str, other: bytes) -> None:
        delay = kill_after["delay"]
        if event is MatchmakingEvent.GROUP_FORMED and delay is not None:
            loop.call_later(delay, os.kill, os.getpid(), signal.SIGKILL)

    channels = ChannelPool()
    node = DHTNode(DHTConfig(run_id="bench", initial_peers=join), channels=channels)
    server = grpc.aio.server()
    node.add_to_server(server)
    plan = None
    if fault is not None:
        name, _, after = fault.partition(":")
        plan = FaultPlan(Fault(name), int(after or 0))
    averager = Averager(
        node,
        AveragerConfig(matchmaking_time=2.0, target_group_size=8),
        channels,
        observer=observe,
        fault_plan=plan,
    )
    averager.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await node.start(f"127.0.0.1:{port}")
    await averager.start()
    print(json.dumps({"event": "ready", "address": f"127.0.0.1:{port}"}), flush=True)
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] in ("publish", "load", "counters"):
                print(json.dumps(await state_op(averager, cmd)), flush=True)
                continue
            kill_after["delay"] = cmd.get("kill_after_formed")
            tensors = [np.full(cmd["elements"], cmd["value"], np.float32)]
            await asyncio.sleep(max(0.0, cmd["start_at"] - time.time()))
            started = time.time()
            try:
                res = await averager.average(
                    tensors,
                    cmd["key"],
                    group_size=cmd["group_size"],
                    min_group_size=cmd["min_group_size"],
                    timeout=cmd["timeout"],
                )
                values, counts = np.unique(res.tensors[0], return_counts=True)
                out: dict[str, Any] = {
                    "ok": True,
                    "elapsed": time.time() - started,
                    "matchmaking": res.timings["matchmaking"],
                    "allreduce": res.timings["allreduce"],
                    "group_size": res.group_size,
                    "partial": res.partial,
                    # a correct result holds at most 3 distinct values; 64 shows what went wrong
                    "values": [
                        [float(v), int(c)] for v, c in zip(values[:64], counts[:64], strict=True)
                    ],
                }
            except Exception as error:  # reported to the coordinator, which judges it
                out = {"ok": False, "elapsed": time.time() - started, "error": repr(error)}
            print(json.dumps(out), flush=True)
    finally:
        await server.stop(None)
        await averager.shutdown(grace=0.0)
        await node.shutdown()
        await channels.close()


STATE_TENSORS = 8


def state_tensors(elements: int, changed: int | None) -> list[np.ndarray]:
    """The published state: ``STATE_TENSORS`` random float32 tensors (random, so that no
    two chunks share content and content addressing cannot deduplicate them); tensor
    ``changed`` differs from the first version."""
    size = elements // STATE_TENSORS
    return [
        np.random.default_rng(t + (1000 if t == changed else 0)).standard_normal(
            size, dtype=np.float32
        )
        for t in range(STATE_TENSORS)
    ]


async def state_op(averager: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    sharer = averager.state_sharer
    if cmd["op"] == "publish":
        tensors = state_tensors(cmd["elements"], cmd.get("changed"))
        await averager.publish_state(tensors, b"meta", version=cmd["version"])
        return {"ok": True}
    if cmd["op"] == "counters":
        return {"served": sharer.served_chunks, "downloaded": sharer.downloaded_chunks}
    before = sharer.downloaded_chunks
    started = time.time()
    try:
        _, tensors = await averager.load_state(timeout=cmd["timeout"])
    except Exception as error:
        return {"ok": False, "error": repr(error)}
    elapsed = time.time() - started
    expected = state_tensors(cmd["elements"], cmd.get("changed"))
    return {
        "ok": all(np.array_equal(a, b) for a, b in zip(tensors, expected, strict=True)),
        "elapsed": elapsed,
        "chunks": sharer.downloaded_chunks - before,
    }


def state_figures(workers: list[Worker], elements: int) -> dict[str, Any]:
    """Late joiners loading a 4-byte x ``elements`` state: from 1 donor, from 3, and again
    after one of its 8 tensors changed (incremental). Each load is by a fresh joiner (one
    that holds no chunk yet), two per case."""
    donors, joiners = workers[1:4], [workers[5], workers[7], workers[4], workers[6]]

    def ask(w: Worker, **cmd: Any) -> dict[str, Any]:
        w.send(**cmd)
        return w.next(120.0)

    ask(donors[0], op="publish", elements=elements, version=1.0)
    one = [ask(j, op="load", elements=elements, timeout=60.0) for j in joiners[:2]]
    for d in donors[1:]:
        ask(d, op="publish", elements=elements, version=1.0)  # same content: same root
    before = [ask(d, op="counters")["served"] for d in donors]
    three = [ask(j, op="load", elements=elements, timeout=60.0) for j in joiners[2:]]
    after = [ask(d, op="counters")["served"] for d in donors]
    for d in donors:
        ask(d, op="publish", elements=elements, version=2.0, changed=3)
    again = ask(joiners[-1], op="load", elements=elements, timeout=60.0, changed=3)
    loads = [*one, *three, again]
    return {
        "state_bytes": 4 * (elements // STATE_TENSORS) * STATE_TENSORS,
        "load_one_donor_s": [round(x["elapsed"], 3) for x in one],
        "load_three_donors_s": [round(x["elapsed"], 3) for x in three],
        "three_donors_chunks_served": [a - b for a, b in zip(after, before, strict=True)],
        "chunks_per_load": three[0]["chunks"],
        "reload_after_one_of_8_tensors_changed_chunks": again["chunks"],
        "reload_s": round(again["elapsed"], 3),
        "verified": all(x["ok"] for x in loads),
    }


# ------------------------------------------------------------------------------ coordinator


class Worker:
    def __init__(self, join: list[str], log_dir: Path, name: str, fault: str | None = None) -> None:
        self.log_path = log_dir / f"{name}.log"
        extra = [f"--fault={fault}"] if fault else []
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", *(f"--join={j}" for j in join), *extra],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
            )
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        ready = self.next(60.0)
        self.address = str(ready["address"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            return dict(json.loads(self.lines.get(timeout=timeout)))
        except queue.Empty:
            raise RuntimeError(f"no answer from worker; log: {self.log_path}") from None

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.send(op="quit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.reader.join(5)


def run_round(
    workers: list[Worker],
    key: str,
    elements: int,
    group_size: int,
    min_group_size: int,
    timeout: float,
    victim: int | None = None,
    kill_after_formed: float | None = None,
    kill_at: float | None = None,
) -> dict[int, dict[str, Any]]:
    start_at = time.time() + 1.0
    for i, w in enumerate(workers):
        w.send(
            op="average",
            key=key,
            elements=elements,
            value=float(i + 1),
            start_at=start_at,
            group_size=group_size,
            min_group_size=min_group_size,
            timeout=timeout,
            kill_after_formed=kill_after_formed if i == victim else None,
        )
    if kill_at is not None and victim is not None:
        time.sleep(max(0.0, start_at + kill_at - time.time()))
        workers[victim].kill()
    results = {}
    for i, w in enumerate(workers):
        if i == victim:
            continue
        results[i] = w.next(timeout + 30.0)
    if victim is not None:
        workers[victim].kill()  # in case it outlived its planned death; reaps it
    return results


def judge(
    results: dict[int, dict[str, Any]], victim: int, n: int, timeout: float, elements: int
) -> dict[str, Any]:
    survivors = [i for i in range(n) if i != victim]
    surviving_mean = float(np.float32(sum(i + 1 for i in survivors)) / np.float32(len(survivors)))
    all_mean = float(np.float32(sum(range(1, n + 1))) / np.float32(n))
    counts = {"surviving_mean": 0, "all_mean": 0, "own_value": 0, "other": 0}
    worst = -float("inf")
    failures = []
    for i, r in results.items():
        worst = max(worst, r["elapsed"] - timeout)
        if not r["ok"]:
            failures.append(r["error"])
            continue
        for value, count in r["values"]:
            if np.isclose(value, surviving_mean, rtol=1e-6, atol=0):
                counts["surviving_mean"] += count
            elif np.isclose(value, all_mean, rtol=1e-6, atol=0):
                counts["all_mean"] += count
            elif value == float(i + 1):
                counts["own_value"] += count
            else:
                counts["other"] += count
        counts["other"] += elements - sum(c for _, c in r["values"])  # beyond the 64 reported
    ok = [r for r in results.values() if r["ok"]]
    return {
        "survivors_ok": len(ok),
        "survivors": len(survivors),
        "worst_return_minus_timeout_s": round(worst, 3),
        "within_timeout_plus_2s": worst <= 2.0,
        "partial": sum(bool(r["partial"]) for r in ok),
        "group_sizes": sorted({r["group_size"] for r in ok}),
        "elements": counts,
        "exact": counts["other"] == 0 and len(ok) == len(survivors),
        "errors": failures[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--join", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--fault", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--elements", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--timeout", type=float, default=15.0)
    parser.add_argument("--state-elements", type=int, default=16 * 1024 * 1024)
    args = parser.parse_args()
    if args.worker:
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
        asyncio.run(worker(args.join, args.fault))
        return

    n, timeout = args.peers, args.timeout
    victim = n // 2
    log_dir = Path(tempfile.mkdtemp(prefix="swarmavg-bench-mm-"))
    workers: list[Worker] = []
    try:
        workers.append(Worker([], log_dir, "w0"))
        for i in range(1, n):
            workers.append(Worker([workers[0].address], log_dir, f"w{i}"))

        last, median = [], []
        for r in range(args.rounds):
            res = run_round(workers, f"mm-{r}", 1024, n, n, 30.0)
            times = [x["matchmaking"] for x in res.values() if x["ok"]]
            if len(times) != n:
                raise RuntimeError(f"matchmaking round {r} failed: {res}")
            last.append(max(times))
            median.append(statistics.median(times))

        base = run_round(workers, "baseline", args.elements, n, n, timeout)
        allreduce = statistics.median(x["allreduce"] for x in base.values() if x["ok"])

        faults: dict[str, Any] = {}
        plans = {
            # group_size n + 1 is never reached: the leader waits its 2 s window, and the
            # coordinator kills the victim 1 s after the common start, inside that window.
            "matchmaking": {"group_size": n + 1, "min_group_size": n - 1, "kill_at": 1.0},
            # The victim stalls after its first chunk (sent, resp. returned as reducer) and
            # SIGKILLs itself a fraction of a baseline round after its group formed, so the
            # kill lands inside the phase whatever the machine's speed.
            "sending": {
                "group_size": n,
                "min_group_size": 2,
                "after": 0.3 * allreduce,
                "fault": "stop-sending:1",
            },
            "reducing": {
                "group_size": n,
                "min_group_size": 2,
                "after": 0.3 * allreduce,
                "fault": "stop-reducing:1",
            },
        }
        for phase, plan in plans.items():
            if plan.get("fault"):
                workers[victim].close()
                workers[victim] = Worker(
                    [workers[0].address], log_dir, f"w{victim}-{phase}", plan["fault"]
                )
            res = run_round(
                workers,
                f"fault-{phase}",
                args.elements,
                plan["group_size"],
                plan["min_group_size"],
                timeout,
                victim=victim,
                kill_after_formed=plan.get("after"),
                kill_at=plan.get("kill_at"),
            )
            faults[phase] = judge(res, victim, n, timeout, args.elements)
            workers[victim].close()
            workers[victim] = Worker([workers[0].address], log_dir, f"w{victim}-after-{phase}")

        state = state_figures(workers, args.state_elements)

        print(
            json.dumps(
                {
                    "benchmark": "matchmaking",
                    "peers": n,
                    "processes": "one per peer",
                    "matchmaking_rounds": args.rounds,
                    "matchmaking_last_peer_median_s": round(statistics.median(last), 3),
                    "matchmaking_per_peer_median_s": round(statistics.median(median), 3),
                    "matchmaking_last_peer_max_s": round(max(last), 3),
                    "fault_elements_float32": args.elements,
                    "fault_timeout_s": timeout,
                    "baseline_allreduce_median_s": round(allreduce, 3),
                    "faults": faults,
                    "state_sharing": state,
                }
            )
        )
    finally:
        for w in workers:
            w.close()


if __name__ == "__main__":
    main()
