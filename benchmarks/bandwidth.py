"""All-reduce over rate-limited links: what each codec buys when bandwidth is the bottleneck.

Builds the multi-host test bed (``deploy.testbed``: one network namespace per host, every
host's link shaped with tc tbf in both directions), starts one real ``swarmavg peer`` daemon
per host through the CLI, and averages a float32 tensor of ``--mb`` megabytes among all hosts
through the real client, once per round and codec. Also measures raw TCP through the same
links in the same traffic pattern (every host sends 2/N of the tensor to every other host)
as the reference for goodput. Prints ONE JSON line; progress goes to stderr.

    sudo .venv/bin/python benchmarks/bandwidth.py                       # the docs' figures
    sudo .venv/bin/python benchmarks/bandwidth.py --mb 8 --rounds 1     # a quick look

Needs root, iproute2 and iptables (like the test bed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from deploy.testbed import HostSpec, TestBed, missing_requirements  # noqa: E402
from deploy.testbed.goodput import all_to_all  # noqa: E402
from swarmavg.peer import connect_async  # noqa: E402
from tests.harness import ProcessPool, SwarmavgProcess  # noqa: E402

DEFAULT_CODECS = "none,float16,uint8-blockwise,uint4-blockwise,topk"
PORT = 31337


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Round:
    seconds: float  # from the first call to the last result
    tx_bytes: list[int]  # per host, Ethernet bytes its link carried out during the round
    partial: bool
    max_abs_error: float
    rel_rms_error: float
    timings: dict[str, float]  # one member's phase timings
    cpu_seconds: float = 0.0  # CPU time of one daemon during the round (mean over hosts)


def cpu_seconds(daemon: SwarmavgProcess) -> float:
    """User + system CPU time the daemon process has used so far."""
    fields = Path(f"/proc/{daemon.proc.pid}/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def start_daemons(
    bed: TestBed, pool: ProcessPool, workdir: Path, run_id: str
) -> list[SwarmavgProcess]:
    """One daemon per host on ``HOST_ADDRESS:31337``; all join the first."""
    daemons: list[SwarmavgProcess] = []
    for name, host in bed.hosts.items():
        args = ["peer", "--listen", f"{host.address}:{PORT}", "--run-id", run_id]
        args += [
            "--control",
            str(workdir / f"{name}.sock"),
            "--log-level",
            os.environ.get("BW_LOG_LEVEL", "WARNING"),
        ]
        if daemons:
            args += ["--join", daemons[0].address]
        daemons.append(pool.start(args, executable=host.swarmavg_command()))
    return daemons


async def one_round(
    bed: TestBed,
    daemons: list[SwarmavgProcess],
    inputs: list[np.ndarray],
    key: str,
    codec: str,
    timeout: float,
) -> Round:
    hosts = list(bed.hosts.values())
    expected = np.mean(np.stack(inputs), axis=0, dtype=np.float64)
    clients = [await connect_async(d.control) for d in daemons]
    try:
        before = [host.link_bytes()[0] for host in hosts]
        started = time.monotonic()
        results = await asyncio.gather(
            *(
                client.average(
                    [x], key=key, group_size=len(daemons), min_group_size=len(daemons),
                    timeout=timeout, codec=codec,
                )
                for client, x in zip(clients, inputs, strict=True)
            )
        )  # fmt: skip
        seconds = time.monotonic() - started
        after = [host.link_bytes()[0] for host in hosts]
    finally:
        for client in clients:
            await client.close()
    errors = [np.asarray(r.tensors[0], dtype=np.float64) - expected for r in results]
    scale = float(np.sqrt(np.mean(expected**2)))
    return Round(
        seconds=seconds,
        tx_bytes=[a - b for a, b in zip(after, before, strict=True)],
        partial=any(r.partial for r in results),
        max_abs_error=max(float(np.abs(e).max()) for e in errors),
        rel_rms_error=max(float(np.sqrt(np.mean(e**2))) for e in errors) / scale,
        timings=dict(results[0].timings),
    )


def raw_tcp(bed: TestBed, nbytes: int, repeats: int) -> dict[str, float]:
    """The butterfly's traffic pattern over plain TCP: each host sends 2*S/N to each other."""
    hosts = list(bed.hosts.values())
    per_pair = 2 * nbytes // len(hosts)
    times = [all_to_all(hosts, per_pair, timeout=300).seconds for _ in range(repeats)]
    seconds = statistics.median(times)
    egress = per_pair * (len(hosts) - 1)
    return {"seconds": round(seconds, 3), "per_host_egress_mbit_s": egress * 8 / seconds / 1e6}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    n, rate, nbytes = args.hosts, args.rate_mbit, int(args.mb * 1e6)
    codecs = [c for c in args.codecs.split(",") if c]
    figures: dict[str, Any] = {
        "benchmark": "bandwidth",
        "path": "swarmavg peer daemons (CLI) + client, one daemon per network namespace",
        "hosts": n,
        "rate_mbit": rate,
        "tensor_mb": args.mb,
        "rounds": args.rounds,
        "load_average_at_start": round(os.getloadavg()[0], 1),
        "cpu_cores": os.cpu_count(),
    }
    workdir = Path(tempfile.mkdtemp(prefix="swarmavg-bw-"))
    with TestBed([HostSpec(f"h{i}", rate_mbit=rate) for i in range(n)]) as bed:
        log(f"test bed {bed.prefix}: {n} hosts at {rate} Mbit/s")
        raw = raw_tcp(bed, nbytes, args.raw_repeats)
        figures["raw_tcp"] = raw
        log(f"raw TCP, butterfly pattern: {raw}")
        pool = ProcessPool(workdir)
        try:
            daemons = start_daemons(bed, pool, workdir, "bandwidth")
            rng = np.random.default_rng(0)
            inputs = [rng.standard_normal(nbytes // 4, dtype=np.float32) for _ in range(n)]
            warm = [x[: 1 << 18].copy() for x in inputs]
            per_codec: dict[str, Any] = {}
            rounds: dict[str, list[Round]] = {}
            for codec in codecs:
                try:
                    # Untimed: connections, lazy imports and first-use costs of the codec.
                    await one_round(bed, daemons, warm, f"warm-{codec}", codec, args.timeout)
                    rounds[codec] = []
                except Exception as exc:  # a codec that is missing or fails is reported
                    per_codec[codec] = {"error": f"{type(exc).__name__}: {exc}"}
                    log(f"{codec}: {exc!r}")
            # Codecs take turns round by round, so that the load of the shared machine
            # drifting during the run weighs on all of them alike.
            failed: dict[str, list[str]] = {codec: [] for codec in rounds}
            for r in range(args.rounds):
                for codec in rounds:
                    cpu_before = [cpu_seconds(d) for d in daemons]
                    try:
                        result = await one_round(
                            bed, daemons, inputs, f"bw-{codec}-{r}", codec, args.timeout
                        )
                    except Exception as exc:  # reported with the figures, never hidden
                        failed[codec].append(f"{type(exc).__name__}: {exc}")
                        log(f"{codec} round {r} failed: {exc!r}")
                        continue
                    result.cpu_seconds = statistics.mean(
                        cpu_seconds(d) - before
                        for d, before in zip(daemons, cpu_before, strict=True)
                    )
                    log(f"{codec} round {r}: {result}")
                    rounds[codec].append(result)
            for codec, done in rounds.items():
                if not done:
                    per_codec[codec] = {"error": "; ".join(failed[codec])}
                    continue
                chronological = [round(r.seconds, 3) for r in done]
                done.sort(key=lambda r: r.seconds)
                seconds = statistics.median(r.seconds for r in done)
                tx = statistics.median(statistics.mean(r.tx_bytes) for r in done)
                per_codec[codec] = {
                    "seconds": round(seconds, 3),
                    "rounds_seconds": chronological,
                    "wire_mb_per_host": round(tx / 1e6, 2),
                    "daemon_cpu_seconds": round(statistics.median(r.cpu_seconds for r in done), 2),
                    "rel_rms_error": float(f"{max(r.rel_rms_error for r in done):.3g}"),
                    "partial": any(r.partial for r in done),
                    # The daemon's phases in the median round (one member's view).
                    "timings": {
                        k: round(v, 3) for k, v in sorted(done[len(done) // 2].timings.items())
                    },
                    "failed_rounds": failed[codec],
                }
        finally:
            handles = list(pool.processes)
            pool.close()
            for handle in handles:  # tests/harness.py leaves the stdout pipes open
                if handle.proc.stdout is not None:
                    handle.proc.stdout.close()
    figures["load_average_at_end"] = round(os.getloadavg()[0], 1)
    figures["codecs"] = per_codec
    base = per_codec.get("none", {})
    if "seconds" in base:
        payload = 2 * (n - 1) * nbytes / n  # bytes each host must send in a butterfly
        figures["goodput_none_fraction"] = round(payload * 8 / base["seconds"] / (rate * 1e6), 3)
        figures["goodput_none_vs_raw_tcp"] = round(raw["seconds"] / base["seconds"], 3)
        exchange = base["timings"].get("allreduce.exchange")
        if exchange:  # the streaming phase alone, without preparing and finishing the parts
            figures["goodput_none_exchange_fraction"] = round(
                payload * 8 / exchange / (rate * 1e6), 3
            )
        for entry in per_codec.values():
            if "seconds" in entry:
                entry["speedup"] = round(base["seconds"] / entry["seconds"], 2)
                entry["byte_ratio"] = round(base["wire_mb_per_host"] / entry["wire_mb_per_host"], 2)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--mb", type=float, default=64.0, help="tensor size per host, MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codecs", default=DEFAULT_CODECS)
    parser.add_argument("--timeout", type=float, default=180.0, help="per average() call")
    parser.add_argument("--raw-repeats", type=int, default=2)
    args = parser.parse_args()
    reason = missing_requirements()
    if reason is not None:
        print(json.dumps({"benchmark": "bandwidth", "skipped": reason}))
        return 1
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
