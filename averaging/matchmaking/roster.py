"""Whom a round expects: the family's roster, and the run's averaging daemons.

A leader closes as soon as every peer it expects is in (:mod:`.closing`). What it expects
must not depend on luck: a first round that has seen nobody, or a round whose peers'
last group was a split, has to know about peers that have not declared yet.

- **The family's roster** (:class:`FamilyRoster`): after a round under a key family
  (``step-41``, ``step-42``), a peer keeps every peer it saw there, in its own group or
  not: the declarers of its schema and codec, the members of groups that closed elsewhere,
  and late peers that asked it after its group closed. The next round expects all of them,
  so a round that split is one group again in the next one (each half now waits for the
  other), and a peer that was late once is waited for next time.
- **The run's averaging daemons** (:class:`RunPresence`): every averager writes one
  owner-signed entry under ``{run}.averagers`` while it runs (its address and mode,
  refreshed every ``ttl / 3``). A round under a family that this peer has no roster for
  (the first round of a training loop) expects them, up to the leader's upper bound
  (``matchmaking_time``): trainers start seconds apart, so the first caller would
  otherwise close with whoever had called by then and strand the rest.

Neither list is trusted for anything but waiting: a listed peer still has to declare,
sign and join like any other, and a listed peer that does not come costs at most the
upper bound once (the next round's roster holds only the peers that came).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from swarmavg.averaging.dht_access import DHTAccess, dictionary_entries
from swarmavg.averaging.group import Mode
from swarmavg.averaging.matchmaking.declarations import MAX_ADDRESS_CHARS
from swarmavg.averaging.run_records.trainers import AVERAGERS_SUFFIX
from swarmavg.averaging.tasks import cancel_and_wait
from swarmavg.dht.records import owner_suffix, subkey_owner

log = logging.getLogger(__name__)

PRESENCE_SUFFIX = AVERAGERS_SUFFIX
"""``{run}.averagers``: the run's averaging daemons, one owner-signed entry each (the name
lives with the run's records, which the training side reads without loading matchmaking)."""
PRESENCE_TTL = 90.0
"""Seconds a presence entry lives; refreshed every third of it."""
PRESENCE_MAX_AGE = 15.0
"""Seconds a read of the presence entries is reused before the next first round reads again."""
MAX_ROSTER = 4096
"""The most peers a roster or a presence read keeps (a dictionary record's subkey cap)."""
_MODE_VALUES = frozenset(int(m) for m in Mode)


def presence_key(run_id: str) -> str:
    """The DHT key of run ``run_id``'s presence entries."""
    return f"{run_id}{PRESENCE_SUFFIX}"


@dataclass(frozen=True)
class Presence:
    """One averaging daemon's presence entry.

    Attributes:
        peer_id: its 20-byte id (the subkey's owner, who signed the entry).
        address: where its Averaging service listens; empty in client mode.
        mode: its averaging mode.
    """

    peer_id: bytes
    address: str
    mode: Mode

    def encode(self) -> dict[str, Any]:
        """The msgpack-able DHT value (the subkey names the owner)."""
        return {"addr": self.address, "mode": int(self.mode)}


def decode_presence(subkey: object, value: object) -> Presence | None:
    """A presence entry from an untrusted DHT record, or ``None`` when malformed."""
    peer_id = subkey_owner(subkey)
    if peer_id is None or not isinstance(value, dict) or set(value) != {"addr", "mode"}:
        return None
    address, mode = value["addr"], value["mode"]
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS:
        return None
    if isinstance(mode, bool) or not isinstance(mode, int) or mode not in _MODE_VALUES:
        return None
    return Presence(peer_id, address, Mode(mode))


@dataclass
class FamilyRoster:
    """What a peer keeps of its last round in a family of keys.

    Attributes:
        peers: every peer seen in that round (declarers of our schema and codec, group
            members, members of groups that closed elsewhere, late askers) and its
            address, or None where it has none (a client-mode peer) or none we know.
        seen: how many declarations of our schema and codec the round saw in the end
            (0: unknown), for :func:`~.closing.read_back_suffices`.
        proven: the peers averaged under the family (False: they are the run's presence
            entries, read for a family's first round).
        lateness: how late the last member arrived in each of the family's recent rounds
            that this peer took part in, or that a late asker came to (seconds, oldest
            first; :func:`~.closing.arrival_lateness`): what the roster grace follows.
    """

    peers: dict[bytes, str | None] = field(default_factory=dict)
    seen: int = 0
    proven: bool = True
    lateness: tuple[float, ...] = ()

    def add(self, peer_id: bytes, address: str | None) -> None:
        """Remember one more peer of the family (a late asker), within :data:`MAX_ROSTER`."""
        if peer_id in self.peers:
            if address and not self.peers[peer_id]:
                self.peers[peer_id] = address
        elif len(self.peers) < MAX_ROSTER:
            self.peers[peer_id] = address or None

    def observe_lateness(self, seconds: float, keep: int) -> None:
        """Remember one more round's lateness (the newest ``keep`` are kept)."""
        if seconds >= 0 and math.isfinite(seconds):
            self.lateness = (*self.lateness, seconds)[-keep:]


class RunPresence:
    """This averager's presence entry under ``{run}.averagers``, and reads of everyone's.

    Owns one background task between :meth:`start` and :meth:`stop` (which cancels and
    awaits it). Create inside the running event loop.
    """

    def __init__(
        self,
        dht: DHTAccess,
        run_id: str,
        me: Presence,
        *,
        ttl: float = PRESENCE_TTL,
        timeout: float = 3.0,
        replicas: int | None = None,
        read_quorum: int | None = None,
    ) -> None:
        if not (ttl > 0 and math.isfinite(ttl)) or not timeout > 0:
            raise ValueError("need a positive, finite ttl and a positive timeout")
        self.dht = dht
        self.key = presence_key(run_id)
        self.me = me
        self.ttl = ttl
        self.timeout = timeout
        # Like a declaration: stored on the key's few nearest nodes, read from fewer, so
        # that every averager's refresh costs the run a few RPCs, not k.
        self.replicas = replicas
        self.read_quorum = read_quorum
        self._task: asyncio.Task[None] | None = None
        self._read: tuple[float, dict[bytes, str | None]] | None = None
        self._reading: asyncio.Task[dict[bytes, str | None] | None] | None = None

    def start(self) -> None:
        """Start announcing (idempotent)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._announce())

    async def stop(self) -> None:
        """Stop announcing; the entry expires within ``ttl``. Idempotent."""
        for task in (self._task, self._reading):
            if task is not None:
                await cancel_and_wait(task)
        self._task = None
        self._reading = None

    async def _announce(self) -> None:
        while True:
            stored = await self._store()
            # Sooner after a failure (the DHT may not have had neighbours yet); jittered,
            # so that a swarm started at once does not refresh as one burst.
            pause = self.ttl / 3 if stored else min(2.0, self.ttl / 3)
            await asyncio.sleep(pause * random.uniform(0.8, 1.2))

    async def _store(self) -> bool:
        try:
            async with asyncio.timeout(self.timeout):
                return await self.dht.store(
                    self.key,
                    self.me.encode(),
                    time.time() + self.ttl,
                    subkey=owner_suffix(self.me.peer_id),
                    replicas=self.replicas,
                )
        except (TimeoutError, grpc.aio.AioRpcError) as error:
            log.debug("storing presence under %s failed: %r", self.key, error)
            return False

    async def others(self) -> dict[bytes, str | None]:
        """The run's other averaging daemons and their addresses (None: client mode).

        One DHT read, reused for :data:`PRESENCE_MAX_AGE` seconds and shared by callers
        that ask at once; an empty map when the read fails (then nobody is expected, as
        before this rule existed).
        """
        now = time.monotonic()
        if self._read is not None and now - self._read[0] <= PRESENCE_MAX_AGE:
            return self._read[1]
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._fetch())
        found = await asyncio.shield(self._reading)
        if found is None:
            return {}
        self._read = (now, found)
        return found

    async def _fetch(self) -> dict[bytes, str | None] | None:
        try:
            async with asyncio.timeout(self.timeout):
                record = await self.dht.get(self.key, latest=True, quorum=self.read_quorum)
        except (TimeoutError, grpc.aio.AioRpcError) as error:
            log.debug("reading presence under %s failed: %r", self.key, error)
            return None
        return parse_presence(record, self.me.peer_id)


def parse_presence(record: Any, own_id: bytes) -> dict[bytes, str | None]:
    """The well-formed presence entries of a DHT read, less ``own_id``: peer id -> address
    (None for a client-mode daemon), at most :data:`MAX_ROSTER` of them."""
    found: dict[bytes, str | None] = {}
    for subkey, value in dictionary_entries(record).items():
        entry = decode_presence(subkey, value)
        if entry is None or entry.peer_id == own_id or entry.mode is Mode.AUX:
            continue
        found[entry.peer_id] = entry.address if entry.mode is not Mode.CLIENT else None
        if len(found) >= MAX_ROSTER:
            break
    return found


def roster_addresses(peers: Mapping[bytes, str | None]) -> dict[bytes, str]:
    """The roster peers that can be dialled (a probe for a dead one needs an address)."""
    return {p: a for p, a in peers.items() if a}
