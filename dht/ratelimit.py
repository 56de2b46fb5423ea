"""Requests per second per source: token buckets keyed by peer id and by address range.

One small reusable piece: the DHT service (protocol.py) and the averaging service's entry
points (averaging/service.py) each own a :class:`RateLimiter` and ask it to :meth:`admit`
every request before doing any work for it. A refused request is answered with
``RESOURCE_EXHAUSTED`` and the limiter's reason.

Two keys per request, because ids are free and networks are not: the sender's peer id (one
identity cannot flood), and the address range it connects from (ranges.py: many identities
on one /24 share one, larger, budget). Local ranges (loopback, private) have no range budget
unless the caller says so (it passes the range name, or None for an exempt range: the DHT
follows ``DHTConfig.limit_local_ranges``), so that test swarms of hundreds of nodes on
127.0.0.1 work; the per-id budget still applies to them.

Memory is bounded: at most ``max_sources`` buckets per key kind, least recently used dropped
first (a dropped bucket comes back full, which only ever favours the sender).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bytes, str)


@dataclass(frozen=True)
class RateLimits:
    """Token-bucket settings for one service.

    Attributes:
        per_source_rate: requests per second one peer id may send, sustained (0: no limit).
        per_source_burst: requests one peer id may send at once after being quiet.
        per_range_factor: an address range gets this many times the per-id rate and burst.
        max_sources: buckets kept per key kind (ids, ranges).
    """

    per_source_rate: float = 1000.0
    per_source_burst: float = 4000.0
    per_range_factor: float = 4.0
    max_sources: int = 16384

    def __post_init__(self) -> None:
        if self.per_source_rate < 0 or self.per_source_burst < 1:
            raise ValueError("per_source_rate must be >= 0 and per_source_burst >= 1")
        if self.per_range_factor < 1 or self.max_sources < 1:
            raise ValueError("per_range_factor and max_sources must be >= 1")


class TokenBucket:
    """``rate`` tokens per second up to ``burst``; each request takes one."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.stamp = now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class RateLimiter:
    """Admits or refuses requests by sender id and address range; see the module docstring.

    Args:
        limits: the settings.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._ids: OrderedDict[bytes, TokenBucket] = OrderedDict()
        self._ranges: OrderedDict[str, TokenBucket] = OrderedDict()
        self.refused = 0

    def _bucket(
        self, table: OrderedDict[K, TokenBucket], key: K, scale: float, now: float
    ) -> TokenBucket:
        bucket = table.get(key)
        if bucket is None:
            limits = self.limits
            rate, burst = limits.per_source_rate * scale, limits.per_source_burst * scale
            bucket = table[key] = TokenBucket(rate, burst, now)
            while len(table) > limits.max_sources:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
        return bucket

    def admit(self, peer_id: bytes, range_name: str | None) -> str | None:
        """Take one request from ``peer_id`` connecting from address range ``range_name``
        (:func:`~swarmavg.dht.ranges.limited_range`; None: no range budget applies).

        Returns:
            None when admitted, else why not (for the ``RESOURCE_EXHAUSTED`` details).
        """
        limits = self.limits
        if limits.per_source_rate <= 0:
            return None
        now = self.clock()
        if range_name is not None and not self._bucket(
            self._ranges, range_name, limits.per_range_factor, now
        ).take(now):
            self.refused += 1
            return (
                f"too many requests from address range {range_name} (more than "
                f"{limits.per_source_rate * limits.per_range_factor:.0f}/s); slow down"
            )
        if not self._bucket(self._ids, peer_id, 1.0, now).take(now):
            self.refused += 1
            return (
                f"too many requests from peer {peer_id.hex()[:16]} (more than "
                f"{limits.per_source_rate:.0f}/s sustained, {limits.per_source_burst:.0f} "
                "at once); slow down"
            )
        return None
