"""Private runs on shaped links: the round time with TLS on vs off on the test bed.

benchmarks/tls_rounds.py measures loopback, where a round is CPU-bound and TLS's AES-GCM and
copies show in full. This script measures what a user's link sees: N hosts of the multi-host
test bed (deploy/testbed: network namespaces, a bridge, ``tc`` limits of ``--rate`` Mbit/s on
every host's link), each running two real ``swarmavg peer`` daemons, one of a public run
(port 31337) and one of a private run whose members were invited by an authority made here
(port 31338). Round by round the two runs take turns (which goes first alternates); every
host's training side is a client in this process on the daemon's control socket, as in
tests/deploy. A round's time is from the call to the last member's result; each figure is the
median over ``--rounds`` rounds after one untimed warm-up round each; every result is checked
against the exact mean. Needs root and iproute2 (as the test bed does). Prints ONE JSON line.

    sudo python -m benchmarks.tls_testbed --hosts 4 --rate 200 --mb 16 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from deploy.testbed import Host, HostSpec, TestBed, missing_requirements
from swarmavg.dht.credentials import (
    JoinRequest,
    init_run,
    invite,
    load_or_create_tls_key,
    tls_key_path,
)
from swarmavg.dht.identity import Identity
from swarmavg.peer import connect_async

from .common import REPO

READY_TIMEOUT = 120.0


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} tls_testbed: {message}", file=sys.stderr, flush=True)


def private_flags(folder: Path, names: list[str]) -> list[list[str]]:
    """A run authority in ``folder`` and one invited member per name: their peer flags."""
    authority, run_file = folder / "authority.pem", folder / "run.toml"
    init_run("closed", authority, run_file)
    flags = []
    for name in names:
        identity_path = folder / f"{name}.key"
        identity = Identity.load_or_create(identity_path)
        request = JoinRequest.make(identity, load_or_create_tls_key(tls_key_path(identity_path)))
        _, credential = invite(authority, run_file, request.encode())
        (folder / f"{name}.cred.pem").write_bytes(credential)
        flags.append(
            [
                *("--run-file", str(run_file)),
                *("--credential", str(folder / f"{name}.cred.pem")),
                *("--identity", str(identity_path)),
            ]
        )
    return flags


class Daemon:
    """``swarmavg peer`` inside a test bed host; ``ready`` is its JSON ready line."""

    def __init__(self, host: Host, args: list[str], log_path: Path) -> None:
        self._log = log_path.open("w")
        command = [sys.executable, "-m", "swarmavg.peer.cli", "peer", *args]
        self.proc = host.popen(command, stdout=subprocess.PIPE, stderr=self._log, cwd=REPO)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the ready line, or EOF if it failed
        if not line:
            raise RuntimeError(f"daemon on {host.name} exited: see {log_path}")
        self.ready: dict[str, Any] = json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def start_run(
    hosts: list[Host], port: int, flags: list[list[str]], workdir: Path, tag: str
) -> list[Daemon]:
    daemons: list[Daemon] = []
    for host, extra in zip(hosts, flags, strict=True):
        args = ["--listen", f"{host.address}:{port}", "--log-level", "WARNING", *extra]
        args += ["--control", str(workdir / f"{tag}-{host.name}.sock")]
        if daemons:
            args += ["--join", daemons[0].ready["address"]]
        daemons.append(Daemon(host, args, workdir / f"{tag}-{host.name}.log"))
    return daemons


async def one_round(daemons: list[Daemon], inputs: list[np.ndarray], key: str) -> float:
    async def call(daemon: Daemon, x: np.ndarray) -> Any:
        async with connect_async(daemon.ready["control"]) as client:
            return await client.average([x], key=key, group_size=len(daemons), timeout=120)

    started = time.perf_counter()
    results = await asyncio.gather(*(call(d, x) for d, x in zip(daemons, inputs, strict=True)))
    seconds = time.perf_counter() - started
    expected = np.mean(inputs, axis=0, dtype=np.float64)
    for result in results:
        if result.group_size != len(daemons) or result.partial:
            raise RuntimeError(f"round {key}: group {result.group_size}, partial {result.partial}")
        np.testing.assert_allclose(result.tensors[0], expected, rtol=1e-5, atol=1e-6)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", type=float, default=200.0, help="Mbit/s of every host's link")
    parser.add_argument("--mb", type=float, default=16.0, help="MB (1e6 bytes) of float32")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    reason = missing_requirements()
    if reason is not None:
        print(json.dumps({"benchmark": "tls_testbed", "error": f"skipped: {reason}"}))
        return 1
    figures: dict[str, Any] = {
        "benchmark": "tls_testbed",
        "hosts": args.hosts,
        "rate_mbit": args.rate,
        "mb": args.mb,
        "rounds": args.rounds,
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    rng = np.random.default_rng(0)
    elements = int(args.mb * 1e6) // 4
    inputs = [rng.standard_normal(elements, dtype=np.float32) for _ in range(args.hosts)]
    workdir = Path(tempfile.mkdtemp(prefix="tlsbed-", dir="/tmp"))
    runs: dict[str, list[Daemon]] = {}
    status = 0
    with TestBed([HostSpec(f"h{i}", rate_mbit=args.rate) for i in range(args.hosts)]) as bed:
        hosts = list(bed.hosts.values())
        try:
            runs["plain"] = start_run(
                hosts, 31337, [["--run-id", "open"]] * len(hosts), workdir, "plain"
            )
            flags = private_flags(workdir, [h.name for h in hosts])
            runs["tls"] = start_run(hosts, 31338, flags, workdir, "tls")
            times: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(args.rounds + 1):
                for name in sorted(runs, reverse=r % 2 == 1):
                    seconds = asyncio.run(one_round(runs[name], inputs, f"r{r}"))
                    log(f"{name} round {r}: {seconds:.3f} s")
                    if r > 0:
                        times[name].append(seconds)
            for name, values in times.items():
                figures[name] = {
                    "round_s": round(statistics.median(values), 4),
                    "all": [round(v, 4) for v in values],
                }
            figures["tls/plain"] = round(figures["tls"]["round_s"] / figures["plain"]["round_s"], 3)
            per_round = [t / p for p, t in zip(times["plain"], times["tls"], strict=True)]
            figures["tls/plain per round, median"] = round(statistics.median(per_round), 3)
        except Exception as exc:  # the line still comes out, with what was measured
            figures["error"] = f"{type(exc).__name__}: {exc}"
            status = 1
        finally:
            for daemons in runs.values():
                for daemon in daemons:
                    daemon.stop()
    figures["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
