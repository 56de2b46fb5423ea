"""All-reduce over rate-limited links: what each codec buys when bandwidth is the bottleneck.

Builds the multi-host test bed (``deploy.testbed``: one network namespace per host, every
host's link shaped with tc tbf in both directions), starts one real ``swarmavg peer`` daemon
per host through the CLI, and averages a float32 tensor of ``--mb`` megabytes among all hosts
through the real client, once per round and codec: each host runs its own client process
(the "training process") inside its namespace, talking to its daemon's control socket.
Also measures raw TCP through the same links in the same traffic pattern (every host sends
2/N of the tensor to every other host) as the reference for goodput. Prints ONE JSON line;
progress goes to stderr.

    sudo .venv/bin/python -m benchmarks.bandwidth                       # the docs' figures
    sudo .venv/bin/python -m benchmarks.bandwidth --mb 8 --rounds 1     # a quick look
    sudo .venv/bin/python -m benchmarks.bandwidth --rtt-ms 100 --jitter-ms 5 --loss 0.001
        # long links: every host's link delays a quarter of the RTT each way (deploy/testbed/wan.py)
    sudo .venv/bin/python -m benchmarks.bandwidth --congestion-control default,cubic
        # A/B in one run: one swarm of daemons per variant, rounds interleaved
    sudo .venv/bin/python -m benchmarks.bandwidth --mb 16 --codecs none --rtt-ms 50 --gloo
        # torch gloo's all_reduce of the same elements on the same hosts, round by round

``--gloo``: one torch gloo rank per host, in the host's namespace (benchmarks/testbed_gloo.py),
all in one process group for the whole run. After the codecs' warm-ups, gloo does one
untimed round; then every round of the codecs and variants is followed by one gloo round
(a barrier, then ``all_reduce`` of ``--mb`` MB of float32; the slowest rank's time), so
both meet the same links and the same drifting load. Its connections idle while our rounds
run, as a trainer's do through its compute. Figures: ``gloo.seconds`` (median),
``gloo.rounds_seconds``, ``gloo.goodput_fraction``, ``gloo.sum_ok`` (every rank's sum
checked against the exact one) and ``none_vs_gloo`` (our median ``none`` round over gloo's).

``--congestion-control``: comma-separated variants, each the daemons'
``--congestion-control`` (``default``: unset, the kernel's choice); raw TCP is measured
with the same algorithm per variant. ``--variant NAME=FLAGS`` (repeatable, instead) gives
each variant's daemons any extra flags, e.g. ``--variant "cubic-1m=--congestion-control
cubic --bandwidth 45"`` (a fixed bandwidth of 45 MB/s makes 1 MiB chunks,
averaging/allreduce/chunking.py). ``--group-size default`` lets the daemons form the
group themselves (``average(group_size=None)``) instead of naming 4.

``--unsync`` (one swarm under real timing): the mode above drives every host's
client round by round from here, so every host calls at one shared instant. With
``--unsync`` each host's client runs its own loop instead, the way training processes do:
host i starts a seeded random offset within ``--start-spread`` seconds (default 2, inside
the daemons' 5 s matchmaking window), then for each codec and round sleeps a seeded random
``[0, --compute]`` seconds (default 0) and calls ``average(..., key=f"{codec}-{r}")`` in the
default configuration (no group size). The benchmark only collects each call's record
(group size, group id, partial, error, duration, the result's check) and summarises per
codec as benchmarks/unsync_rounds.py does (one_group_rounds, round_shapes, group_sizes,
no_group_errors, partial, median_s, p90_s, ...), with the link-bound time of the bytes each
host's link carried per round. ``--daemon-log-level DEBUG`` adds the daemons' group closes
by reason and size; ``--log-dir`` keeps the daemons' logs.

    sudo .venv/bin/python -m benchmarks.bandwidth --unsync --hosts 4 --mb 64 \
        --codecs none,float16,uint8-blockwise --rounds 10 --compute 2

Needs root, iproute2 and iptables (like the test bed).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import queue
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deploy.testbed import Host, TestBed, missing_requirements
from deploy.testbed.goodput import all_to_all
from deploy.testbed.tcpstats import counter_delta, read_counters
from deploy.testbed.wan import add_link_arguments, link_figures, uniform_hosts
from swarmavg.peer import connect_async

from . import testbed_gloo, unsync_rounds
from .common import Daemon, DaemonPool, module_command, worker_env
from .common import cpu_seconds as common_cpu_seconds

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
            if request.get("op") == "unsync":
                await unsync_loop(client, tensor, request)
                continue
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


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


async def unsync_loop(client: Any, tensor: np.ndarray, spec: dict[str, Any]) -> None:
    """``--unsync``: this host's training loop on its own clock, one record per call.

    Sleeps its start offset, then for each codec and round a seeded random compute pause
    and one ``average`` in the default configuration (no group size); ends with ``done``.
    """
    from swarmavg.peer import NoGroupError

    rng = np.random.default_rng([spec["seed"], spec["rank"]])
    await asyncio.sleep(spec["offset"])
    for codec in spec["codecs"]:
        for r in range(spec["rounds"]):
            compute = float(rng.uniform(0.0, spec["compute"])) if spec["compute"] > 0 else 0.0
            await asyncio.sleep(compute)
            record: dict[str, Any] = {
                "rank": spec["rank"],
                "codec": codec,
                "round": r,
                "compute_s": compute,
                "wall_start": time.time(),
            }
            started = time.perf_counter()
            try:
                result = await client.average(
                    [tensor], key=f"{codec}-{r}", timeout=spec["timeout"], codec=codec
                )
            except Exception as exc:  # every failure is a figure, reported to the benchmark
                kind = "NoGroupError" if isinstance(exc, NoGroupError) else type(exc).__name__
                record.update(
                    seconds=time.perf_counter() - started, error=kind, message=str(exc)[:500]
                )
                _emit(record)
                continue
            record["seconds"] = time.perf_counter() - started
            record["wall_end"] = time.time()
            out = np.ascontiguousarray(result.tensors[0])
            record.update(
                group_size=result.group_size,
                group_id=result.group_id,
                peers=list(result.peers),
                partial=result.partial,
                codec_used=result.codec,
                matchmaking_s=result.timings.get("matchmaking"),
                timings=result.timings,
                sha256=hashlib.sha256(out.tobytes()).hexdigest(),
                sample=out[::SAMPLE_STRIDE].astype(np.float64).tolist(),
            )
            del result, out  # free it before the next round allocates one
            _emit(record)
    _emit({"done": True})


class Worker:
    """A training process in one host, driven line by line."""

    def __init__(self, host: Host, control: str, seed: int, elements: int) -> None:
        self._reader: threading.Thread | None = None
        args = [*module_command("benchmarks.bandwidth"), "worker", "--control", control]
        args += ["--seed", str(seed), "--elements", str(elements)]
        self.proc = subprocess.Popen(
            host.command(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=worker_env(),
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

    def start_reader(self, lines: queue.Queue[tuple[int, str | None]], index: int) -> None:
        """From now on a thread puts ``(index, line)`` for each stdout line on ``lines``,
        then ``(index, None)`` at EOF (``--unsync``: the worker writes on its own clock)."""
        stdout = self.proc.stdout
        if stdout is None:
            raise RuntimeError("worker stdout is not a pipe")

        def read() -> None:
            for line in stdout:
                lines.put((index, line))
            lines.put((index, None))

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def close(self) -> None:
        reader = self._reader
        if reader is not None:  # EOF on stdin ends the worker, then its reader
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            reader.join(10)
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
    tcp: dict[str, int] | None = None  # the hosts' TCP counters over the round, summed


def cpu_seconds(daemon: Daemon) -> float:
    """User + system CPU time the daemon process has used so far."""
    return common_cpu_seconds([daemon.pid])


def start_daemons(
    bed: TestBed,
    pool: DaemonPool,
    workdir: Path,
    run_id: str,
    *,
    port: int = PORT,
    extra: Sequence[str] = (),
    log_level: str | None = None,
) -> list[Daemon]:
    """One daemon per host on ``HOST_ADDRESS:port``; all join the first."""
    daemons: list[Daemon] = []
    for name, host in bed.hosts.items():
        args = ["peer", "--listen", f"{host.address}:{port}", "--run-id", run_id]
        args += ["--control", str(workdir / f"{name}-{run_id}.sock")]
        args += ["--log-level", log_level or os.environ.get("BW_LOG_LEVEL", "WARNING")]
        args += extra
        if daemons:
            args += ["--join", daemons[0].address]
        daemons.append(pool.start(args, executable=host.swarmavg_command()))
    return daemons


def one_round(
    bed: TestBed,
    daemons: list[Daemon],
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
    tcp_before = [read_counters(host) for host in hosts]
    cpu_before = [cpu_seconds(d) for d in daemons]
    for worker in workers:
        worker.request(
            key=key, codec=codec, elements=elements, group_size=group_size, timeout=timeout
        )
    records = [worker.result() for worker in workers]
    after = [host.link_bytes()[0] for host in hosts]
    tcp: dict[str, int] = {}
    for host, old in zip(hosts, tcp_before, strict=True):
        for name, value in counter_delta(read_counters(host), old).items():
            tcp[name] = tcp.get(name, 0) + value
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
        tcp=tcp,
    )


def tcp_summary(done: Sequence[Round]) -> dict[str, float]:
    """What TCP did to carry these rounds, all hosts together (deploy/testbed/tcpstats.py):
    the share of segments sent that were retransmissions, and per round the tail loss
    probes and retransmission timeouts (each of which holds a chunk back a round trip or
    more while its reducer waits for it), and CUBIC's slow starts that HyStart ended
    early."""
    totals: dict[str, int] = {}
    for r in done:
        for name, value in (r.tcp or {}).items():
            totals[name] = totals.get(name, 0) + value
    if not totals.get("OutSegs"):
        return {}
    return {
        "retransmitted_fraction": round(totals.get("RetransSegs", 0) / totals["OutSegs"], 4),
        "loss_probes_per_round": round(totals.get("TCPLossProbes", 0) / len(done), 1),
        "timeouts_per_round": round(totals.get("TCPTimeouts", 0) / len(done), 1),
        "fast_retransmits_per_round": round(totals.get("TCPFastRetrans", 0) / len(done), 1),
        "hystart_exits_per_round": round(
            (totals.get("TCPHystartTrainDetect", 0) + totals.get("TCPHystartDelayDetect", 0))
            / len(done),
            1,
        ),
    }


def raw_tcp(
    bed: TestBed, nbytes: int, repeats: int, congestion_control: str | None = None
) -> dict[str, float]:
    """The butterfly's traffic pattern over plain TCP: each host sends 2*S/N to each other."""
    hosts = list(bed.hosts.values())
    per_pair = 2 * nbytes // len(hosts)
    tcp_before = [read_counters(host) for host in hosts]
    times = [
        all_to_all(hosts, per_pair, timeout=300, congestion_control=congestion_control).seconds
        for _ in range(repeats)
    ]
    sent = retransmitted = 0
    for host, old in zip(hosts, tcp_before, strict=True):
        delta = counter_delta(read_counters(host), old)
        sent += delta.get("OutSegs", 0)
        retransmitted += delta.get("RetransSegs", 0)
    seconds = statistics.median(times)
    egress = per_pair * (len(hosts) - 1)
    return {
        "seconds": round(seconds, 3),
        "per_host_egress_mbit_s": egress * 8 / seconds / 1e6,
        "retransmitted_fraction": round(retransmitted / sent, 4) if sent else 0.0,
    }


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
        "tcp": tcp_summary(done),
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
    daemons: list[Daemon]
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
        **link_figures(args),
        "tensor_mb": args.mb,
        "rounds": args.rounds,
        "group_size": args.group_size,
        "variant_flags": {name: shlex.join(flags) for name, flags in variants.items()},
        "load_average_at_start": round(os.getloadavg()[0], 1),
        "cpu_cores": os.cpu_count(),
    }
    with (
        tempfile.TemporaryDirectory(prefix="swarmavg-bw-") as tmp,
        TestBed(uniform_hosts(n, args, rate_mbit=rate, mtu=args.mtu)) as bed,
    ):
        workdir = Path(tmp)
        log(f"test bed {bed.prefix}: {n} hosts at {rate} Mbit/s")
        # The kernel's default (variant "default"): with BBR, connections reused from round
        # to round carry a stale minimum-RTT estimate (docs/benchmarks-testbed.md).
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
        pool = DaemonPool(workdir)
        swarms: list[Swarm] = []
        gloo: testbed_gloo.GlooRanks | None = None
        gloo_rounds: list[testbed_gloo.GlooRound] = []
        gloo_failed: list[str] = []
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
            if args.gloo:
                try:
                    gloo = testbed_gloo.GlooRanks(
                        list(bed.hosts.values()), elements, workdir, args.timeout
                    )
                    gloo.round()  # untimed: gloo's connections and first-use costs
                except Exception as exc:  # reported with the figures, never hidden
                    gloo_failed.append(f"{type(exc).__name__}: {exc}")
                    log(f"gloo: {exc!r}")
                    gloo = None
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
                if gloo is not None:
                    try:
                        gloo_rounds.append(gloo.round())
                        log(f"gloo round {r}: {gloo_rounds[-1]}")
                    except Exception as exc:  # a rank that failed leaves the group broken
                        gloo_failed.append(f"{type(exc).__name__}: {exc}")
                        log(f"gloo round {r} failed: {exc!r}")
                        gloo.close()
                        gloo = None
            for (name, codec), done in rounds.items():
                results[name][codec] = summarize(done, failed[name, codec])
        finally:
            if gloo is not None:
                gloo.close()
            for swarm in swarms:
                for worker in swarm.workers:
                    worker.close()
            pool.close()
    figures["load_average_at_end"] = round(os.getloadavg()[0], 1)
    reference: dict[str, Any] | None = None
    if args.gloo:
        payload = 2 * (n - 1) * nbytes / n  # a ring moves what a butterfly moves
        link_bound = payload * 8 / (rate * 1e6)
        reference = testbed_gloo.summarize(gloo_rounds, gloo_failed, link_bound)
        figures["gloo"] = reference
    if list(variants) == ["default"]:  # the single-variant layout of earlier runs
        figures["raw_tcp"] = raws["default"]
        figures["codecs"] = results["default"]
        figures.update(goodput(results["default"], raws["default"], n, nbytes, rate))
        figures.update(over_gloo(results["default"], reference))
        return figures
    figures["variants"] = {
        name: {
            "raw_tcp": raws[name],
            "codecs": per_codec,
            **goodput(per_codec, raws[name], n, nbytes, rate),
            **over_gloo(per_codec, reference),
        }
        for name, per_codec in results.items()
    }
    return figures


def over_gloo(per_codec: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """``none_vs_gloo``: our median ``none`` round over gloo's median, when both ran."""
    ours = per_codec.get("none", {}).get("seconds")
    theirs = (reference or {}).get("seconds")
    if not ours or not theirs:
        return {}
    return {"none_vs_gloo": round(ours / theirs, 3)}


# -- --unsync: every host's training process on its own clock ----------------------------


def check_sample(sample: np.ndarray, members: list[np.ndarray]) -> dict[str, float]:
    """A result's every-997th elements against the exact mean of its members' inputs:
    max |error| and |mean error| (the bias) relative to max |mean| (rounds.py's measures,
    so its tolerances apply), and the RMS error relative to the mean's RMS (this
    benchmark's own ``rel_rms_error``)."""
    expected = np.mean(members, axis=0)
    diff = sample - expected
    scale = max(float(np.abs(expected).max()), 1e-30)
    return {
        "rel_error": float(np.abs(diff).max()) / scale,
        "rel_bias": abs(float(diff.mean())) / scale,
        "rel_rms_error": float(np.sqrt(np.mean(diff**2)) / np.sqrt(np.mean(expected**2))),
    }


def daemon_logs(daemons: Sequence[Daemon]) -> tuple[list[Any], Any, int]:
    """The daemons' DEBUG ``closing`` lines, the reasons leaders gave for refusing a
    follower, and their WARNING/ERROR line count (unsync_rounds.py's patterns)."""
    from collections import Counter

    closes = []
    rejections: Counter[str] = Counter()
    warnings = 0
    for daemon in daemons:
        text = daemon.stderr_path.read_text(errors="replace")
        for m in unsync_rounds.CLOSE_LINE.finditer(text):
            closes.append((m[1], int(m[2]), m[3], float(m[4])))
        rejections.update(m[1].strip() for m in unsync_rounds.REJECT_LINE.finditer(text))
        warnings += sum(" WARNING " in line or " ERROR " in line for line in text.splitlines())
    return closes, rejections, warnings


def unsync_swarm(
    bed: TestBed,
    daemons: list[Daemon],
    workers: list[Worker],
    samples: list[np.ndarray],
    offsets: list[float],
    codecs: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Start every worker's own loop, collect its records; per codec, the summary."""
    n, rounds_n = len(workers), args.rounds
    seed_of = {d.peer_id: i for i, d in enumerate(daemons)}
    hosts = list(bed.hosts.values())
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    for i, worker in enumerate(workers):
        worker.start_reader(lines, i)
    # Link counters when every worker has finished a codec's rounds: each codec's bytes.
    marks = [(time.monotonic(), [h.link_bytes()[0] for h in hosts])]
    for i, worker in enumerate(workers):
        worker.request(
            op="unsync", rank=i, seed=args.seed, offset=offsets[i], compute=args.compute,
            codecs=codecs, rounds=rounds_n, timeout=args.timeout,
        )  # fmt: skip
    records: list[list[dict[str, Any]]] = [[] for _ in workers]
    done: set[int] = set()
    silent_limit = args.start_spread + args.compute + args.timeout + 60.0
    heard = [time.monotonic()] * n
    last_log = time.monotonic()
    while len(done) < n:
        try:
            i, line = lines.get(timeout=1.0)
        except queue.Empty:
            i, line = -1, ""
        now = time.monotonic()
        if line is None:
            if i not in done:
                raise RuntimeError(f"worker {i} exited with {workers[i].proc.wait(10)}")
            continue
        if line:
            heard[i] = now
            record = json.loads(line)
            if record.get("done"):
                done.add(i)
            elif "round" in record:
                sample = record.pop("sample", None)
                ranks = [seed_of.get(p, -1) for p in record.pop("peers", [])]
                if sample is not None:
                    record["ranks"] = ranks
                    if -1 not in ranks:
                        record.update(check_sample(np.asarray(sample), [samples[r] for r in ranks]))
                if "error" in record:
                    log(
                        f"host {i} {record['codec']} round {record['round']}: "
                        f"{record['error']}: {record['message'][:300]}"
                    )
                records[i].append(record)
                finished = min(len(r) for r in records)
                if finished % rounds_n == 0 and finished // rounds_n == len(marks):
                    marks.append((now, [h.link_bytes()[0] for h in hosts]))
        for k in range(n):
            if k not in done and now - heard[k] > silent_limit:
                raise RuntimeError(f"worker {k}: silent for {silent_limit:.0f} s")
        if now - last_log > 15:
            last_log = now
            log(f"calls done per host {[len(r) for r in records]} of {rounds_n * len(codecs)}")
    closes, rejections, warnings = daemon_logs(daemons)
    per_codec: dict[str, Any] = {}
    for k, codec in enumerate(codecs):
        entry = unsync_rounds.summarize(n, codec, rounds_n, records)
        entry.pop("peers", None)
        mine = [r for recs in records for r in recs if r["codec"] == codec]
        rms = [r["rel_rms_error"] for r in mine if "rel_rms_error" in r and not r["partial"]]
        entry["max_rel_rms_error"] = float(f"{max(rms):.3g}") if rms else None
        if k + 1 < len(marks):  # bytes each host's link carried out, per round
            (t0, before), (t1, after) = marks[k], marks[k + 1]
            tx = statistics.mean(a - b for a, b in zip(after, before, strict=True)) / rounds_n
            entry["wire_mb_per_host"] = round(tx / 1e6, 2)
            entry["link_bound_s"] = round(tx * 8 / (args.rate_mbit * 1e6), 3)
            entry["median_over_link_bound"] = unsync_rounds.rounds._ratio(
                entry["median_s"], entry["link_bound_s"]
            )
            entry["codec_wall_s"] = round(t1 - t0, 1)
        shas = [r for r in mine if "sha256" in r]
        entry["timings"] = (  # the daemon's phases in the median call (one member's view)
            {
                name: round(float(v), 3)
                for name, v in sorted(
                    sorted(shas, key=lambda r: r["seconds"])[len(shas) // 2]["timings"].items()
                )
            }
            if shas
            else None
        )
        entry["daemon_closes"] = unsync_rounds.close_summary(closes, codec)
        log(
            f"{codec}: one group of {n} in {entry['one_group_rounds']} of {rounds_n} rounds, "
            f"shapes {entry['round_shapes']}, NoGroupError {entry['no_group_errors']}, "
            f"other {entry['other_errors']}, partial {entry['partial']}, median "
            f"{entry['median_s']} s, link bound {entry.get('link_bound_s')} s"
        )
        per_codec[codec] = entry
    return {
        "codecs": per_codec,
        "daemon_rejections": dict(rejections.most_common()) or None,
        "daemon_warning_lines": warnings,
    }


def run_unsync(args: argparse.Namespace) -> dict[str, Any]:
    """``--unsync``: one swarm per variant (one after the other), every host on its own."""
    n, rate, nbytes = args.hosts, args.rate_mbit, int(args.mb * 1e6)
    codecs = [c for c in args.codecs.split(",") if c]
    variants = parse_variants(args)
    rng = np.random.default_rng(args.seed)
    offsets = [round(float(x), 3) for x in rng.uniform(0.0, args.start_spread, n)]
    payload = 2 * (n - 1) * nbytes / n  # bytes each host must send in a butterfly
    figures: dict[str, Any] = {
        "benchmark": "bandwidth",
        "mode": "unsync",
        "argv": sys.argv[1:],
        "path": "swarmavg peer daemons (CLI) + one client process per host, "
        "each pair in its own network namespace; each client runs its own loop "
        "(start offset, compute pauses), default configuration (no group size)",
        "hosts": n,
        "rate_mbit": rate,
        "mtu": args.mtu or 1500,
        **link_figures(args),
        "tensor_mb": args.mb,
        "rounds": args.rounds,
        "group_size": "default",
        "start_spread": args.start_spread,
        "start_offsets_s": offsets,
        "compute": args.compute,
        "seed": args.seed,
        "timeout": args.timeout,
        "daemon_log_level": args.daemon_log_level,
        "variant_flags": {name: shlex.join(flags) for name, flags in variants.items()},
        # The none codec's butterfly payload at the link's rate: the existing mode's bound.
        "payload_link_bound_s": round(payload * 8 / (rate * 1e6), 3),
        "load_average_at_start": round(os.getloadavg()[0], 1),
        "cpu_cores": os.cpu_count(),
    }
    results: dict[str, dict[str, Any]] = {}
    raws: dict[str, dict[str, float]] = {}
    # Unix socket paths are capped at 107 bytes: keep the folder short.
    tmp = tempfile.mkdtemp(prefix="bw-unsync-", dir="/tmp")
    try:
        with TestBed(uniform_hosts(n, args, rate_mbit=rate, mtu=args.mtu)) as bed:
            workdir = Path(tmp)
            log(f"test bed {bed.prefix}: {n} hosts at {rate} Mbit/s, offsets {offsets} s")
            first = next(iter(bed.hosts.values()))
            figures["tcp_congestion_control"] = first.run(
                ["sysctl", "-n", "net.ipv4.tcp_congestion_control"], check=False
            ).stdout.strip()
            by_algorithm: dict[str | None, dict[str, float]] = {}
            for variant, flags in variants.items():
                cc = flag_value(flags, "--congestion-control")
                if args.raw_repeats > 0 and cc not in by_algorithm:
                    by_algorithm[cc] = raw_tcp(bed, nbytes, args.raw_repeats, cc)
                if cc in by_algorithm:
                    raws[variant] = by_algorithm[cc]
                    log(f"raw TCP, butterfly pattern, {variant}: {raws[variant]}")
            elements = nbytes // 4
            samples = [make_input(seed, elements)[::SAMPLE_STRIDE] for seed in range(n)]
            for k, (variant, flags) in enumerate(variants.items()):
                pool = DaemonPool(workdir)
                workers: list[Worker] = []
                try:
                    daemons = start_daemons(
                        bed, pool, workdir, f"bandwidth{k}", port=PORT + 10 * k,
                        extra=flags, log_level=args.daemon_log_level,
                    )  # fmt: skip
                    for seed, (host, daemon) in enumerate(
                        zip(bed.hosts.values(), daemons, strict=True)
                    ):
                        workers.append(Worker(host, daemon.control, seed, elements))
                    results[variant] = unsync_swarm(
                        bed, daemons, workers, samples, offsets, codecs, args
                    )
                except Exception as exc:  # the line still comes out, with what was measured
                    results[variant] = {"error": f"{type(exc).__name__}: {exc}"}
                    log(f"{variant} failed: {exc!r}")
                finally:
                    for worker in workers:
                        worker.close()
                    handles = list(pool.processes)
                    pool.close()
                    if args.log_dir:
                        folder = Path(args.log_dir) / variant
                        folder.mkdir(parents=True, exist_ok=True)
                        for i, handle in enumerate(handles):
                            shutil.copy(handle.stderr_path, folder / f"daemon{i}.log")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures["load_average_at_end"] = round(os.getloadavg()[0], 1)
    for variant, entry in results.items():
        none = entry.get("codecs", {}).get("none", {})
        if none.get("median_s"):
            entry["goodput_none_fraction"] = round(
                figures["payload_link_bound_s"] / none["median_s"], 3
            )
            if variant in raws:
                entry["goodput_none_vs_raw_tcp"] = round(
                    raws[variant]["seconds"] / none["median_s"], 3
                )
        if variant in raws:
            entry["raw_tcp"] = raws[variant]
    if list(variants) == ["default"]:  # the single-variant layout
        figures.update(results["default"])
        return figures
    figures["variants"] = results
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
        "what jumbo frames would carry, docs/benchmarks-testbed.md)",
    )
    add_link_arguments(parser)
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
        default=None,
        help="name the group size in average() (given) or let the daemons form it (default); "
        "default: given, and --unsync always lets the daemons form it",
    )
    parser.add_argument(
        "--unsync",
        action="store_true",
        help="each host's client runs its own loop: start offset, compute pauses, no group size",
    )
    parser.add_argument(
        "--start-spread",
        type=float,
        default=2.0,
        help="--unsync: each host starts a seeded random offset within this many seconds",
    )
    parser.add_argument(
        "--compute",
        type=float,
        default=0.0,
        help="--unsync: most seconds of seeded random compute before each call",
    )
    parser.add_argument("--seed", type=int, default=0, help="--unsync: offsets and pauses")
    parser.add_argument(
        "--daemon-log-level",
        default=None,
        help="the daemons' --log-level (default: $BW_LOG_LEVEL or WARNING); --unsync with "
        "DEBUG also counts their group closes by reason and size",
    )
    parser.add_argument(
        "--log-dir", default=None, help="--unsync: keep the daemons' logs here (per variant)"
    )
    parser.add_argument(
        "--gloo",
        action="store_true",
        help="also torch gloo's all_reduce of the same elements, one rank per host, a gloo "
        "round after each round of ours (benchmarks/testbed_gloo.py)",
    )
    args = parser.parse_args()
    if args.unsync and args.group_size == "given":
        parser.error("--unsync runs the default configuration: no --group-size given")
    if args.unsync and args.gloo:
        parser.error("--gloo takes turns with the synchronised rounds, not with --unsync")
    args.group_size = args.group_size or ("default" if args.unsync else "given")
    reason = missing_requirements()
    if reason is not None:
        print(json.dumps({"benchmark": "bandwidth", "skipped": reason}))
        return 1
    print(json.dumps(run_unsync(args) if args.unsync else run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
