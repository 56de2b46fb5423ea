"""Admission of data-plane frame bodies against byte budgets per account.

A data-plane frame header declares its body's length (up to ``MAX_BODY``, about 4 MiB),
and the body is read straight into a buffer of that size. Allocating on the header's
word alone let 1000 connections that each send one header allocate 4 GB. So a body is
admitted first: its bytes are charged to every account it counts against, each under its
cap, and a connection whose body does not fit stops being read (TCP flow control then
holds the sender) until bodies of others are consumed and free their bytes.

Which accounts a body counts against depends on what is known of its sender
(:class:`Standing`): before the server knows the stream serves a round here (its signed
first message verified, its sender a member of the group), only the connection's address
range, in a small *pending* pool; a round's member is charged to its verified peer id and
its range in the main pool. A header costs an outsider at most its range's small share of
the pending pool, never the bytes of members.

Waiting bodies are admitted in fair-share order, the one whose range holds least first,
so a range at its cap, or many ranges that keep the pool full, do not hold up a range that
holds nothing (the server also evicts the most-represented range's oldest pending body
for it: ``data_server.DataPlaneServer``).

Hosts are grouped as an attacker's addresses are: IPv4 per address, IPv6 per /64 prefix
(one customer's allocation, which anyone with one IPv6 host holds a whole of), and an
IPv4-mapped IPv6 address as its IPv4 address (:func:`host_group`); ranges per
:mod:`swarmavg.dht.ranges`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import ipaddress
from collections.abc import Callable, Mapping, Sequence

__all__ = ["Account", "ByteBudget", "Pool", "Standing", "host_group"]

IPV6_PREFIX = 64

Account = tuple[str, str]
"""``(pool or kind, key)``: what a charge counts against, e.g. ``("range", "203.0.113.0/24")``."""


class Pool(enum.Enum):
    """The two pools of the budget; each account kind belongs to one."""

    PENDING = "pending"
    """Bodies of streams not (yet) serving a round here: small, per range."""
    MEMBER = "member"
    """Bodies of a round's members: per verified peer id and per range."""


class Standing(enum.Enum):
    """What the server knows of a connection's current stream."""

    PENDING = "pending"
    MEMBER = "member"


def host_group(host: str) -> str:
    """The key under which ``host``'s connections are counted (see module doc)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_PREFIX), strict=False))
    return str(address)


@dataclasses.dataclass(frozen=True)
class BudgetCaps:
    """Caps of a :class:`ByteBudget`, in bytes.

    Attributes:
        total: held by everyone at once.
        pending: held by pending bodies (all ranges) at once; the rest of ``total`` is
            the members' whatever outsiders send.
        pending_per_range: held by the pending bodies of one address range; a couple of
            bodies, so a range's honest senders still get their first messages in one
            after the other.
        member_per_range: held by the members of one address range.
        member_per_peer: held by one verified member. An honest member has at most one
            queued stream's worth (4 MiB) plus one body in flight per connection, one
            connection per stream.
    """

    total: int = 256 << 20
    pending: int = 32 << 20
    pending_per_range: int = 9 << 20
    member_per_range: int = 64 << 20
    member_per_peer: int = 16 << 20

    def __post_init__(self) -> None:
        if not 0 < self.pending_per_range <= self.pending <= self.total:
            raise ValueError("need 0 < pending_per_range <= pending <= total")
        if not 0 < self.member_per_peer <= self.total or self.member_per_range <= 0:
            raise ValueError("member caps must be positive and at most the total")


def accounts_for(standing: Standing, range_key: str, peer: str) -> tuple[Account, ...]:
    """The accounts a body of a connection in ``standing`` is charged to."""
    if standing is Standing.PENDING:
        return (("pending", ""), ("pending-range", range_key))
    return (("member-range", range_key), ("member-peer", peer))


class ByteBudget:
    """Bytes held per account and in total, each under its cap; not thread-safe (the
    event loop's callbacks use it).

    A caller that cannot have its bytes now queues a retry with :meth:`wait`; every
    :meth:`release` calls the queued retries, least-holding range first, until each
    got its bytes or cannot proceed.
    """

    def __init__(self, caps: BudgetCaps | None = None) -> None:
        self.caps = caps or BudgetCaps()
        self._cap_of: Mapping[str, int] = {
            "pending": self.caps.pending,
            "pending-range": self.caps.pending_per_range,
            "member-range": self.caps.member_per_range,
            "member-peer": self.caps.member_per_peer,
        }
        self.held = 0
        self._by_account: collections.Counter[Account] = collections.Counter()
        self._waiters: list[tuple[Callable[[], int], Callable[[], bool]]] = []
        self.peak = 0
        """Most bytes held at once so far."""
        self.deferred = 0
        """Admissions that had to wait for bytes to be freed."""
        self.evicted = 0
        """Pending bodies dropped to make room for a range that held less."""
        self._watchers: list[tuple[Callable[[ByteBudget], bool], asyncio.Future[None]]] = []

    @property
    def total(self) -> int:
        return self.caps.total

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

    def held_by(self, account: Account) -> int:
        """Bytes held now by ``account``."""
        return self._by_account[account]

    def pending_by_range(self) -> dict[str, int]:
        """Bytes of pending bodies held now, per range."""
        return {k: n for (kind, k), n in self._by_account.items() if kind == "pending-range"}

    def blocking(self, accounts: Sequence[Account], nbytes: int) -> str | None:
        """The cap that keeps ``nbytes`` more off ``accounts`` now (``"total"`` or an
        account kind), or None when they fit."""
        if self.held + nbytes > self.caps.total:
            return "total"
        for account in accounts:
            if self._by_account[account] + nbytes > self._cap_of[account[0]]:
                return account[0]
        return None

    def try_acquire(self, accounts: Sequence[Account], nbytes: int) -> bool:
        """Charge ``nbytes`` to ``accounts`` if every cap allows it; return whether it did."""
        if self.blocking(accounts, nbytes) is not None:
            return False
        self.charge(accounts, nbytes)
        return True

    def charge(self, accounts: Sequence[Account], nbytes: int) -> None:
        """Charge ``nbytes`` to ``accounts`` whatever the caps (bytes already held under
        other accounts moving over: they were admitted once)."""
        self.held += nbytes
        for account in accounts:
            self._by_account[account] += nbytes
        self.peak = max(self.peak, self.held)
        self._changed()

    def release(self, accounts: Sequence[Account], nbytes: int) -> None:
        """Give back ``nbytes`` charged to ``accounts``, then let waiting callers retry."""
        if nbytes <= 0:
            return
        self.held -= nbytes
        for account in accounts:
            self._by_account[account] -= nbytes
            if self._by_account[account] <= 0:
                del self._by_account[account]
        self.retry_waiting()
        self._changed()

    def retry_waiting(self) -> None:
        """Let the queued retries try again: the least-holding first (fair share), one
        pass, so a caller at its own cap does not hold up the others behind it."""
        if not self._waiters:
            return
        waiters = sorted(self._waiters, key=lambda w: w[0]())
        self._waiters = []
        for waiter in waiters:
            if not waiter[1]():
                self._waiters.append(waiter)

    def wait(self, retry: Callable[[], bool], holding: Callable[[], int]) -> None:
        """Queue ``retry`` (it returns whether it got its bytes or gave up waiting);
        ``holding`` says what its range holds now (the fair-share order)."""
        self.deferred += 1
        self._waiters.append((holding, retry))
        self._changed()

    def forget(self, retry: Callable[[], bool]) -> None:
        """Remove a queued ``retry`` (its connection closed)."""
        self._waiters = [w for w in self._waiters if w[1] is not retry]
