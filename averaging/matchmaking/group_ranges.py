"""How many members of one group may come from one address range (pure logic, no I/O).

Identities are free, networks are not (``dht/ranges.py``): a leader could otherwise fill
its group with its own identities, and a stranger could fill an honest leader's group
with its identities and push honest peers out. So a group holds at most
:func:`max_members_per_range` members from one address range (an IPv4 /24, an IPv6 /48;
every DNS name is one range). A leader counts, for each follower, the range of the
address it signed and the range its ``JoinGroup`` came from; a follower checks the formed
group by the signed addresses (the only ones it can see).

Only public addresses count. Loopback, private and link-local addresses are exempt (as
``dht/ranges.py`` defines them, which counts documentation ranges as private): test
swarms run every peer on 127.0.0.1, a LAN cluster shares one private /24, and relayed or
hole-punched connections arrive through local forwarders; none of them is a network an
outside attacker can put peers in. Client-mode members sign no address: only the leader
sees their range (the source of their request).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

from swarmavg.dht.ranges import address_range, host_range

RANGE_SHARE = 0.25
"""The share of a group's size one address range may hold (rounded up)."""
MIN_PER_RANGE = 2
"""One range may always hold this many members: two volunteers behind one campus NAT."""


def max_members_per_range(group_size: int) -> int:
    """The most members of a group of at most ``group_size`` one public range may hold.

    A protocol constant: the leader admits by it and every follower checks by it, so
    every peer of a run must compute the same value (2 for groups of up to 8, 4 for 16).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return max(MIN_PER_RANGE, math.ceil(group_size * RANGE_SHARE))


def public_range_of_address(address: str | None) -> str | None:
    """The range a ``HOST:PORT`` counts against; ``None`` when empty or local (exempt)."""
    if not address:
        return None
    name, local = address_range(address)
    return None if local else name


def public_range_of_host(host: str) -> str | None:
    """The range a bare host (a request's source) counts against; ``None``: exempt."""
    if not host:
        return None
    name, local = host_range(host)
    return None if local else name


def _counts(members_ranges: Iterable[Iterable[str | None]]) -> collections.Counter[str]:
    """Members per range; a member counts once per range, however many of its addresses
    lie in it."""
    counts: collections.Counter[str] = collections.Counter()
    for ranges in members_ranges:
        counts.update({r for r in ranges if r is not None})
    return counts


def crowded_range(
    members_ranges: Iterable[Iterable[str | None]], group_size: int
) -> tuple[str, int] | None:
    """The first range that holds more members than :func:`max_members_per_range`, with
    its count; ``None`` when every range is within the bound.

    Args:
        members_ranges: for each member, the ranges it counts against.
        group_size: the group's cap (the follower's own ``group_size``).
    """
    bound = max_members_per_range(group_size)
    for name, count in _counts(members_ranges).items():
        if count > bound:
            return name, count
    return None


def admits(
    members_ranges: Iterable[Iterable[str | None]],
    newcomer: Iterable[str | None],
    group_size: int,
) -> str | None:
    """Whether a leader may take one more member: ``None`` when it may, else the range
    that already holds its share.

    Args:
        members_ranges: for each member so far (the leader included), its ranges.
        newcomer: the would-be follower's ranges (signed address, request source).
        group_size: the leader's cap.
    """
    wanted = {r for r in newcomer if r is not None}
    if not wanted:
        return None
    counts = _counts(members_ranges)
    bound = max_members_per_range(group_size)
    for name in sorted(wanted):
        if counts[name] >= bound:
            return name
    return None
