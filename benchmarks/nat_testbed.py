"""Peers behind NAT on the test bed: round time with 3 of 5 hosts NATed (reached
through a relay only, and after hole punching) against all 5 public, and the relay's CPU and
memory per relayed MB/s.

One test bed (deploy/testbed) of 8 hosts, every link shaped to ``--rate`` Mbit/s: ``pub0``,
``pub1`` and ``p2..p4`` public, ``home0..home2`` each behind its own MASQUERADE router. Two
swarms of real ``swarmavg peer`` daemons started as users start them (``--listen
0.0.0.0:PORT --join FIRST``, no NAT flag): "public" = pub0, pub1, p2, p3, p4 (port 31337),
"nat" = pub0, pub1, home0, home1, home2 (port 31338, ``--no-hole-punching``: the homes find
out they are NATed, reserve at pub0, the peer they joined, and every byte to or from a home
crosses the relay), "punched" = the same hosts on port 31339 with hole punching on (the
default): after one untimed round the homes reach each other directly (the script waits
until each names the other two as direct peers), and only the public-to-home traffic still
crosses the relay. Rounds rotate between the swarms (the order rotates too); each figure is
the median over ``--rounds`` rounds after one untimed warm-up; every result is checked
against the exact mean. The relay's cost: CPU seconds (utime+stime from /proc) of pub0's
nat-swarm daemon minus pub0's public-swarm daemon over the timed rounds, per MB it relayed
(its status), and both daemons' RSS. Needs root and iproute2/iptables. Prints ONE JSON line.

    sudo .venv/bin/python -m benchmarks.nat_testbed --rate 100 --mb 16 --rounds 5
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
from swarmavg.peer import connect_async

from .common import REPO

PUBLIC = ["pub0", "pub1", "p2", "p3", "p4"]
NAT = ["pub0", "pub1", "home0", "home1", "home2"]
TICKS = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} nat_testbed: {message}", file=sys.stderr, flush=True)


class Daemon:
    """``swarmavg peer`` inside a test bed host; ``ready`` is its JSON ready line."""

    def __init__(self, host: Host, args: list[str], log_path: Path) -> None:
        self._log = log_path.open("w")
        command = [sys.executable, "-m", "swarmavg.peer.cli", "peer", *args]
        self.proc = host.popen(command, stdout=subprocess.PIPE, stderr=self._log, cwd=REPO)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"daemon on {host.name} exited: see {log_path}")
        self.ready: dict[str, Any] = json.loads(line)

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    async def status(self) -> Any:
        async with connect_async(self.ready["control"]) as client:
            return await client.status()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def start_swarm(
    bed: TestBed, names: list[str], port: int, workdir: Path, tag: str, extra: list[str]
) -> list[Daemon]:
    daemons: list[Daemon] = []
    for name in names:
        args = ["--listen", f"0.0.0.0:{port}", "--run-id", tag, "--log-level", "WARNING", *extra]
        args += ["--control", str(workdir / f"{tag}-{name}.sock")]
        if daemons:
            args += ["--join", daemons[0].ready["address"]]
        daemons.append(Daemon(bed[name], args, workdir / f"{tag}-{name}.log"))
    return daemons


async def one_round(daemons: list[Daemon], inputs: list[np.ndarray], key: str) -> float:
    async def call(daemon: Daemon, x: np.ndarray) -> Any:
        async with connect_async(daemon.ready["control"]) as client:
            return await client.average([x], key=key, group_size=len(daemons), timeout=180)

    started = time.perf_counter()
    results = await asyncio.gather(*(call(d, x) for d, x in zip(daemons, inputs, strict=True)))
    seconds = time.perf_counter() - started
    expected = np.mean(inputs, axis=0, dtype=np.float64)
    for result in results:
        if result.group_size != len(daemons) or result.partial:
            raise RuntimeError(f"round {key}: group {result.group_size}, partial {result.partial}")
        np.testing.assert_allclose(result.tensors[0], expected, rtol=1e-5, atol=1e-6)
    return seconds


def wait_for_punches(homes: list[Daemon], within: float = 120.0) -> list[int]:
    """Wait until every home names the other homes as direct peers (or ``within`` passed);
    return how many each names. The punches run inside the daemons: this polls."""
    give_up = time.monotonic() + within
    while True:
        counts = [len(asyncio.run(h.status())["direct_peers"]) for h in homes]
        if all(c >= len(homes) - 1 for c in counts) or time.monotonic() > give_up:
            log(f"direct peers per home: {counts}")
            return counts
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="Mbit/s of every host's link")
    parser.add_argument("--mb", type=float, default=16.0, help="MB (1e6 bytes) of float32")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    reason = missing_requirements()
    if reason is not None:
        print(json.dumps({"benchmark": "nat_testbed", "error": f"skipped: {reason}"}))
        return 1
    figures: dict[str, Any] = {
        "benchmark": "nat_testbed",
        "rate_mbit": args.rate,
        "mb": args.mb,
        "rounds": args.rounds,
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    rng = np.random.default_rng(0)
    elements = int(args.mb * 1e6) // 4
    inputs = [rng.standard_normal(elements, dtype=np.float32) for _ in range(5)]
    workdir = Path(tempfile.mkdtemp(prefix="natbed-", dir="/tmp"))
    specs = [HostSpec(n, rate_mbit=args.rate) for n in ["pub0", "pub1", "p2", "p3", "p4"]]
    specs += [HostSpec(n, rate_mbit=args.rate, nat=True) for n in ["home0", "home1", "home2"]]
    swarms: dict[str, list[Daemon]] = {}
    status = 0
    with TestBed(specs) as bed:
        try:
            swarms["public"] = start_swarm(bed, PUBLIC, 31337, workdir, "public", [])
            swarms["nat"] = start_swarm(bed, NAT, 31338, workdir, "nat", ["--no-hole-punching"])
            swarms["punched"] = start_swarm(bed, NAT, 31339, workdir, "punched", [])
            reach = [asyncio.run(d.status()).get("reachability") for d in swarms["nat"]]
            figures["nat_swarm_reachability"] = reach
            times: dict[str, list[float]] = {name: [] for name in swarms}
            relay, plain = swarms["nat"][0], swarms["public"][0]
            punched_relay = swarms["punched"][0]
            cpu: dict[str, float] = {}
            relayed_before = punched_before = 0
            order = sorted(swarms)
            for r in range(args.rounds + 1):
                if r == 1:
                    figures["punched_direct_peers"] = wait_for_punches(swarms["punched"][2:])
                    cpu = {"relay": relay.cpu_seconds(), "plain": plain.cpu_seconds()}
                    relayed_before = asyncio.run(relay.status())["relayed_bytes"]
                    punched_before = asyncio.run(punched_relay.status())["relayed_bytes"]
                for name in order[r % 3 :] + order[: r % 3]:
                    seconds = asyncio.run(one_round(swarms[name], inputs, f"r{r}"))
                    log(f"{name} round {r}: {seconds:.3f} s")
                    if r > 0:
                        times[name].append(seconds)
            relayed_mb = (asyncio.run(relay.status())["relayed_bytes"] - relayed_before) / 1e6
            punched_mb = (
                asyncio.run(punched_relay.status())["relayed_bytes"] - punched_before
            ) / 1e6
            figures["relayed_mb_per_round"] = {
                "nat": round(relayed_mb / args.rounds, 2),
                "punched": round(punched_mb / args.rounds, 2),
            }
            extra_cpu = (relay.cpu_seconds() - cpu["relay"]) - (plain.cpu_seconds() - cpu["plain"])
            nat_seconds = sum(times["nat"])
            for name, values in times.items():
                figures[name] = {
                    "round_s": round(statistics.median(values), 3),
                    "all": [round(v, 3) for v in values],
                }
            for name in ("nat", "punched"):
                figures[f"{name}/public"] = round(
                    figures[name]["round_s"] / figures["public"]["round_s"], 3
                )
                per_round = [n / p for p, n in zip(times["public"], times[name], strict=True)]
                figures[f"{name}/public per round, median"] = round(statistics.median(per_round), 3)
            figures["relay"] = {
                "relayed_mb": round(relayed_mb, 1),
                "relayed_mb_per_s_during_nat_rounds": round(relayed_mb / nat_seconds, 2),
                "extra_cpu_s": round(extra_cpu, 2),
                "cpu_cores_per_relayed_mb_per_s": round(extra_cpu / max(relayed_mb, 1e-9), 4),
                "rss_mib_relay_daemon": round(relay.rss_mib(), 1),
                "rss_mib_same_host_public_daemon": round(plain.rss_mib(), 1),
            }
        except Exception as exc:  # the line still comes out, with what was measured
            figures["error"] = f"{type(exc).__name__}: {exc}"
            status = 1
        finally:
            for daemons in swarms.values():
                for daemon in daemons:
                    daemon.stop()
    figures["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
