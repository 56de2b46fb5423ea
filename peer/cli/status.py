"""Human-readable rendering of a daemon's status (``swarmavg status`` without ``--json``)."""

from __future__ import annotations

import ipaddress
from typing import Any


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - unreachable


def _bandwidth(status: dict[str, Any]) -> str:
    """``250.0 MB/s (set)``, or how the measured figure came about."""
    value = f"{status['bandwidth']:.1f} MB/s"
    if not status["bandwidth_measured"]:
        return f"{value} (set)"
    samples = int(status["bandwidth_samples"])
    if samples == 0:
        return f"not measured yet (starting value {value} until a round is measured)"
    return f"{value} (measured from {samples} round{'s' if samples != 1 else ''})"


def _rounds_done(status: dict[str, Any]) -> str:
    done, partial = int(status["rounds_done"]), int(status.get("rounds_partial", 0))
    return f"{done} ({done - partial} complete, {partial} partial)" if partial else str(done)


def _table(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {value}" for name, value in rows]


def format_dht_status(status: dict[str, Any]) -> str:
    """A bare DHT node's figures (``swarmavg dht --control``): it has no rounds."""
    return "\n".join(
        _table(
            [
                ("kind", "bare DHT node (swarmavg dht): no averaging"),
                ("peer id", status["peer_id"]),
                ("run", status["run_id"]),
                ("address", status["address"] or "-"),
                ("control", status["control"]),
                ("routing table", f"{status['known_peers']} peers"),
                ("DHT size estimate", f"{status['dht_size_estimate']:.0f}"),
                ("stored records", str(status["stored_records"])),
                ("uptime", f"{status['uptime']:.0f} s"),
                ("version", status["version"]),
            ]
        )
    )


def _address_scope(address: str) -> str:
    """Who can dial ``address``: "public", or the narrower scope its host says."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return "local only: a loopback address, for peers on this machine"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return "public"  # a host name: taken as given
    if ip.is_loopback:
        return "local only: a loopback address, for peers on this machine"
    if ip.is_private or ip.is_link_local:
        return "on this network only: a private address"
    return "public"


def reachability(status: dict[str, Any]) -> str:
    """How others reach this peer, in words: "public", "relayed through HOST:PORT (...)"."""
    kind = status.get("reachability") or "unknown"
    seen = f", seen as {status['observed_host']}" if status.get("observed_host") else ""
    if kind == "relayed":
        moves = int(status.get("relay_moves") or 0)
        moved = f", moved {moves} time{'s' if moves != 1 else ''}" if moves else ""
        relay_id = str(status.get("relay_id") or "")[:12]
        direct = list(status.get("direct_peers") or [])
        punched = f"; direct to {', '.join(direct)} after punching" if direct else ""
        return (
            f"behind NAT, relayed through {status.get('relay')} ({relay_id}{seen}{moved}){punched}"
        )
    if kind == "public":
        relayed = int(status.get("relaying_reservations") or 0)
        relaying = (
            f"; relaying for {relayed} peer{'s' if relayed != 1 else ''}, "
            f"{_bytes(int(status.get('relayed_bytes') or 0))} so far"
            if relayed or status.get("relayed_bytes")
            else ""
        )
        scope = _address_scope(str(status.get("address") or ""))
        return f"{scope} (dialled directly{seen}){relaying}"
    if kind == "client":
        return "client mode (no incoming connections)"
    return "not checked (no initial peer could dial back): announced as configured"


def trainer_text(trainer: dict[str, Any]) -> str:
    """``run 'r' (collaborative), alone for 75 s: no other trainer of its run``."""
    text = f"run {trainer['run']!r} ({trainer['method']})"
    if trainer["alone"] > 0:
        return (
            f"{text}, alone for {trainer['alone']:.0f} s: no other trainer of its run "
            "(swarmavg peers lists the training runs)"
        )
    return f"{text}, training with others"


def format_status(status: dict[str, Any]) -> str:
    """A small table of the figures ``client.status()`` returns."""
    if status.get("kind") == "dht":
        return format_dht_status(status)
    known = int(status["known_peers"])
    rows = [
        ("peer id", status["peer_id"]),
        ("run", status["run_id"]),
        ("address", status["address"] or "(client mode: no incoming connections)"),
        ("reachable", reachability(status)),
        ("control", status["control"]),
        ("peers", f"{known + 1} ({known} known + this one)"),
        ("DHT size estimate", f"{status['dht_size_estimate']:.0f}"),
        ("stored records", str(status.get("stored_records", 0))),
        ("bandwidth", _bandwidth(status)),
        ("rounds done", _rounds_done(status)),
        ("rounds failed", str(status["rounds_failed"])),
        ("bytes sent", _bytes(status["bytes_sent"])),
        ("bytes received", _bytes(status["bytes_received"])),
        ("uptime", f"{status['uptime']:.0f} s"),
        ("version", status["version"]),
    ]
    rows += [("trainer", trainer_text(t)) for t in status.get("trainers") or []]
    width = max(len(name) for name, _ in rows)
    lines = _table(rows)
    if status["failures"]:
        lines.append("failures:")
        lines += [
            f"  {reason:<{width - 2}}  {count}" for reason, count in status["failures"].items()
        ]
    if status["codecs"]:
        lines.append("")
        lines.append(f"{'codec':<20} {'rounds':>7} {'sent':>12} {'received':>12} {'seconds':>9}")
        for name, c in status["codecs"].items():
            lines.append(
                f"{name:<20} {c['rounds']:>7} {_bytes(c['bytes_sent']):>12} "
                f"{_bytes(c['bytes_received']):>12} {c['seconds']:>9.2f}"
            )
    return "\n".join(lines)
