"""Storage quotas per source: bytes, records, and subkeys per key that one source may hold.

A *source* is who asked us to store a record: the sender's peer id and the address range
(ranges.py) its request came from. Ids are free, networks are not, so each range holds
``per_range_factor`` times what one id may hold, and a sybil cluster on one /24 shares that.
Local ranges (loopback, private) have no range quota unless ``DHTConfig.limit_local_ranges``,
for the same reason as the routing table's range limit: test swarms run hundreds of nodes on
127.0.0.1 (the caller leaves ``Source.range_name`` None for an exempt range).

Records this node stores itself (its own stores, republishing) have no source and no quota.
When a record is replaced, its bytes and subkey count move from the old record's source to
the new one's; an identical re-store changes nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class StorageQuotas:
    """What one source may hold on this node.

    Attributes:
        max_bytes_per_source: stored bytes (key + subkey + value) per peer id; None: an
            eighth of the node's ``DHTLimits.max_stored_bytes`` (32 MiB of 256 MiB).
        max_records_per_source: stored records per peer id.
        max_subkeys_per_source: subkeys one peer id may hold under one key, so that one
            identity cannot fill a key's ``DHTLimits.max_subkeys_per_key`` and leave honest
            writers FULL (a matchmaking key holds one declaration per declarer).
        per_range_factor: an address range may hold this many times the per-id quotas.
    """

    max_bytes_per_source: int | None = None
    max_records_per_source: int = 100_000
    max_subkeys_per_source: int = 256
    per_range_factor: int = 4

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is not None and value < 1:
                raise ValueError(f"StorageQuotas.{name} must be >= 1, got {value}")


@dataclass(frozen=True, slots=True)
class Source:
    """Who stored a record: a peer id and the address range it connected from (None when
    the range is exempt or unknown)."""

    peer_id: bytes
    range_name: str | None = None


_Holder = tuple[str, bytes | str]  # ("id", peer id) or ("range", range name)


class QuotaLedger:
    """Usage per holder (peer id and address range) and the checks against the quotas."""

    def __init__(self, quotas: StorageQuotas, max_stored_bytes: int) -> None:
        self.quotas = quotas
        self.max_bytes = quotas.max_bytes_per_source or max(1, max_stored_bytes // 8)
        self._bytes: Counter[_Holder] = Counter()
        self._records: Counter[_Holder] = Counter()
        self._subkeys: Counter[tuple[bytes, _Holder]] = Counter()  # (key id, holder)
        self.refused = 0

    @staticmethod
    def _holders(source: Source) -> list[tuple[_Holder, bool]]:
        """(holder, is a range) pairs that ``source`` counts against."""
        holders: list[tuple[_Holder, bool]] = [(("id", source.peer_id), False)]
        if source.range_name is not None:
            holders.append((("range", source.range_name), True))
        return holders

    def refusal(
        self, source: Source, kid: bytes, size: int, new_subkey: bool, freed: int
    ) -> str | None:
        """Why ``source`` may not store one more record of ``size`` bytes under ``kid``.

        Args:
            new_subkey: the record adds a subkey that ``source`` did not hold under ``kid``.
            freed: bytes of ``source``'s own record that this one replaces (0: a new record).

        Returns:
            None when allowed.
        """
        q = self.quotas
        for holder, is_range in self._holders(source):
            scale = q.per_range_factor if is_range else 1
            who = f"address range {source.range_name}" if is_range else "this peer"
            if self._bytes[holder] - freed + size > self.max_bytes * scale:
                return f"{who} already stores {self._bytes[holder]} bytes here"
            if not freed and self._records[holder] + 1 > q.max_records_per_source * scale:
                return f"{who} already stores {self._records[holder]} records here"
            if new_subkey and self._subkeys[kid, holder] + 1 > q.max_subkeys_per_source * scale:
                return f"{who} already holds {self._subkeys[kid, holder]} subkeys of this key"
        return None

    def charge(self, source: Source | None, kid: bytes, size: int, subkey: bool, sign: int) -> None:
        """Add (``sign`` = 1) or release (-1) one record of ``size`` bytes held by ``source``."""
        if source is None:
            return
        for holder, _ in self._holders(source):
            self._bytes[holder] += sign * size
            self._records[holder] += sign
            if self._records[holder] <= 0:
                del self._bytes[holder], self._records[holder]
            if subkey:
                self._subkeys[kid, holder] += sign
                if self._subkeys[kid, holder] <= 0:
                    del self._subkeys[kid, holder]

    def usage(self, peer_id: bytes) -> tuple[int, int]:
        """(bytes, records) that ``peer_id`` holds here."""
        holder: _Holder = ("id", peer_id)
        return self._bytes[holder], self._records[holder]
