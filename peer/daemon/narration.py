"""What a daemon tells the human who runs it: joins, leaves, failed rounds, warnings.

* a start banner on stderr with the exact command others run to join, and a warning when
  the announced address cannot be reached from elsewhere (loopback, private, link-local);
* one summary line per interval (rounds ok/failed, bytes, peers) instead of a line per
  round, which stays at DEBUG;
* peers joining and leaving the routing table, at INFO.

The pure parts (:func:`join_banner`, :func:`address_warning`, :class:`RoutingDiff`,
:class:`SummaryWindow`) are unit-tested; :func:`narrate` is the daemon's loop around them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import shlex
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from swarmavg.peer.client.endpoint import default_control_path
from swarmavg.peer.daemon.stats import PeerStats

log = logging.getLogger("swarmavg.peer.daemon")

ROUTING_POLL = 2.0
"""Seconds between two looks at the routing table for peers that joined or left."""
SHORT_ID = 12
"""Hex characters of a peer id in log lines."""


def _host_of(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def address_warning(address: str) -> str | None:
    """Why peers on other machines could not dial ``address``, or None when it looks
    routable (a host name is taken as given: it may resolve anywhere)."""
    host = _host_of(address)
    if host == "localhost":
        return f"the announced address {address} is this machine's loopback name"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback:
        kind = "a loopback address: only processes on this machine can join"
    elif ip.is_unspecified:
        kind = "a wildcard address that no peer can dial"
    elif ip.is_link_local:
        kind = "a link-local address: only machines on this network segment can join"
    elif ip.is_private:
        kind = "a private address: only machines on the same private network can join"
    else:
        return None
    return f"the announced address {address} is {kind}"


def join_banner(record: Mapping[str, Any], command: str, run_file: str | None = None) -> list[str]:
    """The lines a daemon prints on stderr once it is ready (after its JSON ready line).

    Args:
        record: its ready record (``peer_id``, ``address``, ``control``, ``run_id``).
        command: ``peer``, ``dht`` or ``monitor``.
        run_file: a private run's run file: the join command then carries the private-run
            flags (each peer has its own credential and identity), not ``--run-id``.
    """
    run_id = str(record["run_id"])
    if command == "monitor":
        return [
            f"swarmavg monitor: watching run {run_id!r} as {record['peer_id']} (client mode)",
            f"  dashboard: {record.get('dashboard') or 'off (--no-http)'}",
        ]
    address = record.get("address")
    what = "bootstrap DHT node" if command == "dht" else "peer"
    lines = [f"swarmavg {command}: {what} {record['peer_id']} of run {run_id!r} is ready"]
    if address:
        lines.append(f"  others join with:   {join_command(str(address), run_id, run_file)}")
        if run_file is not None:
            lines.append(
                "    (each with the credential and identity of its invitation: "
                "docs/private-runs.md)"
            )
    else:
        lines.append("  client mode: accepts no incoming connections, so nobody joins through it")
    control = record.get("control")
    if control:
        lines.extend(_control_lines(str(control), run_id))
    return lines


def join_command(address: str, run_id: str, run_file: str | None = None) -> str:
    """The command another peer runs to join through ``address``."""
    if run_file is None:
        return shlex.join(["swarmavg", "peer", "--join", address, "--run-id", run_id])
    return shlex.join(
        [
            "swarmavg",
            "peer",
            "--join",
            address,
            "--run-file",
            run_file,
            "--credential",
            "THEIR.cred.pem",
            "--identity",
            "THEIR.key",
        ]
    )


def _control_lines(control: str, run_id: str) -> list[str]:
    """How training processes and ``swarmavg peers`` find this daemon: by run id at the
    run's default socket, else (a second daemon of the run on this machine) by the
    environment line its trainers need."""
    try:
        default = str(default_control_path(run_id))
    except ValueError:
        default = ""
    if control == default:
        peers = shlex.join(["swarmavg", "peers", "--run-id", run_id])
        return [
            f"  training processes: connect({control!r}) in Python",
            f"  the run's peers:    {peers}",
        ]
    peers = shlex.join(["swarmavg", "peers", "--control", control])
    return [
        "  training processes: run them with this in their environment (connect() reads it):",
        f"    SWARMAVG_CONTROL={shlex.quote(control)}",
        f"  the run's peers:    {peers}",
    ]


def announce_hint(warning: str) -> str:
    """The warning with what to do about it."""
    return f"{warning}; peers elsewhere need --announce PUBLIC_HOST:PORT (and an open port)"


class RoutingDiff:
    """Which peers joined and left a routing table between two looks at it."""

    def __init__(self) -> None:
        self._known: dict[str, str] = {}
        self._first = True

    def update(self, contacts: Iterable[tuple[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
        """Take the table's ``(peer id hex, address)`` pairs; return (joined, left), each
        peer id -> address. The first look reports nothing: those are the initial peers."""
        now = dict(contacts)
        joined = {p: a for p, a in now.items() if p not in self._known}
        left = {p: a for p, a in self._known.items() if p not in now}
        self._known = now
        if self._first:
            self._first = False
            return {}, {}
        return joined, left

    def __len__(self) -> int:
        return len(self._known)


@dataclass
class _Snapshot:
    done: int = 0
    failed: int = 0
    partial: int = 0
    sent: int = 0
    received: int = 0
    failures: Counter[str] | None = None


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - unreachable


class SummaryWindow:
    """The summary line of the last interval, from the daemon's cumulative counters."""

    def __init__(self, stats: PeerStats | None) -> None:
        self._stats = stats
        self._last = self._take()

    def _take(self) -> _Snapshot:
        s = self._stats
        if s is None:
            return _Snapshot()
        return _Snapshot(
            s.rounds_done,
            s.rounds_failed,
            s.rounds_partial,
            s.bytes_sent,
            s.bytes_received,
            Counter(s.failures),
        )

    def line(self, seconds: float, peers: int) -> str:
        """``last 60 s: 12 rounds ok (1 partial), 2 failed (timeout 2), sent 3.1 MiB,
        received 3.0 MiB; 5 peers known`` (a bare DHT node: the peers only)."""
        now, last = self._take(), self._last
        self._last = now
        known = f"{peers} peer{'s' if peers != 1 else ''} known"
        if self._stats is None:
            return f"last {seconds:.0f} s: {known}"
        done, failed = now.done - last.done, now.failed - last.failed
        ok = f"{done} round{'s' if done != 1 else ''} ok"
        if now.partial - last.partial:
            ok += f" ({now.partial - last.partial} partial)"
        why = ""
        if failed:
            reasons = (now.failures or Counter()) - (last.failures or Counter())
            why = " (" + ", ".join(f"{r} {n}" for r, n in sorted(reasons.items())) + ")"
        return (
            f"last {seconds:.0f} s: {ok}, {failed} failed{why}, "
            f"sent {_bytes(now.sent - last.sent)}, received {_bytes(now.received - last.received)}"
            f"; {known}"
        )


async def narrate(
    contacts: Callable[[], Iterable[tuple[str, str]]],
    stats: PeerStats | None,
    interval: float,
    poll: float = ROUTING_POLL,
) -> None:
    """Log peers joining and leaving (every ``poll`` s) and a summary every ``interval`` s
    (0: no summaries), until cancelled.

    Args:
        contacts: the routing table now, as ``(peer id hex, address)`` pairs.
        stats: the daemon's counters (None for a bare DHT node).
        interval: seconds between summary lines.
        poll: seconds between looks at the routing table.
    """
    diff = RoutingDiff()
    window = SummaryWindow(stats)
    diff.update(contacts())
    last_summary = time.monotonic()
    while True:
        wait = poll
        if interval > 0:  # wake up for the summary when it is due, not at the next poll
            wait = min(poll, max(last_summary + interval - time.monotonic(), 0.0))
        await asyncio.sleep(wait)
        joined, left = diff.update(contacts())
        for peer, address in joined.items():
            log.info("peer %s joined (%s); %d known", peer[:SHORT_ID], address, len(diff))
        for peer, address in left.items():
            log.info("peer %s left (%s); %d known", peer[:SHORT_ID], address, len(diff))
        now = time.monotonic()
        if interval > 0 and now - last_summary >= interval:
            log.info("%s", window.line(now - last_summary, len(diff)))
            last_summary = now
