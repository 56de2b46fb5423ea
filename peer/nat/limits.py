"""The relay's bounds, as pure bookkeeping (no I/O): connections and bytes per source.

A relay is a public peer lending its bandwidth, so what one source can take is bounded:

- reservations: at most ``max_reservations`` NATed peers at once;
- connections: at most ``max_connections`` relayed connections at once, at most
  ``max_connections_per_source`` from one dialer address range and at most
  ``max_connections_per_reservation`` to one reserved peer;
- bytes: every relayed byte (both directions) is charged to the dialer's range in a token
  bucket of ``bytes_per_second_per_source`` (burst ``burst_bytes``) and to a relay-wide bucket
  of ``bytes_per_second``. A source over its budget is slowed down (the splice stops reading
  from it until the bucket refills: TCP back-pressure), never cut off and never buffered.

Sources are address ranges (:func:`swarmavg.dht.ranges.host_range`: IPv4 /24, IPv6 /48), so
many connections from one network share one budget.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from swarmavg.dht.ranges import host_range

MiB = 1 << 20
K = TypeVar("K", str, bytes)


@dataclass(frozen=True)
class RelayLimits:
    """What a relay lends at most; see the module docstring. 0 bytes per second: no limit."""

    max_reservations: int = 64
    max_connections: int = 512
    max_connections_per_source: int = 32
    max_connections_per_reservation: int = 128
    bytes_per_second_per_source: float = 32.0 * MiB
    bytes_per_second: float = 128.0 * MiB
    burst_bytes: float = 4.0 * MiB
    max_sources: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "max_reservations",
            "max_connections",
            "max_connections_per_source",
            "max_connections_per_reservation",
            "max_sources",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.bytes_per_second_per_source < 0 or self.bytes_per_second < 0:
            raise ValueError("byte rates must be >= 0 (0: no limit)")
        if self.burst_bytes < 64 * 1024:
            raise ValueError("burst_bytes must be at least 64 KiB")


def source_of(host: str) -> str:
    """The budget a dialer's bytes and connections count against: its address range."""
    return host_range(host)[0]


class ByteBucket:
    """``rate`` bytes per second up to ``burst``. :meth:`charge` takes bytes now (the balance
    may go negative) and says how long to wait before the next read: the debt over the rate."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.stamp = now

    def charge(self, nbytes: int, now: float) -> float:
        """Take ``nbytes``; return the seconds to wait before reading more (0: none)."""
        if self.rate <= 0:
            return 0.0
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - nbytes
        self.stamp = now
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class RelayBudget:
    """Connection counts and byte buckets of one relay; see the module docstring.

    Args:
        limits: the bounds.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, limits: RelayLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.connections = 0
        self._per_source: dict[str, int] = {}
        self._per_reservation: dict[bytes, int] = {}
        self._buckets: OrderedDict[str, ByteBucket] = OrderedDict()
        self._total = ByteBucket(limits.bytes_per_second, limits.burst_bytes * 4, clock())
        self.refused = 0
        self.relayed_bytes = 0

    def open(self, source: str, reservation: bytes) -> str | None:
        """Count a new relayed connection from ``source`` to ``reservation``; None when
        admitted, else why not (the connection is then closed unanswered)."""
        limits = self.limits
        reason = None
        if self.connections >= limits.max_connections:
            reason = f"the relay carries {limits.max_connections} connections already"
        elif self._per_source.get(source, 0) >= limits.max_connections_per_source:
            reason = f"{source} has {limits.max_connections_per_source} relayed connections"
        elif self._per_reservation.get(reservation, 0) >= limits.max_connections_per_reservation:
            reason = (
                f"peer {reservation.hex()[:12]} has "
                f"{limits.max_connections_per_reservation} relayed connections"
            )
        if reason is not None:
            self.refused += 1
            return reason
        self.connections += 1
        self._per_source[source] = self._per_source.get(source, 0) + 1
        self._per_reservation[reservation] = self._per_reservation.get(reservation, 0) + 1
        return None

    def close(self, source: str, reservation: bytes) -> None:
        """Undo one :meth:`open` that was admitted."""
        self.connections -= 1
        _decrement(self._per_source, source)
        _decrement(self._per_reservation, reservation)

    def charge(self, source: str, nbytes: int) -> float:
        """Charge ``nbytes`` relayed for ``source``; the seconds to pause its reads."""
        now = self.clock()
        self.relayed_bytes += nbytes
        bucket = self._buckets.get(source)
        if bucket is None:
            limits = self.limits
            bucket = ByteBucket(limits.bytes_per_second_per_source, limits.burst_bytes, now)
            self._buckets[source] = bucket
            while len(self._buckets) > limits.max_sources:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(source)
        return max(bucket.charge(nbytes, now), self._total.charge(nbytes, now))

    def per_source(self, source: str) -> int:
        """Relayed connections open from ``source`` now."""
        return self._per_source.get(source, 0)


def _decrement(table: dict[K, int], key: K) -> None:
    left = table[key] - 1
    if left:
        table[key] = left
    else:
        del table[key]
