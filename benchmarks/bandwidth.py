"""All-reduce over rate-limited links: what each codec buys when bandwidth is the bottleneck.

Builds the multi-host test bed (``deploy.testbed``: one network namespace per host, every
host's link shaped with tc tbf in both directions), starts one real ``swarmavg peer`` daemon
per host through the CLI, and averages a float32 tensor of ``--mb`` megabytes among all hosts
through the real client, once per round and codec: each host runs its own client process
(the "training process") inside its namespace, talking to its daemon's control socket.
Also measures raw TCP through the same links in the same traffic pattern (every host sends
2/N of the tensor to every other host) as the reference for goodput. Prints ONE JSON line;
progress goes to stderr.

    sudo .venv/bin/python benchmarks/bandwidth.py                       # the docs' figures
    sudo .venv/bin/python benchmarks/bandwidth.py --mb 8 --rounds 1     # a quick look
    sudo .venv/bin/python benchmarks/bandwidth.py --congestion-control default,cubic
        # A/B in one run: one swarm of daemons per variant, rounds interleaved

``--congestion-control``: comma-separated variants, each the daemons'
``--congestion-control`` (``default``: unset, the kernel's choice); raw TCP is measured
with the same algorithm per variant. ``--variant NAME=FLAGS`` (repeatable, instead) gives
each variant's daemons any extra flags, e.g. ``--variant "cubic-1m=--congestion-control
cubic --bandwidth 45"`` (a fixed bandwidth of 45 MB/s makes 1 MiB chunks,
averaging/allreduce/chunking.py). ``--group-size default`` lets the daemons form the
group themselves (``average(group_size=None)``) instead of naming 4.

Needs root, iproute2 and iptables (like the test bed).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from deploy.testbed import Host, HostSpec, TestBed, missing_requirements  # noqa: E402
from deploy.testbed.goodput import all_to_all  # noqa: E402
from swarmavg.peer import connect_async  # noqa: E402
from tests.harness import ProcessPool, SwarmavgProcess  # noqa: E402

DEFAULT_CODECS = "none,float16,uint8-blockwise,uint4-blockwise,topk"
PORT = 31337


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


SAMPLE_STRIDE = 997
"""Workers report every 997th element of their result: enough for error statistics without
shipping 64 MB back; a SHA-256 of the whole result checks that members agree bit for bit."""


def make_input(seed: int, elements: int) -> np.ndarray:
    """Host ``seed``'s tensor: the benchmark and the workers generate the same one."""
    return np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)


# -- the training process of one host (runs inside the host's namespace) -----------------


async def worker_main(control: str, seed: int, elements: int) -> int:
    """Connect to the local daemon, then run one ``average`` per request line on stdin."""
    tensor = make_input(seed, elements)
    loop = asyncio.get_running_loop()
    async with connect_async(control) as client:
        print(json.dumps({"event": "ready"}), flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            request = json.loads(line)
            started = time.monotonic()
            try:
                result = await client.average(
                    [tensor[: request["elements"]]],
                    key=request["key"],
                    group_size=request["group_size"],
                    min_group_size=request["group_size"] or 2,
                    timeout=request["timeout"],
                    codec=request["codec"],
                )
            except Exception as exc:  # reported to the benchmark, which reports it
                failure = {"error": f"{type(exc).__name__}: {exc}", "started_at": started}
                print(json.dumps(failure), flush=True)
                continue
            ended = time.monotonic()
            out = np.ascontiguousarray(result.tensors[0])
            record = {
                "started_at": started,
                "ended_at": ended,
                "partial": result.partial,
                "group_size": result.group_size,
                "timings": result.timings,
                "sha256": hashlib.sha256(out.tobytes()).hexdigest(),
                "sample": out[::SAMPLE_STRIDE].astype(np.float64).tolist(),
            }
            print(json.dumps(record), flush=True)
    return 0


class Worker:
    """A training process in one host, driven line by line."""

    def __init__(self, host: Host, control: str, seed: int, elements: int) -> None:
        args = [sys.executable, __file__, "worker", "--control", control]
        args += ["--seed", str(seed), "--elements", str(elements)]
        self.proc = subprocess.Popen(
            host.command(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if json.loads(self._readline()).get("event") != "ready":
            raise RuntimeError("worker did not start")

    def _readline(self) -> str:
        if self.proc.stdout is None:
            raise RuntimeError("worker stdout is not a pipe")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait(10)}")
        return line

    def request(self, **fields: Any) -> None:
        if self.proc.stdin is None:
            raise RuntimeError("worker stdin is not a pipe")
        self.proc.stdin.write(json.dumps(fields) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(self._readline())
        return record

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# -- the benchmark -------------------------------------------------------------------------


@dataclass
class Round:
    seconds: float  # from the first call's start to the last call's end
    tx_bytes: list[int]  # per host, Ethernet bytes its link carried out during the round
    partial: bool
    bit_identical: bool  # every member got the same bytes
    rel_rms_error: float  # vs the exact mean, on every 997th element
    timings: dict[str, float]  # one member's phase timings as its daemon measured them
    cpu_seconds: float = 0.0  # CPU time of one daemon during the round (mean over hosts)
    start_spread: float = 0.0  # seconds between the first and the last worker's call
    group_sizes: tuple[int, ...] = ()  # each worker's group (a split shows as 2, 2, 2, 2)
    slowest_prepare: float = 0.0  # the longest ``client.prepare`` among the workers


def cpu_seconds(daemon: SwarmavgProcess) -> float:
    """User + system CPU time the daemon process has used so far."""
    fields = Path(f"/proc/{daemon.proc.pid}/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def start_daemons(
    bed: TestBed,
    pool: ProcessPool,
    workdir: Path,
    run_id: str,
    *,
    port: int = PORT,
    extra: Sequence[str] = (),
) -> list[SwarmavgProcess]:
    """One daemon per host on ``HOST_ADDRESS:port``; all join the first."""
    daemons: list[SwarmavgProcess] = []
    for name, host in bed.hosts.items():
        args = ["peer", "--listen", f"{host.address}:{port}", "--run-id", run_id]
        args += ["--control", str(workdir / f"{name}-{run_id}.sock")]
        args += ["--log-level", os.environ.get("BW_LOG_LEVEL", "WARNING")]
        args += extra
        if daemons:
            args += ["--join", daemons[0].address]
        daemons.append(pool.start(args, executable=host.swarmavg_command()))
    return daemons


def one_round(
    bed: TestBed,
    daemons: list[SwarmavgProcess],
    workers: list[Worker],
    expected_sample: np.ndarray | None,
    *,
    key: str,
    codec: str,
    elements: int,
    timeout: float,
    group_size: int | None,
) -> Round:
    """Every host's worker averages at once; raises RuntimeError when any call failed."""
    hosts = list(bed.hosts.values())
    before = [host.link_bytes()[0] for host in hosts]
    cpu_before = [cpu_seconds(d) for d in daemons]
    for worker in workers:
        worker.request(
            key=key, codec=codec, elements=elements, group_size=group_size, timeout=timeout
        )
    records = [worker.result() for worker in workers]
    after = [host.link_bytes()[0] for host in hosts]
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        first = min(r["started_at"] for r in records)
        starts = ", ".join(f"+{r['started_at'] - first:.3f}" for r in records)
        raise RuntimeError("; ".join(errors) + f" (the workers called at {starts} s)")
    error = 0.0
    if expected_sample is not None:
        scale = float(np.sqrt(np.mean(expected_sample**2)))
        error = max(
            float(np.sqrt(np.mean((np.asarray(r["sample"]) - expected_sample) ** 2))) / scale
            for r in records
        )
    return Round(
        seconds=max(r["ended_at"] for r in records) - min(r["started_at"] for r in records),
        tx_bytes=[a - b for a, b in zip(after, before, strict=True)],
        partial=any(r["partial"] for r in records),
        bit_identical=len({r["sha256"] for r in records}) == 1,
        rel_rms_error=error,
        timings={k: float(v) for k, v in records[0]["timings"].items()},
        cpu_seconds=statistics.mean(
            cpu_seconds(d) - c for d, c in zip(daemons, cpu_before, strict=True)
        ),
        group_sizes=tuple(int(r["group_size"]) for r in records),
        start_spread=max(r["started_at"] for r in records) - min(r["started_at"] for r in records),
        slowest_prepare=max(float(r["timings"].get("client.prepare", 0.0)) for r in records),
    )


def raw_tcp(
    bed: TestBed, nbytes: int, repeats: int, congestion_control: str | None = None
) -> dict[str, float]:
    """The butterfly's traffic pattern over plain TCP: each host sends 2*S/N to each other."""
    hosts = list(bed.hosts.values())
    per_pair = 2 * nbytes // len(hosts)
    times = [
        all_to_all(hosts, per_pair, timeout=300, congestion_control=congestion_control).seconds
        for _ in range(repeats)
    ]
    seconds = statistics.median(times)
    egress = per_pair * (len(hosts) - 1)
    return {"seconds": round(seconds, 3), "per_host_egress_mbit_s": egress * 8 / seconds / 1e6}


def summarize(done: list[Round], failed: list[str]) -> dict[str, Any]:
    """One codec's figures over its rounds (median round for the phase timings)."""
    if not done:
        return {"error": "; ".join(failed)}
    chronological = [round(r.seconds, 3) for r in done]
    group_sizes = [list(r.group_sizes) for r in done]
    done = sorted(done, key=lambda r: r.seconds)
    tx = statistics.median(statistics.mean(r.tx_bytes) for r in done)
    return {
        "seconds": round(statistics.median(r.seconds for r in done), 3),
        "rounds_seconds": chronological,
        "group_sizes": group_sizes,  # per round, each member's group size
        "wire_mb_per_host": round(tx / 1e6, 2),
        "daemon_cpu_seconds": round(statistics.median(r.cpu_seconds for r in done), 2),
        "rel_rms_error": float(f"{max(r.rel_rms_error for r in done):.3g}"),
        "partial": any(r.partial for r in done),
        "bit_identical": all(r.bit_identical for r in done),
        # The daemon's phases in the median round (one member's view).
        "timings": {k: round(v, 3) for k, v in sorted(done[len(done) // 2].timings.items())},
        "failed_rounds": failed,
    }


def goodput(
    per_codec: dict[str, Any], raw: dict[str, float], n: int, nbytes: int, rate: float
) -> dict[str, Any]:
    """Goodput of ``none`` against the link and raw TCP; speedups of the other codecs."""
    figures: dict[str, Any] = {}
    base = per_codec.get("none", {})
    if "seconds" not in base:
        return figures
    payload = 2 * (n - 1) * nbytes / n  # bytes each host must send in a butterfly
    figures["goodput_none_fraction"] = round(payload * 8 / base["seconds"] / (rate * 1e6), 3)
    figures["goodput_none_vs_raw_tcp"] = round(raw["seconds"] / base["seconds"], 3)
    exchange = base["timings"].get("allreduce.exchange")
    if exchange:  # the streaming phase alone, without preparing and finishing the parts
        figures["goodput_none_exchange_fraction"] = round(payload * 8 / exchange / (rate * 1e6), 3)
    for entry in per_codec.values():
        if "seconds" in entry:
            entry["speedup"] = round(base["seconds"] / entry["seconds"], 2)
            entry["byte_ratio"] = round(base["wire_mb_per_host"] / entry["wire_mb_per_host"], 2)
    return figures


@dataclass
class Swarm:
    """One variant's daemons (one per host) and training processes."""

    name: str
    daemons: list[SwarmavgProcess]
    workers: list[Worker]


def parse_variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """Variant name -> the extra daemon flags of its swarm."""
    if args.variant:
        variants = {}
        for spec in args.variant:
            name, _, flags = spec.partition("=")
            variants[name] = shlex.split(flags)
        return variants
    return {
        name: [] if name == "default" else ["--congestion-control", name]
        for name in args.congestion_control.split(",")
        if name
    }


def flag_value(flags: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``flags`` (None when absent)."""
    for i, item in enumerate(flags[:-1]):
        if item == flag:
            return flags[i + 1]
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    n, rate, nbytes = args.hosts, args.rate_mbit, int(args.mb * 1e6)
    codecs = [c for c in args.codecs.split(",") if c]
    variants = parse_variants(args)
    group_size = n if args.group_size == "given" else None
    figures: dict[str, Any] = {
        "benchmark": "bandwidth",
        "path": "swarmavg peer daemons (CLI) + one client process per host, "
        "each pair in its own network namespace",
        "hosts": n,
        "rate_mbit": rate,
        "mtu": args.mtu or 1500,
        "tensor_mb": args.mb,
        "rounds": args.rounds,
        "group_size": args.group_size,
        "variant_flags": {name: shlex.join(flags) for name, flags in variants.items()},
        "load_average_at_start": round(os.getloadavg()[0], 1),
        "cpu_cores": os.cpu_count(),
    }
    with (
        tempfile.TemporaryDirectory(prefix="swarmavg-bw-") as tmp,
        TestBed([HostSpec(f"h{i}", rate_mbit=rate, mtu=args.mtu) for i in range(n)]) as bed,
    ):
        workdir = Path(tmp)
        log(f"test bed {bed.prefix}: {n} hosts at {rate} Mbit/s")
        # The kernel's default (variant "default"): with BBR, connections reused from round
        # to round carry a stale minimum-RTT estimate (docs/benchmarks-bandwidth.md).
        first = next(iter(bed.hosts.values()))
        figures["tcp_congestion_control"] = first.run(
            ["sysctl", "-n", "net.ipv4.tcp_congestion_control"], check=False
        ).stdout.strip()
        raws: dict[str, dict[str, float]] = {}
        by_algorithm: dict[str | None, dict[str, float]] = {}
        for variant, flags in variants.items():
            cc = flag_value(flags, "--congestion-control")
            if cc not in by_algorithm:  # variants of one algorithm share the reference
                by_algorithm[cc] = raw_tcp(bed, nbytes, args.raw_repeats, cc)
            raws[variant] = by_algorithm[cc]
            log(f"raw TCP, butterfly pattern, {variant}: {raws[variant]}")
        pool = ProcessPool(workdir)
        swarms: list[Swarm] = []
        try:
            elements = nbytes // 4
            expected = np.zeros(len(range(0, elements, SAMPLE_STRIDE)))
            for seed in range(n):
                expected += make_input(seed, elements)[::SAMPLE_STRIDE] / n
            for k, (variant, flags) in enumerate(variants.items()):
                daemons = start_daemons(
                    bed, pool, workdir, f"bandwidth{k}", port=PORT + 10 * k, extra=flags
                )
                swarm = Swarm(variant, daemons, [])
                swarms.append(swarm)
                for seed, (host, daemon) in enumerate(
                    zip(bed.hosts.values(), daemons, strict=True)
                ):
                    swarm.workers.append(Worker(host, daemon.control, seed, elements))
            results: dict[str, dict[str, Any]] = {swarm.name: {} for swarm in swarms}
            rounds: dict[tuple[str, str], list[Round]] = {}
            for swarm in swarms:
                for codec in codecs:
                    try:
                        # Untimed: connections, lazy imports and first-use costs of the codec.
                        one_round(
                            bed, swarm.daemons, swarm.workers, None, key=f"warm-{codec}-0",
                            codec=codec, elements=1 << 18, timeout=args.timeout,
                            group_size=group_size,
                        )  # fmt: skip
                        rounds[swarm.name, codec] = []
                    except Exception as exc:  # a codec that is missing or fails is reported
                        results[swarm.name][codec] = {"error": f"{type(exc).__name__}: {exc}"}
                        log(f"{swarm.name} {codec}: {exc!r}")
            # Codecs and variants take turns round by round, so that the load of the shared
            # machine drifting during the run weighs on all of them alike.
            failed: dict[tuple[str, str], list[str]] = {key: [] for key in rounds}
            for r in range(args.rounds):
                for codec in codecs:
                    for swarm in swarms:
                        if (swarm.name, codec) not in rounds:
                            continue
                        try:
                            result = one_round(
                                bed, swarm.daemons, swarm.workers, expected,
                                key=f"bw-{codec}-{r + 1}", codec=codec, elements=elements,
                                timeout=args.timeout, group_size=group_size,
                            )  # fmt: skip
                        except Exception as exc:  # reported with the figures, never hidden
                            failed[swarm.name, codec].append(f"{type(exc).__name__}: {exc}")
                            log(f"{swarm.name} {codec} round {r} failed: {exc!r}")
                            continue
                        log(f"{swarm.name} {codec} round {r}: {result}")
                        rounds[swarm.name, codec].append(result)
            for (name, codec), done in rounds.items():
                results[name][codec] = summarize(done, failed[name, codec])
        finally:
            for swarm in swarms:
                for worker in swarm.workers:
                    worker.close()
            handles = list(pool.processes)
            pool.close()
            for handle in handles:  # tests/harness.py leaves the stdout pipes open
                if handle.proc.stdout is not None:
                    handle.proc.stdout.close()
    figures["load_average_at_end"] = round(os.getloadavg()[0], 1)
    if list(variants) == ["default"]:  # the single-variant layout of earlier runs
        figures["raw_tcp"] = raws["default"]
        figures["codecs"] = results["default"]
        figures.update(goodput(results["default"], raws["default"], n, nbytes, rate))
        return figures
    figures["variants"] = {
        name: {
            "raw_tcp": raws[name],
            "codecs": per_codec,
            **goodput(per_codec, raws[name], n, nbytes, rate),
        }
        for name, per_codec in results.items()
    }
    return figures


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker = argparse.ArgumentParser(prog="bandwidth.py worker")
        worker.add_argument("--control", required=True)
        worker.add_argument("--seed", type=int, required=True)
        worker.add_argument("--elements", type=int, required=True)
        wargs = worker.parse_args(sys.argv[2:])
        return asyncio.run(worker_main(wargs.control, wargs.seed, wargs.elements))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument(
        "--mtu",
        type=int,
        default=None,
        help="every link's MTU (default: the kernel's 1500, as on the internet; 9000 shows "
        "what jumbo frames would carry, docs/benchmarks-bandwidth.md)",
    )
    parser.add_argument("--mb", type=float, default=64.0, help="tensor size per host, MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codecs", default=DEFAULT_CODECS)
    parser.add_argument("--timeout", type=float, default=180.0, help="per average() call")
    parser.add_argument("--raw-repeats", type=int, default=2)
    parser.add_argument(
        "--congestion-control",
        default="default",
        help="comma-separated variants: the daemons' --congestion-control, or 'default'",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=FLAGS: a swarm whose daemons get FLAGS; repeatable (overrides "
        "--congestion-control)",
    )
    parser.add_argument(
        "--group-size",
        choices=("given", "default"),
        default="given",
        help="name the group size in average() (given) or let the daemons form it (default)",
    )
    args = parser.parse_args()
    reason = missing_requirements()
    if reason is not None:
        print(json.dumps({"benchmark": "bandwidth", "skipped": reason}))
        return 1
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
