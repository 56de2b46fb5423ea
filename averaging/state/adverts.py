"""What a donor advertises in the DHT under ``{run}.state``, and which donors a joiner asks
(pure logic: parsing untrusted entries, ranking them by root).

Which state a joiner takes. Everything in an advertisement is the donor's own
claim: its ``version`` is any finite float it likes, its root names whatever content it
serves. Taking "the freshest version" let one advert with ``version=1e300`` make every
joiner load an attacker's tensors. So a joiner trusts what several donors agree on, not
what one donor claims:

1. **One vote per identity.** Adverts are owned subkeys (signed by their owner), one per
   donor; an owner that shows up twice (say under a ``str`` and a ``bytes`` subkey) is
   counted for neither.
2. **Support first.** Adverts are grouped by root, a content hash independent of version
   and publisher (format.py), and the root held by the most distinct donors comes first.
   Donors of one state after a round publish byte-identical states, hence one root
   (docs/training.md); a forged state has a root of its own, so an attacker must bring as
   many identities advertising it as the best-held honest root has donors.
3. **A version counts only as far as another donor vouches for it.** Between roots of
   equal support the fresher one comes first, where a root's freshness is the second
   highest version among its own donors (its only version when it has one) and, whatever
   that is, at most the second highest version advertised by any donor in the run. A lone
   high claim is thus worth exactly what the runner-up claims: ``version=1e300`` buys
   nothing.
4. **Exact ties are drawn at random**, so that no value an attacker can choose (its
   version, its root bytes) wins them.

What it does not settle: an attacker with more identities advertising one forged root than
the best-held honest root has donors (public runs: ids are free; private runs admit only
credentialed peers), and a run in which every donor holds a state of its own (DiLoCo
states differ by the inner optimizer, docs/training.md): there one attacker ties with the
freshest honest donor and wins the draw half the time, whatever version it claims. With
exactly one honest donor and no attacker the joiner takes that donor's state.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from swarmavg.averaging.state.format import HASH_BYTES
from swarmavg.dht.records import subkey_owner

VOUCHING_DONORS = 2
"""A version counts up to the ``VOUCHING_DONORS``-th highest one advertised (or that of
a root's own donors): the highest value that another donor claims too."""


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


def vouched(versions: Sequence[float]) -> float:
    """The highest version that at least ``VOUCHING_DONORS`` of ``versions`` reach (the
    only one when there is one); ``-inf`` for none."""
    if not versions:
        return -math.inf
    ranked = sorted(versions, reverse=True)
    return ranked[min(VOUCHING_DONORS, len(ranked)) - 1]


def choose_donors(
    ads: Sequence[Advertisement], exclude: bytes, rng: random.Random | None = None
) -> list[list[Advertisement]]:
    """Group advertisements by root, the one to download first (see the module docstring):
    most distinct donors, then freshest as far as other donors vouch, then a draw.

    Args:
        ads: parsed advertisements (one per owned subkey).
        exclude: this peer's id (its own advertisement is not a donor).
        rng: the draw between exact ties (tests pass a seeded one).
    """
    owners = Counter(ad.peer_id for ad in ads)
    unique = [ad for ad in ads if ad.peer_id != exclude and owners[ad.peer_id] == 1]
    ceiling = vouched([ad.version for ad in unique])
    by_root: dict[bytes, list[Advertisement]] = {}
    for ad in unique:
        by_root.setdefault(ad.root, []).append(ad)
    draw = rng or random.Random()
    ranked = [
        (len(group), min(ceiling, vouched([ad.version for ad in group])), draw.random(), group)
        for group in by_root.values()
    ]
    ranked.sort(key=lambda item: item[:3], reverse=True)
    return [group for *_, group in ranked]
