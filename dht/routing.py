"""The routing table: k-buckets over the 160-bit keyspace (paper sections 2.2, 2.4 and 4.2).

Pure and synchronous: the node's async layer feeds it contacts it has heard from and tells it
which contacts failed. Rules and where they come from:

* A bucket covers an id range and holds at most ``k`` contacts, least-recently seen first
  (paper 2.2).
* A full bucket is split when its range contains our own id (paper 2.4), or when its depth is
  not a multiple of ``b`` (paper 4.2: keep all valid contacts in a subtree of at least k nodes
  even off our own branch; b=5 as in the paper's accelerated lookups and bmuller/kademlia).
* A newcomer for a full bucket that cannot split goes to the bucket's replacement cache and the
  least-recently seen contact is returned for the caller to ping. Only when that ping fails is
  the contact removed, and the newest replacement takes its place (paper 2.2 and 4.1): live old
  contacts are never evicted for new ones.
* Against eclipse attacks (ids are cheap, networks are not): one bucket holds at most
  ``per_range`` contacts of one address range (IPv4 /24, IPv6 /48; ranges.py), and its
  replacement cache at most ``per_range`` more. A contact over the limit is refused; an
  address change into a full range keeps the old address. Local ranges (loopback, private)
  are exempt unless ``limit_local``.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from swarmavg.dht.ids import ID_BITS, MAX_ID, id_to_int
from swarmavg.dht.ranges import limited_range, split_host


@dataclass(eq=False, slots=True)
class Contact:
    """A peer we can reach: its id, address and when we last heard from it."""

    peer_id: bytes
    address: str
    id_int: int = field(init=False)
    last_seen: float = 0.0
    failures: int = 0  # failed requests in a row (paper 4.1)

    def __post_init__(self) -> None:
        self.id_int = id_to_int(self.peer_id)

    def __repr__(self) -> str:
        return f"Contact({self.peer_id.hex()[:8]}@{self.address})"


class KBucket:
    """Contacts whose ids lie in ``[lower, upper)``; LRS first; plus a replacement cache."""

    __slots__ = (
        "contacts",
        "k",
        "last_lookup",
        "limit_local",
        "lower",
        "per_range",
        "replacements",
        "upper",
    )

    def __init__(
        self, lower: int, upper: int, k: int, per_range: int = 0, limit_local: bool = False
    ) -> None:
        self.lower, self.upper, self.k = lower, upper, k
        self.per_range, self.limit_local = per_range, limit_local
        self.contacts: OrderedDict[bytes, Contact] = OrderedDict()
        self.replacements: OrderedDict[bytes, Contact] = OrderedDict()
        self.last_lookup = time.monotonic()

    @property
    def depth(self) -> int:
        """Depth in the binary tree of id prefixes: the length of the shared prefix."""
        return ID_BITS - (self.upper - self.lower).bit_length() + 1

    def covers(self, id_int: int) -> bool:
        return self.lower <= id_int < self.upper

    def is_full(self) -> bool:
        return len(self.contacts) >= self.k

    def range_has_room(
        self, pool: OrderedDict[bytes, Contact], address: str, exclude: bytes = b""
    ) -> bool:
        """Whether ``pool`` (contacts or replacements) can take one more of ``address``'s range."""
        if self.per_range <= 0:
            return True
        name = limited_range(split_host(address), self.limit_local)
        if name is None:
            return True
        same = sum(
            1
            for peer_id, c in pool.items()
            if peer_id != exclude and limited_range(split_host(c.address), self.limit_local) == name
        )
        return same < self.per_range

    def promote(self) -> bool:
        """Move the newest replacement whose range has room into the contacts."""
        for peer_id in reversed(self.replacements):
            contact = self.replacements[peer_id]
            if self.range_has_room(self.contacts, contact.address):
                del self.replacements[peer_id]
                self.contacts[peer_id] = contact
                return True
        return False

    def split(self) -> tuple[KBucket, KBucket]:
        middle = (self.lower + self.upper) // 2
        low, high = (
            KBucket(lo, hi, self.k, self.per_range, self.limit_local)
            for lo, hi in ((self.lower, middle), (middle, self.upper))
        )
        for bucket in (low, high):
            bucket.last_lookup = self.last_lookup
        for source, attr in ((self.contacts, "contacts"), (self.replacements, "replacements")):
            for peer_id, contact in source.items():
                target = low if contact.id_int < middle else high
                getattr(target, attr)[peer_id] = contact
        for bucket in (low, high):  # a split may leave room: promote replacements
            while not bucket.is_full() and bucket.promote():
                pass
        return low, high


class RoutingTable:
    """k-buckets around our own id.

    Args:
        own_id: our 20-byte peer id (never stored in the table).
        k: bucket size, also the replication parameter of the paper.
        b: the paper's section 4.2 relaxation: buckets off our own branch still split while
            their depth is not a multiple of ``b``.
        per_range: most contacts of one address range per bucket (and per replacement
            cache); 0: no limit.
        limit_local: apply ``per_range`` to loopback and private ranges too.
    """

    def __init__(
        self,
        own_id: bytes,
        k: int = 20,
        b: int = 5,
        per_range: int = 2,
        limit_local: bool = False,
    ) -> None:
        if k < 1 or b < 1 or per_range < 0:
            raise ValueError("k and b must be positive, per_range not negative")
        self.own_id = own_id
        self.own_int = id_to_int(own_id)
        self.k, self.b = k, b
        self.buckets: list[KBucket] = [KBucket(0, MAX_ID, k, per_range, limit_local)]
        self._size = 0
        self.refused_by_range = 0  # contacts (or address changes) refused by the range limit
        self.refused: frozenset[bytes] = frozenset()
        """Peer ids never taken into the table (a private run's revoked peers, see
        :meth:`refuse`); lookups skip them too (dht/traversal.py)."""

    def __len__(self) -> int:
        return self._size

    def __contains__(self, peer_id: object) -> bool:
        return isinstance(peer_id, bytes) and self.get(peer_id) is not None

    def __iter__(self) -> Iterator[Contact]:
        for bucket in self.buckets:
            yield from bucket.contacts.values()

    def bucket_index(self, id_int: int) -> int:
        """Index of the bucket covering ``id_int`` (buckets are sorted and contiguous)."""
        lo, hi = 0, len(self.buckets) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if id_int < self.buckets[mid].upper:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def get(self, peer_id: bytes) -> Contact | None:
        if len(peer_id) != 20:
            return None
        bucket = self.buckets[self.bucket_index(id_to_int(peer_id))]
        return bucket.contacts.get(peer_id)

    def add_or_update(self, contact: Contact, now: float | None = None) -> Contact | None:
        """Record that we heard from ``contact``.

        Returns:
            ``None`` when the contact is now in the table (new, refreshed or after a split), or
            when the range limit refused it (counted in ``refused_by_range``). Otherwise its
            bucket is full and cannot split: the contact went to the replacement
            cache and the bucket's least-recently seen contact is returned; the caller should
            ping it and call :meth:`remove` if the ping fails (paper 2.2).
        """
        if contact.peer_id == self.own_id or contact.peer_id in self.refused:
            return None
        contact.last_seen = time.monotonic() if now is None else now
        while True:
            index = self.bucket_index(contact.id_int)
            bucket = self.buckets[index]
            existing = bucket.contacts.get(contact.peer_id)
            if existing is not None:
                if existing.address != contact.address:
                    if bucket.range_has_room(bucket.contacts, contact.address, contact.peer_id):
                        existing.address = contact.address
                    else:
                        self.refused_by_range += 1  # keep the old, range-compliant address
                existing.last_seen = contact.last_seen
                existing.failures = 0
                bucket.contacts.move_to_end(contact.peer_id)
                return None
            if not bucket.range_has_room(bucket.contacts, contact.address):
                # the range is full in this bucket: it may wait as a replacement, if the
                # replacement cache has room for its range too
                bucket.replacements.pop(contact.peer_id, None)
                if bucket.range_has_room(bucket.replacements, contact.address):
                    bucket.replacements[contact.peer_id] = contact
                    while len(bucket.replacements) > bucket.k:
                        bucket.replacements.popitem(last=False)
                self.refused_by_range += 1
                return None
            if not bucket.is_full():
                bucket.contacts[contact.peer_id] = contact
                bucket.replacements.pop(contact.peer_id, None)
                self._size += 1
                return None
            if bucket.covers(self.own_int) or bucket.depth % self.b != 0:
                self.buckets[index : index + 1] = bucket.split()
                self._size = sum(len(b.contacts) for b in self.buckets)
                continue
            bucket.replacements.pop(contact.peer_id, None)
            if bucket.range_has_room(bucket.replacements, contact.address):
                bucket.replacements[contact.peer_id] = contact
                while len(bucket.replacements) > bucket.k:
                    bucket.replacements.popitem(last=False)
            else:
                self.refused_by_range += 1
            return next(iter(bucket.contacts.values()))

    def refuse(self, peer_ids: frozenset[bytes]) -> None:
        """Drop ``peer_ids`` from the table and its replacement caches, and never take them in
        again (replaces the previous set)."""
        self.refused = peer_ids
        for peer_id in peer_ids:
            self.remove(peer_id)

    def remove(self, peer_id: bytes) -> bool:
        """Drop a contact that failed to answer; promote the newest replacement (paper 4.1).

        Returns whether the contact was in the table.
        """
        if len(peer_id) != 20:
            return False
        bucket = self.buckets[self.bucket_index(id_to_int(peer_id))]
        bucket.replacements.pop(peer_id, None)
        if bucket.contacts.pop(peer_id, None) is None:
            return False
        self._size -= 1
        if bucket.promote():
            self._size += 1
        return True

    def record_failure(self, peer_id: bytes, stale_after: int) -> bool:
        """A request to ``peer_id`` failed; return whether the contact was dropped.

        Paper 4.1: a contact that fails is replaced at once when its bucket has a replacement
        waiting; otherwise it is kept until it fails ``stale_after`` times in a row, so that
        one slow answer does not empty a sparse table (a node that just joined through a
        single peer would otherwise lose its only contact).
        """
        if len(peer_id) != 20:
            return False
        bucket = self.buckets[self.bucket_index(id_to_int(peer_id))]
        contact = bucket.contacts.get(peer_id)
        if contact is None:
            bucket.replacements.pop(peer_id, None)
            return False
        contact.failures += 1
        if bucket.replacements or contact.failures >= stale_after:
            return self.remove(peer_id)
        return False

    def nearest(self, target: int, k: int, exclude: Iterable[bytes] = ()) -> list[Contact]:
        """The ``k`` known contacts nearest to ``target`` by XOR distance, nearest first."""
        excluded = set(exclude)
        candidates = (c for c in self if c.peer_id not in excluded)
        return heapq.nsmallest(k, candidates, key=lambda c: c.id_int ^ target)

    def mark_lookup(self, target: int, now: float | None = None) -> None:
        """Note that a lookup for ``target`` ran, so its bucket needs no refresh (paper 2.3)."""
        self.buckets[self.bucket_index(target)].last_lookup = (
            time.monotonic() if now is None else now
        )

    def stale_buckets(self, max_age: float, now: float | None = None) -> list[KBucket]:
        """Buckets without a lookup in the last ``max_age`` seconds (to refresh, paper 2.3)."""
        now = time.monotonic() if now is None else now
        return [b for b in self.buckets if now - b.last_lookup > max_age]
