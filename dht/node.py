"""DHTNode: the public face of the DHT (store, get, find_nearest) and its lifecycle.

A node owns its routing table, storage and protocol, and one background maintenance task
(sweep expired records, re-ping the initial peers, refresh buckets, republish records) that
:meth:`DHTNode.shutdown` cancels and awaits. Lookup-path caching runs in tasks the node owns
too. See docs/dht.md for the user view.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import grpc

from swarmavg.dht.auth import Authenticator, RequestSigner
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.config import DHTConfig
from swarmavg.dht.dial_failures import (
    NOT_SWARMAVG,
    REFUSED_GRACE,
    plain_reason,
    turns_away,
)
from swarmavg.dht.identity import Identity
from swarmavg.dht.ids import id_to_int, int_to_id, key_id, key_to_bytes, random_id_in_range
from swarmavg.dht.protocol import DHTProtocol, DHTRPCError, request_chunks
from swarmavg.dht.records import (
    StoredRecord,
    Subkey,
    ValueWithExpiration,
    pack,
    pack_subkey,
    signing_payload,
    unpack,
    unpack_subkey,
)
from swarmavg.dht.routing import Contact, RoutingTable
from swarmavg.dht.server_limits import ServerLimits
from swarmavg.dht.storage import STORED, Storage
from swarmavg.dht.tasks import TaskSet
from swarmavg.dht.tls import bind_port, new_server
from swarmavg.dht.traversal import LookupResult, traverse
from swarmavg.dht.validation import record_owner
from swarmavg.proto import dht_pb2

log = logging.getLogger(__name__)

NOT_NEAREST = dht_pb2.STORE_STATUS_NOT_NEAREST

StoreItem = tuple[str | bytes, Any, float, Subkey | None]
"""(key, value, expiration, subkey) for :meth:`DHTNode.store_many`."""


def permanent_failure(reason: str) -> bool:
    """Whether an initial peer's answer is one that retrying cannot change: it refused our
    request header (``FAILED_PRECONDITION``: another run id or protocol version), or its own
    answer carried another run's header, or the address speaks another protocol."""
    return (
        reason.startswith("FAILED_PRECONDITION:")
        or "run id differs" in reason
        or reason == NOT_SWARMAVG
    )


class BootstrapError(ConnectionError):
    """No initial peer answered within ``bootstrap_timeout``.

    Attributes:
        failures: initial address -> why it failed (last attempt).
        attempts: how many rounds were tried.
    """

    def __init__(self, failures: dict[str, str], attempts: int) -> None:
        self.failures = dict(failures)
        self.attempts = attempts
        lines = "\n".join(f"  {address}: {reason}" for address, reason in failures.items())
        super().__init__(
            f"could not join the DHT: none of {len(failures)} initial peer(s) answered "
            f"after {attempts} attempt(s):\n{lines}"
        )


def rejoin_probability(size_estimate: int, rejoins_per_round: int) -> float:
    """The chance that a node rejoins through an initial peer in one maintenance round.

    Every node of a public run lists the same few initial peers. Rejoining every round made
    each of them serve 2 requests per node per round (a ping and a Find): 667 per second
    for 10,000 nodes at 30 s. With this chance the swarm as a whole sends about
    ``rejoins_per_round`` rejoins to each initial peer per round, whatever its size; a
    bootstrap node that restarted empty (learning-at-home/hivemind#624) still hears from that many
    nodes of the old swarm each round, and one is enough to start the merge. A node that
    sees a swarm no larger than that (a small run, the new half of a split, a node that
    lost its contacts: its estimate is its table's size) rejoins every round, as before.
    """
    return min(1.0, rejoins_per_round / max(size_estimate, 1))


class DHTNode:
    """One Kademlia node.

    Construct (no I/O), optionally :meth:`add_to_server`, then ``await start(address)``; or use
    :meth:`create`, which also runs the node's own gRPC server. Use from one event loop.

    Args:
        config: behaviour and limits.
        identity: the node's key pair (default: a fresh one).
        channels: a shared :class:`ChannelPool` (default: a pool the node owns and closes).
    """

    def __init__(
        self,
        config: DHTConfig,
        identity: Identity | None = None,
        channels: ChannelPool | None = None,
    ) -> None:
        self.config = config
        self.identity = identity or Identity.generate()
        self._owns_channels = channels is None
        # `is None`, not `or`: an empty pool is falsy (it has __len__) yet is the caller's.
        self.channels = channels if channels is not None else ChannelPool()
        self.routing = RoutingTable(
            self.identity.peer_id,
            config.k,
            config.b,
            per_range=config.contacts_per_range,
            limit_local=config.limit_local_ranges,
        )
        self.storage = Storage(
            config.limits.max_subkeys_per_key,
            config.limits.max_stored_bytes,
            config.storage_quotas,
        )
        self.protocol = DHTProtocol(
            self.identity, config, self.routing, self.storage, self.channels
        )
        self.lookup_hops: collections.deque[int] = collections.deque(maxlen=10_000)
        self._server: grpc.aio.Server | None = None
        self._tasks = TaskSet()  # maintenance, caching along lookup paths
        self._state = "new"
        self._last_issued = 0.0  # issue time of the last record we signed

    # ---- lifecycle ----

    @classmethod
    async def create(
        cls,
        config: DHTConfig,
        identity: Identity | None = None,
        listen: str = "127.0.0.1:0",
        announce: str | None = None,
        channels: ChannelPool | None = None,
    ) -> DHTNode:
        """Start a node with its own gRPC server on ``listen`` (not in client mode) and join.

        ``announce`` is the address other nodes use to reach us (default: ``listen`` with the
        bound port; a wildcard host becomes 127.0.0.1, so pass ``announce`` on real networks).

        Raises:
            BootstrapError: no initial peer answered (the server is stopped again).
            OSError: ``listen`` could not be bound.
        """
        node = cls(config, identity, channels)
        if config.client_mode:
            await node.start(None)
            return node
        # A private run's pool holds the peer's TLS setup: the server then takes only peers
        # with a credential of the run (dht/tls.py).
        tls = node.channels.tls
        server = new_server(ServerLimits(max_message_bytes=config.limits.max_request_bytes), tls)
        node.add_to_server(server)
        node._server = server
        try:
            port = bind_port(server, listen, tls)
            if port == 0:
                raise OSError(f"could not bind {listen}")
            await server.start()
            if announce is None:
                host = listen.rpartition(":")[0]
                if host in ("", "0.0.0.0", "[::]", "::"):
                    host = "127.0.0.1"
                announce = f"{host}:{port}"
            await node.start(announce)
        except BaseException:
            await node.shutdown()
            raise
        return node

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the DHT service on ``server`` (before it starts). Not in client mode."""
        if self.config.client_mode:
            raise ValueError("a client-mode node does not serve the DHT")
        self.protocol.add_to_server(server)

    async def start(self, announce_address: str | None, deadline: float | None = None) -> None:
        """Join the DHT through the initial peers (none: start a new DHT).

        Args:
            announce_address: our public HOST:PORT; ``None`` in client mode.
            deadline: the event loop's time by which to give up (default:
                ``bootstrap_timeout`` from now); a daemon that spent part of its
                ``bootstrap_timeout`` on the initial peers already passes its own.

        Raises:
            BootstrapError: initial peers were given and none answered within
                ``bootstrap_timeout`` (each retried with capped, jittered backoff).
            RuntimeError: called twice.
        """
        if self._state != "new":
            raise RuntimeError(f"DHTNode.start called on a {self._state} node")
        if self.config.client_mode != (announce_address is None):
            raise ValueError("announce_address must be None exactly in client mode")
        self._state = "starting"
        self.protocol.set_address(announce_address or "")
        await self._bootstrap(deadline)
        self._state = "running"
        self._tasks.spawn(self._maintain(), name="dht-maintenance")

    async def shutdown(self, grace: float | None = None) -> None:
        """Stop maintenance and background work, the own server (if any) and own channels.

        Idempotent. Lookups in flight fail fast (their calls are cancelled).
        """
        if self._state == "stopped":
            return
        self._state = "stopped"
        await self._tasks.close()
        await self.protocol.close()
        if self._server is not None:
            await self._server.stop(grace)
        if self._owns_channels:
            await self.channels.close()

    # ---- facts ----

    @property
    def peer_id(self) -> bytes:
        return self.identity.peer_id

    @property
    def address(self) -> str | None:
        """Our public HOST:PORT, or None in client mode (or before start)."""
        return self.protocol.address or None

    def num_known_peers(self) -> int:
        return len(self.routing)

    def size_estimate(self) -> int:
        """Estimated number of nodes in the DHT.

        The k nearest ids to ours spread over a fraction d_k / 2**160 of the keyspace, so
        about k * 2**160 / d_k nodes exist (ids are uniform, being hashes).
        """
        k = self.config.k
        nearest = self.routing.nearest(self.routing.own_int, k)
        if len(nearest) < k:
            return len(self.routing) + 1
        d_k = nearest[-1].id_int ^ self.routing.own_int
        return max(len(self.routing) + 1, round(k * (1 << 160) / max(d_k, 1)))

    @property
    def signer(self) -> RequestSigner:
        """Signs this node's outgoing messages, for other services (e.g. the averager)."""
        return self.protocol.signer

    @property
    def authenticator(self) -> Authenticator:
        """The daemon's one check of inbound messages (one replay cache for every service)."""
        return self.protocol.authenticator

    # ---- bootstrap and maintenance ----

    async def _bootstrap(self, deadline: float | None) -> None:
        config = self.config
        own = self.protocol.address
        addresses = [a for a in dict.fromkeys(config.initial_peers) if a != own]
        if not addresses:
            return  # no initial peers: a new DHT
        loop = asyncio.get_running_loop()
        started = loop.time()
        if deadline is None:
            deadline = started + config.bootstrap_timeout
        failures = dict.fromkeys(addresses, "not tried")
        delay = config.bootstrap_backoff
        attempts = 0
        while True:
            attempts += 1
            timeout = max(min(config.request_timeout, deadline - loop.time()), 0.05)
            answers = await asyncio.gather(*(self._ping_initial(a, timeout) for a in addresses))
            joined = []
            refused = set()
            for address, answer in zip(addresses, answers, strict=True):
                if isinstance(answer, Contact):
                    if answer.peer_id == self.peer_id:
                        failures[address] = "this address is this node itself"
                    else:
                        joined.append(address)
                else:
                    log.debug("initial peer %s: %s", address, answer)
                    failures[address] = plain_reason(answer)
                    if turns_away(answer):
                        refused.add(address)
            # A peer that refused our header (another run, another protocol version), or a
            # server that does not speak gRPC, will refuse again: stop asking it, and give
            # up at once when nobody else is left (no 30 s of retries for a typo in
            # --run-id). A closed port, or a private run's peer that closes a plain
            # connection at once, is asked again for REFUSED_GRACE seconds only.
            refused_long = loop.time() - started >= REFUSED_GRACE
            addresses = [
                a
                for a in addresses
                if not permanent_failure(failures[a]) and not (refused_long and a in refused)
            ]
            if joined:
                # paper 2.3: a joining node looks up its own id through the contacts it has
                join = await traverse(self.protocol, [self.peer_id], want_values=False)
                if join[self.peer_id].nearest:  # someone answered the lookup
                    break
                for address in joined:  # e.g. a peer that answers pings under another id
                    failures[address] = "answered a ping, then failed the join lookup"
            if all(f == "this address is this node itself" for f in failures.values()):
                return  # we are our own only initial peer: a new DHT
            remaining = deadline - loop.time()
            if remaining <= 0 or not addresses:
                raise BootstrapError(failures, attempts)
            # One line for the first failure; the retries that follow are routine.
            level = logging.INFO if attempts == 1 else logging.DEBUG
            log.log(level, "no initial peer answered yet; retrying for up to %.0f s", remaining)
            pause = min(delay * random.uniform(0.5, 1.5), remaining)
            if refused == set(addresses) and not refused_long:
                # only addresses that turn us away left: ask once more when their grace ends
                pause = min(pause, max(started + REFUSED_GRACE - loop.time(), 0.05))
            await asyncio.sleep(pause)
            delay = min(delay * 2, config.bootstrap_backoff_max)
        await self.refresh(all_buckets=True)  # paper 2.3: then it refreshes all its buckets

    async def _ping_initial(self, address: str, timeout: float) -> Contact | str:
        try:
            return await self.protocol.call_ping(address, timeout=timeout)
        except DHTRPCError as e:
            return e.reason

    async def _maintain(self) -> None:
        interval = self.config.maintenance_interval
        while True:
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))
            try:
                await self.maintain_once()
            except Exception:
                log.exception("DHT maintenance round failed")

    async def maintain_once(self, refresh_all: bool = False, republish_all: bool = False) -> None:
        """One maintenance round; the background task runs this every maintenance_interval.

        Drops expired records; rejoins through the initial peers (see :meth:`_rejoin_via`), so
        that a swarm whose bootstrap node restarted empty merges with it again instead of
        splitting in two (learning-at-home/hivemind#624), each with :func:`rejoin_probability`, so
        that an initial peer serves about ``rejoins_per_round`` rejoins per round however
        large the swarm; refreshes stale buckets and our own
        neighbourhood (paper 2.3); republishes records nobody stored to us during the last
        republish interval (paper 2.5).

        Args:
            refresh_all: refresh every bucket, not only the stale ones.
            republish_all: republish every stored record now.
        """
        self.storage.sweep()
        own = self.protocol.address
        chance = rejoin_probability(self.size_estimate(), self.config.rejoins_per_round)
        initial = [a for a in self.config.initial_peers if a != own and random.random() < chance]
        answers = await asyncio.gather(*(self._rejoin_via(a) for a in initial))
        seeds = [contact for answer in answers for contact in answer]
        await self.refresh(all_buckets=refresh_all, seeds=seeds)
        await self.republish(everything=republish_all)

    async def _rejoin_via(self, address: str) -> list[Contact]:
        """Ping an initial peer and ask it for our neighbours (the paper's join, repeated).

        The ping teaches it about us; its answer seeds our refresh with the nodes it knows
        near our id, which then learn about us when we query them. A bootstrap node that
        restarted empty, and the group that joined it meanwhile, so learn the rest of the
        swarm within a round or two instead of staying a separate DHT.
        """
        try:
            contact = await self.protocol.call_ping(address)
            if contact.peer_id == self.peer_id:
                return []
            answers = await self.protocol.call_find(
                contact, [self.peer_id], self.config.k, want_values=False
            )
        except DHTRPCError as e:
            log.debug("initial peer %s did not answer: %s", address, e.reason)
            return []
        return answers[0].nearest

    async def refresh(self, all_buckets: bool = False, seeds: Sequence[Contact] = ()) -> None:
        """Look up a random id in every bucket without a recent lookup (paper 2.3), and our id
        when our neighbourhood may have changed (see :meth:`_neighbourhood_in_doubt`)."""
        buckets = (
            list(self.routing.buckets)
            if all_buckets
            else self.routing.stale_buckets(self.config.refresh_interval)
        )
        targets = [int_to_id(random_id_in_range(b.lower, b.upper)) for b in buckets]
        if not all_buckets and not self._neighbourhood_in_doubt(seeds):
            if targets:
                await traverse(
                    self.protocol, targets, want_values=False, converge=self.config.alpha
                )
            return
        await asyncio.gather(
            # A refresh exists to fill buckets, and every answer names up to k peers, so these
            # lookups end once alpha nearest answered instead of k: a join, which refreshes
            # every bucket (paper 2.3), costs hundreds of RPCs fewer.
            traverse(
                self.protocol,
                targets,
                want_values=False,
                seeds=seeds,
                converge=self.config.alpha,
            ),
            # Our own id in full: keeps our neighbourhood, the part of the table that decides
            # where records go, exact as nodes come and go (the paper's join lookup, repeated).
            traverse(self.protocol, [self.peer_id], want_values=False, seeds=seeds),
        )

    def _neighbourhood_in_doubt(self, seeds: Sequence[Contact]) -> bool:
        """Whether a maintenance round should look up our own id in full.

        Yes when the rejoin's answer named a peer we do not know that is nearer to us than
        our k-th nearest contact (a newcomer in our neighbourhood, or the other half of a
        split swarm, learning-at-home/hivemind#624) or when our own bucket had no lookup within
        ``refresh_interval`` (paper 2.3). Otherwise newcomers near us already queried us on
        their own join lookup and so are known: a full lookup every round in a stable swarm
        costs each node about k RPCs and serves as many every 30 s, which dominated a
        1000-node swarm's CPU and brings nothing new. Unknown peers farther
        away sit in buckets that are full anyway and do not move where records go.
        """
        own = self.routing.own_int
        nearest = self.routing.nearest(own, self.config.k)
        horizon = nearest[-1].id_int ^ own if len(nearest) >= self.config.k else 1 << 160
        fresh = [
            s
            for s in seeds
            if s.peer_id != self.peer_id
            and s.peer_id not in self.routing
            and s.id_int ^ own < horizon
        ]
        own_bucket = self.routing.buckets[self.routing.bucket_index(own)]
        stale = time.monotonic() - own_bucket.last_lookup > self.config.refresh_interval
        return bool(fresh) or stale

    async def republish(self, everything: bool = False) -> int:
        """Re-store our records on their current nearest nodes (paper 2.5); return how many."""
        quiet = 0.0 if everything else self.config.republish_interval
        records = self.storage.to_republish(quiet)
        chunk = self.config.limits.max_records_per_request
        for start in range(0, len(records), chunk):
            part = records[start : start + chunk]
            await self._store_records(part)
            for record in part:
                self.storage.mark_republished(key_id(record.key))
        return len(records)

    # ---- store ----

    def _make_record(self, item: StoreItem, now: float) -> StoredRecord:
        key, value, expiration, subkey = item
        raw_key = key_to_bytes(key)
        raw_subkey = b"" if subkey is None else pack_subkey(subkey)
        record = StoredRecord(raw_key, raw_subkey, pack(value), float(expiration))
        owner = record_owner(record, self.config.limits)
        if owner is not None:
            if owner != self.peer_id:
                raise ValueError(
                    f"key {key!r} / subkey {subkey!r} is owned by {owner.hex()}, not by this peer"
                )
            # Strictly increasing, so that our newest version of a record always wins over
            # the ones before it (records.py, StoredRecord.order), even within one clock tick.
            self._last_issued = max(now, math.nextafter(self._last_issued, math.inf))
            record.issued = min(self._last_issued, record.expiration)
            record.public_key = self.identity.public_key
            payload = signing_payload(
                self.config.run_id,
                record.key,
                record.subkey,
                record.value,
                record.expiration,
                record.issued,
            )
            record.signature = self.identity.sign(payload)
            self.protocol.signatures.remember_own(record.public_key, record.signature, payload)
        self.protocol.validate(record, now)
        return record

    async def store(
        self,
        key: str | bytes,
        value: Any,
        expiration: float,
        subkey: Subkey | None = None,
        replicas: int | None = None,
    ) -> bool:
        """Store ``value`` under ``key`` (or under ``subkey`` of dictionary ``key``).

        Args:
            key: ``str`` or ``bytes``. A key ending in ``[owner:<our peer id hex>]`` (see
                :func:`swarmavg.dht.records.owner_suffix`) is signed by us and can only be
                written by us; the same holds for such a subkey.
            value: any msgpack-serialisable object.
            expiration: absolute ``time.time()`` after which the value disappears.
            subkey: ``str``, ``bytes`` or ``int``; makes ``key`` a dictionary.
            replicas: how many of the nearest nodes store it (default: the configured
                ``replication``); fewer for short-lived records read from the nearest few
                (matchmaking's declarations), one request less per node left out.

        Returns:
            True when at least one of the nearest nodes (or this one) now holds the record;
            False when every one of them holds a record that expires later, or none answered.

        Raises:
            ValueError: the key, subkey or value breaks a size cap or names another owner.
            TypeError: the value is not msgpack-serialisable.
        """
        return (await self.store_many([(key, value, expiration, subkey)], replicas))[0]

    async def store_many(
        self, items: Sequence[StoreItem], replicas: int | None = None
    ) -> list[bool]:
        """:meth:`store` for many records in one traversal; one bool per item."""
        if replicas is not None and replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        now = time.time()
        records = [self._make_record(item, now) for item in items]
        return (await self._store_traversal(records, replicas=replicas))[0]

    async def store_and_get(
        self,
        key: str | bytes,
        value: Any,
        expiration: float,
        subkey: Subkey | None = None,
        replicas: int | None = None,
    ) -> tuple[bool, ValueWithExpiration[Any] | None]:
        """:meth:`store`, then what the nearest nodes hold under ``key`` (our record
        included), in one traversal: the Find requests that carry the record also ask for
        the key's values, as ``get(key, latest=True)`` would.

        A peer that writes its entry into a shared dictionary and then reads the others'
        (matchmaking's declarations) saves a whole lookup, which on a swarm's busy nodes
        costs as much as the store itself. The read sees what each node held when our
        request reached it: an entry stored at the same moment elsewhere may be missing,
        exactly as from a separate read made a little later.

        Args:
            replicas: as :meth:`store`; the read then covers those nodes.

        Returns:
            ``(stored, value)``: ``stored`` as :meth:`store` returns it; ``value`` as
            :meth:`get` with ``latest=True`` returns it.
        """
        if replicas is not None and replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        record = self._make_record((key, value, expiration, subkey), time.time())
        stored, lookups = await self._store_traversal([record], read_back=True, replicas=replicas)
        kid = key_id(record.key)
        if kid not in lookups:  # expired already: nothing to carry, a plain read
            return False, await self.get(key, latest=True)
        records = self._merge(kid, lookups[kid].records, time.time())
        return stored[0], self._decode(records)

    async def _store_records(
        self, records: Sequence[StoredRecord], cache_on: Contact | None = None
    ) -> list[bool]:
        limits = self.config.limits
        if cache_on is not None:
            statuses = []
            for chunk in request_chunks(
                records, limits.max_records_per_request, limits.max_request_bytes // 2
            ):
                statuses += await self.protocol.call_store(cache_on, chunk, cache=True)
            return [s == STORED for s in statuses]
        return (await self._store_traversal(records))[0]

    async def _store_traversal(
        self, records: Sequence[StoredRecord], read_back: bool = False, replicas: int | None = None
    ) -> tuple[list[bool], dict[bytes, LookupResult]]:
        """Store ``records`` on the nodes nearest to their keys; with ``read_back``, the
        Find requests also ask for the keys' values and visit the nearest nodes as a
        ``latest`` get does. Returns one bool per record and the lookups."""
        limits = self.config.limits
        now = time.time()
        live = [i for i, r in enumerate(records) if r.expiration > now]
        by_key: dict[bytes, list[int]] = {}
        for i in live:
            by_key.setdefault(key_id(records[i].key), []).append(i)
        replicas = replicas or self.config.num_replicas
        # The lookup need only converge on the `replicas` nearest nodes, not on k of them, and
        # the records ride along with its Find requests: the nodes that know they are among
        # the nearest store them at once, so only the rest need a separate Store.
        lookups = await traverse(
            self.protocol,
            list(by_key),
            want_values=read_back,
            quorum=self.config.k,
            k=replicas,
            store={kid: [records[i] for i in idx] for kid, idx in by_key.items()},
            replication=replicas,
            counts_self=not self.config.client_mode,
        )
        own_int = self.routing.own_int
        stored = [False] * len(records)
        batches: dict[bytes, tuple[Contact, list[int]]] = {}
        for kid, indices in by_key.items():
            lookup = lookups[kid]
            target = id_to_int(kid)
            nearest = lookup.nearest[:replicas]
            self.lookup_hops.append(lookup.hops)
            # paper 2.3: store on the k nearest, which may include this node itself
            if not self.config.client_mode and (
                len(nearest) < replicas or own_int ^ target < nearest[-1].id_int ^ target
            ):
                for i in indices:
                    stored[i] = self.storage.put(records[i], now, key_id_=kid) == STORED
                nearest = nearest[: replicas - 1]
            for contact in nearest:
                statuses = lookup.store_statuses.get(contact.peer_id, [])
                if len(statuses) == len(indices):
                    for i, status in zip(indices, statuses, strict=True):
                        stored[i] = stored[i] or status == STORED
                    if all(st != NOT_NEAREST for st in statuses):
                        continue
                batches.setdefault(contact.peer_id, (contact, []))[1].extend(indices)

        async def send(contact: Contact, indices: list[int]) -> None:
            chunks = request_chunks(
                [records[i] for i in indices],
                limits.max_records_per_request,
                limits.max_request_bytes // 2,
            )
            try:
                statuses = [s for c in chunks for s in await self.protocol.call_store(contact, c)]
            except DHTRPCError as e:
                log.debug("store on %s failed: %s", contact.address, e.reason)
                return
            for i, status in zip(indices, statuses, strict=True):
                stored[i] = stored[i] or status == STORED

        await asyncio.gather(*(send(c, idx) for c, idx in batches.values()))
        return stored, lookups

    # ---- get ----

    async def get(
        self, key: str | bytes, latest: bool = False, quorum: int | None = None
    ) -> ValueWithExpiration[Any] | None:
        """Find the value under ``key``.

        Args:
            latest: ask all of the k nearest nodes and merge, instead of stopping at the first
                ``get_quorum`` holders.
            quorum: stop once this many nodes returned the key instead (``latest`` aside:
                what they hold is merged all the same); the nearest are asked first.

        Returns:
            None when nothing unexpired is found. For a plain key, its value and expiration;
            for a dictionary key, ``value`` is ``dict[subkey, ValueWithExpiration]`` merged
            over every holder that answered, and ``expiration`` the latest subkey expiration.
        """
        return (await self.get_many([key], latest, quorum))[0]

    async def get_many(
        self, keys: Sequence[str | bytes], latest: bool = False, quorum: int | None = None
    ) -> list[ValueWithExpiration[Any] | None]:
        """:meth:`get` for many keys in one traversal."""
        raw_keys = [key_to_bytes(k) for k in keys]
        kids = [key_id(k) for k in raw_keys]
        if quorum is None:
            quorum = self.config.k if latest else self.config.get_quorum
        elif quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        lookups = await traverse(self.protocol, kids, want_values=True, quorum=quorum)
        now = time.time()
        out: list[ValueWithExpiration[Any] | None] = []
        for kid in kids:
            lookup = lookups[kid]
            records = self._merge(kid, lookup.records, now)
            if lookup.records:
                self.lookup_hops.append(lookup.hops)
            out.append(self._decode(records))
            if records and lookup.holders and self.config.cache_on_lookup:
                self._cache_along_path(lookup, records)
        return out

    def _merge(self, kid: bytes, found: list[StoredRecord], now: float) -> list[StoredRecord]:
        """What this node holds under ``kid`` merged with what a lookup ``found``, as one
        storage would keep it (the newest entry of each subkey wins)."""
        refused = self.routing.refused
        merged = Storage(self.config.limits.max_subkeys_per_key)
        for record in (*self.storage.get(kid, now), *found):
            # A revoked peer's records (declarations, state adverts, progress) stored
            # before the revocation, or cached by honest nodes, must not make this peer
            # dial it as a leader or a donor: its answers would come back, our tensors
            # would go out.
            if refused and record_owner(record, self.config.limits) in refused:
                continue
            merged.put(record, now, key_id_=kid)
        return merged.get(kid, now)

    def _decode(self, records: list[StoredRecord]) -> ValueWithExpiration[Any] | None:
        if not records:
            return None
        max_bytes = self.config.limits.max_value_bytes
        if len(records) == 1 and not records[0].subkey:
            return ValueWithExpiration(unpack(records[0].value, max_bytes), records[0].expiration)
        entries = {
            unpack_subkey(r.subkey, max_bytes): ValueWithExpiration(
                unpack(r.value, max_bytes), r.expiration
            )
            for r in records
        }
        return ValueWithExpiration(entries, max(r.expiration for r in records))

    def _cache_along_path(self, lookup: LookupResult, records: list[StoredRecord]) -> None:
        """Paper 2.3: store the found value on the nearest node asked that lacked it."""
        if not lookup.lacking or self._state != "running":
            return
        target = lookup.lacking[0]
        self._tasks.spawn(self._cache_on(target, records), name="dht-cache-on-path")

    async def _cache_on(self, contact: Contact, records: list[StoredRecord]) -> None:
        try:
            await self._store_records(records, cache_on=contact)
        except DHTRPCError as e:
            log.debug("caching on %s failed: %s", contact.address, e.reason)

    # ---- nearest ----

    async def find_nearest(self, node_id: bytes, k: int | None = None) -> list[Contact]:
        """The ``k`` (default: config.k) live nodes nearest to ``node_id``, nearest first,
        found by an iterative lookup. This node itself is not included."""
        k = k or self.config.k
        result = await traverse(self.protocol, [node_id], want_values=False, k=k)
        return result[node_id].nearest[:k]

    def __repr__(self) -> str:
        return f"DHTNode({self.identity.peer_id_hex[:8]}@{self.address}, {self._state})"
