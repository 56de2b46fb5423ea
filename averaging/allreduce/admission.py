"""Admission of data-plane frame bodies against a per-host and a global byte budget.

A data-plane frame header declares its body's length (up to ``MAX_BODY``, about 4 MiB),
and the body is read straight into a buffer of that size. Allocating on the header's
word alone let 1000 connections that each send one header allocate 4 GB. So a
body is admitted first: its bytes are charged to the connection's host and to the whole
server, and a connection whose body does not fit stops being read (TCP flow control then
holds the sender) until bodies of others are consumed and free their bytes.

Hosts are grouped as an attacker's addresses are: IPv4 per address, IPv6 per /64 prefix
(one customer's allocation, which anyone with one IPv6 host holds a whole of), and an
IPv4-mapped IPv6 address as its IPv4 address.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
from collections.abc import Callable

__all__ = ["ByteBudget", "host_group"]

IPV6_PREFIX = 64


def host_group(host: str) -> str:
    """The key under which ``host``'s connections and bytes are counted (see module doc)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_PREFIX), strict=False))
    return str(address)


class ByteBudget:
    """Bytes held per host group and in total, each under its cap; not thread-safe (the
    event loop's callbacks use it).

    A caller that cannot have its bytes now queues a retry with :meth:`wait`; every
    :meth:`release` calls the queued retries in order until one of them cannot proceed.
    """

    def __init__(self, total: int, per_host: int) -> None:
        """Args:
        total: bytes that may be held at once by all hosts together.
        per_host: bytes one host group may hold at once.
        """
        if not 0 < per_host <= total:
            raise ValueError("need 0 < per_host <= total")
        self.total = total
        self.per_host = per_host
        self.held = 0
        self._by_host: collections.Counter[str] = collections.Counter()
        self._waiters: collections.deque[Callable[[], bool]] = collections.deque()
        self.peak = 0
        """Most bytes held at once so far."""
        self.deferred = 0
        """Admissions that had to wait for bytes to be freed."""
        self._watchers: list[tuple[Callable[[ByteBudget], bool], asyncio.Future[None]]] = []

    async def wait_until(self, predicate: Callable[[ByteBudget], bool]) -> None:
        """Wait until ``predicate(self)`` holds (tests and benchmarks observe an attack
        with it; wrap it in a timeout). Call it inside the running loop."""
        if predicate(self):
            return
        future = asyncio.get_running_loop().create_future()
        self._watchers.append((predicate, future))
        try:
            await future
        finally:
            self._watchers = [w for w in self._watchers if w[1] is not future]

    def _changed(self) -> None:
        for predicate, future in self._watchers:
            if not future.done() and predicate(self):
                future.set_result(None)

    def held_by(self, group: str) -> int:
        """Bytes held now by host group ``group``."""
        return self._by_host[group]

    def try_acquire(self, group: str, nbytes: int) -> bool:
        """Charge ``nbytes`` to ``group`` if both caps allow it; return whether it did."""
        if self.held + nbytes > self.total or self._by_host[group] + nbytes > self.per_host:
            return False
        self.held += nbytes
        self._by_host[group] += nbytes
        self.peak = max(self.peak, self.held)
        self._changed()
        return True

    def release(self, group: str, nbytes: int) -> None:
        """Give back ``nbytes`` charged to ``group``, then let waiting callers retry."""
        if nbytes <= 0:
            return
        self.held -= nbytes
        self._by_host[group] -= nbytes
        if self._by_host[group] <= 0:
            del self._by_host[group]
        # A retry that still does not fit goes to the back; one full pass at most, so a
        # host at its own cap does not hold up the others behind it.
        for _ in range(len(self._waiters)):
            retry = self._waiters.popleft()
            if not retry():
                self._waiters.append(retry)
        self._changed()

    def wait(self, retry: Callable[[], bool]) -> None:
        """Queue ``retry`` (it returns whether it got its bytes or gave up waiting)."""
        self.deferred += 1
        self._waiters.append(retry)
        self._changed()

    def forget(self, retry: Callable[[], bool]) -> None:
        """Remove a queued ``retry`` (its connection closed)."""
        with contextlib.suppress(ValueError):
            self._waiters.remove(retry)
