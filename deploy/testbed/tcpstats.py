"""A host's TCP counters: what its stack did to carry a round (segments, retransmissions,
loss probes, retransmission timeouts).

Where a round loses a long link is often not in the application at all: a retransmitted
segment costs link time that carries nothing new, and a lost tail costs a round trip (a
loss probe) or more (a retransmission timeout) while the reducer waits for that chunk. A
network namespace keeps its own ``/proc/net/snmp`` and ``/proc/net/netstat``, so the
difference of a host's counters across one round is that round's TCP events on that host
(the benchmarks run one round at a time; the DHT's background traffic adds a few segments).

:func:`parse_counters` is pure; :func:`read_counters` runs ``cat`` inside a host.
"""

from __future__ import annotations

from collections.abc import Mapping

from deploy.testbed.bed import Host

__all__ = ["COUNTERS", "counter_delta", "parse_counters", "read_counters"]

COUNTERS = (
    ("Tcp", "OutSegs"),
    ("Tcp", "RetransSegs"),
    ("TcpExt", "TCPLossProbes"),
    ("TcpExt", "TCPTimeouts"),
    ("TcpExt", "TCPFastRetrans"),
    ("TcpExt", "TCPHystartTrainDetect"),
    ("TcpExt", "TCPHystartDelayDetect"),
)
"""The counters kept, as ``(table, name)`` of ``/proc/net/snmp`` (``Tcp``) and
``/proc/net/netstat`` (``TcpExt``): segments sent, of them retransmitted, tail loss probes
sent, retransmission timeouts, fast retransmits, and CUBIC's slow starts ended early by
HyStart (on an ACK train or a rising delay), after which a window grows by CUBIC's clock,
seconds on a long link."""


def parse_counters(text: str) -> dict[str, int]:
    """The :data:`COUNTERS` found in the concatenated text of ``/proc/net/snmp`` and
    ``/proc/net/netstat`` (each table is a line of names, then a line of values, both
    prefixed ``Table:``). Missing counters are left out."""
    tables: dict[str, dict[str, str]] = {}
    names: dict[str, list[str]] = {}
    for line in text.splitlines():
        table, sep, rest = line.partition(":")
        if not sep:
            continue
        fields = rest.split()
        if table not in names:
            names[table] = fields
        else:
            tables[table] = dict(zip(names.pop(table), fields, strict=False))
    wanted = {}
    for table, name in COUNTERS:
        value = tables.get(table, {}).get(name)
        if value is not None and value.lstrip("-").isdigit():
            wanted[name] = int(value)
    return wanted


def read_counters(host: Host) -> dict[str, int]:
    """``host``'s :data:`COUNTERS` now (its namespace's, all sockets together)."""
    done = host.run(["cat", "/proc/net/snmp", "/proc/net/netstat"])
    return parse_counters(done.stdout)


def counter_delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """``after - before`` for every counter present in both."""
    return {name: after[name] - before[name] for name in after if name in before}
