"""Raw TCP transfers between test bed hosts, driven from the test process.

Each side runs ``tcpprobe.py`` inside its host; this module starts them, reads their JSON
lines and returns what they measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.testbed._system import TestBedError
from deploy.testbed.bed import Host

PROBE = str(Path(__file__).with_name("tcpprobe.py"))


@dataclass(frozen=True)
class Transfer:
    """One connection as the receiving side saw it.

    Attributes:
        nbytes: bytes received before EOF.
        seconds: from accept to EOF.
        peer: ``IP:PORT`` the connection came from (the NAT router's address for a NAT host).
    """

    nbytes: int
    seconds: float
    peer: str
    started_at: float = 0.0
    ended_at: float = 0.0
    """``time.monotonic()`` at accept and at EOF (one clock for all processes)."""
    receiver: str = ""
    """The receiving host's address."""

    @property
    def mbit_per_s(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e6


class Sink:
    """A ``tcpprobe.py sink`` running in a host, accepting ``connections`` connections."""

    def __init__(
        self,
        host: Host,
        connections: int = 1,
        timeout: float = 60.0,
        congestion_control: str | None = None,
    ) -> None:
        self.host = host
        args = [sys.executable, PROBE, "sink", "--bind", host.address]
        args += ["--connections", str(connections), "--timeout", str(timeout)]
        if congestion_control is not None:
            args += ["--congestion-control", congestion_control]
        self.proc = host.popen(args, stdout=subprocess.PIPE)
        self._pending: list[dict[str, Any]] = []
        self.port = int(self._next("ready")["port"])

    @property
    def endpoint(self) -> str:
        """``ADDRESS:PORT`` as seen from the host's own subnet."""
        return f"{self.host.address}:{self.port}"

    def _next(self, event: str) -> dict[str, Any]:
        """The next record of ``event``; records of other events read meanwhile are kept
        for later calls (accept and end lines of parallel connections interleave)."""
        for i, record in enumerate(self._pending):
            if record.get("event") == event:
                return self._pending.pop(i)
        if self.proc.stdout is None:
            raise TestBedError("sink stdout is not a pipe")
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise TestBedError(f"sink in {self.host.name} exited (code {self.proc.wait(5)})")
            fresh: dict[str, Any] = json.loads(line)
            if fresh.get("event") == "error":
                raise TestBedError(f"sink in {self.host.name}: {fresh}")
            if fresh.get("event") == event:
                return fresh
            self._pending.append(fresh)

    def wait_accepted(self) -> str:
        """Block until the next connection is accepted; return its peer address."""
        return str(self._next("accepted")["peer"])

    def wait_received(self) -> Transfer:
        """Block until the next connection ended; return what it carried."""
        record = self._next("received")
        return Transfer(
            int(record["bytes"]),
            float(record["seconds"]),
            str(record["peer"]),
            float(record["started_at"]),
            float(record["ended_at"]),
            self.host.address,
        )

    def close(self) -> None:
        """Stop the sink (it may still wait for connections that never come)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def send_command(
    sender: Host,
    endpoints: str | Sequence[str],
    nbytes: int,
    timeout: float,
    congestion_control: str | None = None,
    in_turn: bool = False,
) -> list[str]:
    """The command that sends ``nbytes`` from ``sender`` to each endpoint (``HOST:PORT``)
    at once, one connection each (with TCP congestion control ``congestion_control``;
    None: the kernel's default); ``in_turn``: to one endpoint after another, in order."""
    targets = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    args = [sys.executable, PROBE, "send", "--bytes", str(nbytes), "--timeout", str(timeout)]
    if congestion_control is not None:
        args += ["--congestion-control", congestion_control]
    if in_turn:
        args.append("--in-turn")
    for target in targets:
        args += ["--to", target]
    return sender.command(args)


def send(sender: Host, endpoint: str, nbytes: int, timeout: float = 30.0) -> dict[str, Any]:
    """Send ``nbytes`` from ``sender`` to ``endpoint``; return the sender's JSON record
    (``event`` is ``"sent"`` or ``"error"``)."""
    done = subprocess.run(
        send_command(sender, endpoint, nbytes, timeout),
        capture_output=True,
        text=True,
        timeout=timeout * 4 + 30,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise TestBedError(f"sender in {sender.name} printed nothing: {done.stderr}")
    record: dict[str, Any] = json.loads(lines[-1])
    return record


def transfer(sender: Host, receiver: Host, nbytes: int, timeout: float = 30.0) -> Transfer:
    """Send ``nbytes`` over one TCP connection from ``sender`` to ``receiver``'s address.

    Raises:
        TestBedError: the transfer failed.
    """
    sink = Sink(receiver, timeout=timeout)
    try:
        record = send(sender, sink.endpoint, nbytes, timeout)
        if record["event"] != "sent":
            raise TestBedError(f"{sender.name} -> {receiver.name} failed: {record}")
        return sink.wait_received()
    finally:
        sink.close()


@dataclass(frozen=True)
class Exchange:
    """An all-to-all exchange: every transfer, and the span from the first accept to the
    last EOF (the time the whole pattern took on the links)."""

    transfers: list[Transfer]

    @property
    def seconds(self) -> float:
        return max(t.ended_at for t in self.transfers) - min(t.started_at for t in self.transfers)


def all_to_all(
    hosts: Sequence[Host],
    nbytes: int,
    timeout: float = 120.0,
    congestion_control: str | None = None,
    connections_per_pair: int = 1,
    shifted: bool = False,
) -> Exchange:
    """Every host sends ``nbytes`` to every other host at once (the traffic pattern of a
    butterfly all-reduce); one sender process per host, ``connections_per_pair``
    connections per pair carrying an equal share each, both ends with TCP congestion
    control ``congestion_control`` (None: the kernel's default).

    ``shifted``: host i sends to host i+1 first, then to i+2, ... (modulo the hosts), each
    once the last one's bytes all arrived, so that while the hosts keep pace every host
    receives from one sender at a time (a shifted all-to-all) instead of from all at once.

    Raises:
        TestBedError: a transfer failed.
    """
    if connections_per_pair < 1:
        raise ValueError(f"connections_per_pair must be >= 1, got {connections_per_pair}")
    per_host = connections_per_pair * (len(hosts) - 1)
    sinks = [Sink(host, per_host, timeout, congestion_control=congestion_control) for host in hosts]
    senders: list[subprocess.Popen[str]] = []
    try:
        n = len(hosts)
        for i, host in enumerate(hosts):
            order = (
                [(i + k) % n for k in range(1, n)] if shifted else [j for j in range(n) if j != i]
            )
            targets = [sinks[j].endpoint for j in order for _ in range(connections_per_pair)]
            share = nbytes // connections_per_pair
            senders.append(
                subprocess.Popen(
                    send_command(host, targets, share, timeout, congestion_control, shifted),
                    stdout=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    text=True,
                )
            )
        transfers = [sink.wait_received() for sink in sinks for _ in range(per_host)]
        for proc in senders:
            out, _ = proc.communicate(timeout=timeout)
            record = json.loads(out.strip().splitlines()[-1])
            if record["event"] != "sent":
                raise TestBedError(f"a sender failed: {record}")
        return Exchange(transfers)
    finally:
        for proc in senders:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        for sink in sinks:
            sink.close()
