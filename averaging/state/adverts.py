"""What a donor advertises in the DHT under ``{run}.state``, and which donors a joiner asks
(pure logic: parsing untrusted entries, grouping them by root)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from swarmavg.averaging.state.format import HASH_BYTES
from swarmavg.dht.records import subkey_owner


@dataclass(frozen=True)
class Advertisement:
    """One donor's DHT advertisement of its published state."""

    peer_id: bytes
    address: str
    root: bytes
    version: float
    size: int


def parse_advertisement(subkey: object, value: object) -> Advertisement | None:
    """Parse one DHT entry under ``{run}.state``; ``None`` when malformed."""
    peer_id = subkey_owner(subkey)
    if peer_id is None or not isinstance(value, dict):
        return None
    root, version, size, address = (value.get(k) for k in ("root", "version", "size", "addr"))
    if (
        not isinstance(root, bytes)
        or len(root) != HASH_BYTES
        or isinstance(version, bool)
        or not isinstance(version, int | float)
        or not math.isfinite(version)
        or not isinstance(size, int)
        or size < 0
        or not isinstance(address, str)
        or not 0 < len(address) <= 256
    ):
        return None
    return Advertisement(peer_id, address, root, float(version), size)


def choose_donors(ads: Sequence[Advertisement], exclude: bytes) -> list[list[Advertisement]]:
    """Group advertisements by root, freshest root first (freshness: its newest version)."""
    by_root: dict[bytes, list[Advertisement]] = {}
    for ad in ads:
        if ad.peer_id != exclude:
            by_root.setdefault(ad.root, []).append(ad)
    groups = list(by_root.values())
    groups.sort(key=lambda g: max(a.version for a in g), reverse=True)
    return groups
