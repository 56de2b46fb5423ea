"""Who holds a donor's upload slots (pure logic).

A donor serves at most ``max_uploads`` download streams at once. Without a per-source bound, any
source could take all of them: one outsider opening 8 streams and reading slowly made
every honest joiner wait for ``STATE_BUSY`` to end (20 s seen, against 0.1 s). Now a slot
is also counted against the requester's verified identity and against the address range
its connection comes from (:mod:`swarmavg.dht.ranges`: an IPv4 /24, an IPv6 /48), each
with its own cap below ``max_uploads``: one identity or one network holds at most its
share, and the rest stay free for everyone else. Ids are free, networks are not, hence
the two counts; local ranges (loopback, private) are exempt, as in the averaging service's
rate limits (test swarms run every peer on 127.0.0.1, a LAN cluster shares one private
range).
"""

from __future__ import annotations

from collections import Counter

PEER_SHARE = 2
"""Upload slots one requesting identity may hold: a joiner asks each donor one batch at a
time, so two leave room for a daemon whose two trainers load at once."""


def range_share(total: int) -> int:
    """Upload slots the peers of one address range may hold together: half of ``total``."""
    return max(1, total // 2)


class UploadSlots:
    """Upload slots held per identity and per address range, within a total.

    Args:
        total: the donor's ``max_uploads``.
        per_identity: slots one identity may hold (:data:`PEER_SHARE`).
        per_range: slots one address range may hold (None: :func:`range_share`).
    """

    def __init__(
        self, total: int, per_identity: int = PEER_SHARE, per_range: int | None = None
    ) -> None:
        self.total = total
        self.per_identity = per_identity
        self.per_range = range_share(total) if per_range is None else per_range
        if min(self.total, self.per_identity, self.per_range) < 1:
            raise ValueError("upload slot limits must be >= 1")
        self.held = 0
        self._identities: Counter[bytes] = Counter()
        self._ranges: Counter[str] = Counter()

    def acquire(self, identity: bytes, range_name: str | None) -> str | None:
        """Take a slot for ``identity`` connecting from ``range_name`` (None: an exempt or
        unknown range); return why not (``None``: taken, :meth:`release` it later)."""
        if self.held >= self.total:
            return f"busy: all {self.total} upload slots are taken"
        if self._identities[identity] >= self.per_identity:
            return f"busy: this peer holds {self.per_identity} upload slots already"
        if range_name is not None and self._ranges[range_name] >= self.per_range:
            return f"busy: peers from {range_name} hold {self.per_range} upload slots already"
        self.held += 1
        self._identities[identity] += 1
        if range_name is not None:
            self._ranges[range_name] += 1
        return None

    def release(self, identity: bytes, range_name: str | None) -> None:
        """Give back a slot :meth:`acquire` granted."""
        self.held -= 1
        self._identities[identity] -= 1
        if self._identities[identity] <= 0:
            del self._identities[identity]
        if range_name is not None:
            self._ranges[range_name] -= 1
            if self._ranges[range_name] <= 0:
                del self._ranges[range_name]

    def holding(self, identity: bytes) -> int:
        """Slots ``identity`` holds now."""
        return self._identities[identity]
