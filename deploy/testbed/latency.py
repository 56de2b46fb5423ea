"""Round-trip time and loss between test bed hosts, measured with UDP echoes.

The echo server runs in one host and the prober in another (``udpecho.py``); this module
starts both and returns what the prober saw.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from deploy.testbed._system import TestBedError
from deploy.testbed.bed import Host

PROBE = str(Path(__file__).with_name("udpecho.py"))


@dataclass(frozen=True)
class EchoRun:
    """Every probe's round-trip time in milliseconds (None: lost), and how many echoes
    arrived after an echo of a later probe."""

    rtt_ms: list[float | None]
    reordered: int

    @property
    def answered(self) -> list[float]:
        return [rtt for rtt in self.rtt_ms if rtt is not None]

    @property
    def loss(self) -> float:
        """The fraction of probes whose echo never came back."""
        return 1 - len(self.answered) / len(self.rtt_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.answered)


def echo(
    prober: Host, responder: Host, count: int, interval: float, linger: float = 2.0
) -> EchoRun:
    """Send ``count`` UDP probes from ``prober`` to ``responder``, one every ``interval``
    seconds, and collect their echoes until ``linger`` seconds after the last one (or until
    every probe is answered).

    Raises:
        TestBedError: a probe process failed.
    """
    server = responder.popen(
        [sys.executable, PROBE, "serve", "--bind", responder.address, "--idle", "30"],
        stdout=subprocess.PIPE,
    )
    try:
        if server.stdout is None:
            raise TestBedError("echo server stdout is not a pipe")
        ready = json.loads(server.stdout.readline() or b"{}")
        if ready.get("event") != "ready":
            raise TestBedError(f"echo server in {responder.name} did not start")
        target = f"{responder.address}:{ready['port']}"
        done = prober.run(
            [
                sys.executable, PROBE, "probe", "--to", target, "--count", str(count),
                "--interval", str(interval), "--linger", str(linger),
            ],
            timeout=count * interval * 4 + linger + 60,
            check=False,
        )  # fmt: skip
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            raise TestBedError(f"echo prober in {prober.name} failed: {done.stderr}")
        record = json.loads(lines[-1])
        if record["unsent"]:
            raise TestBedError(f"{record['unsent']} probes could not be sent from {prober.name}")
        return EchoRun(record["rtt_ms"], int(record["reordered"]))
    finally:
        server.kill()
        server.wait(10)
        if server.stdout is not None:
            server.stdout.close()
