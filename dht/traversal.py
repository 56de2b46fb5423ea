"""Iterative lookups (paper section 2.3), many keys in one traversal.

Each key runs the paper's node lookup: start from the k nearest contacts we know, keep
``alpha`` Find requests in flight, merge the peers each answer names, and stop when the k
nearest live candidates have all answered (FIND_NODE), or once ``quorum`` nodes returned
records for the key (FIND_VALUE). A per-request deadline bounds each call; a per-lookup
deadline bounds the whole traversal, which then returns what it has.

Many keys share one traversal through :class:`FindBatcher`: the Find requests that all keys
address to the same peer in the same event-loop iteration travel as one RPC. A peer that fails
is skipped by every key of the traversal.

Hearsay is a hint to dial, never a contact by itself: a peer named in an answer
under an id our routing table knows is dialled at the address the table knows, not at the
named one; a peer named at several addresses is tried at each in turn (at most
``_MAX_ADDRESSES``) until one answers as it; only an answer that proves the dialled address
(protocol.py) puts the peer into the routing table. Failures are tracked per (id, address),
so a fake address for an id never makes the traversal skip the id's real one.

Hops: a contact from our own table is at hop 1; a contact first named by a hop-h peer is at
hop h+1. A lookup's hop count is the hop of the first node that returned a value (FIND_VALUE)
or the largest hop among the k nearest that answered (FIND_NODE).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from swarmavg.dht.ids import id_to_int
from swarmavg.dht.protocol import DHTProtocol, DHTRPCError, FindAnswer
from swarmavg.dht.records import StoredRecord
from swarmavg.dht.routing import Contact
from swarmavg.dht.tasks import TaskSet
from swarmavg.proto import dht_pb2

_NEW, _IN_FLIGHT, _ANSWERED, _FAILED = range(4)
_MAX_ADDRESSES = 3  # addresses tried per peer id named in answers

_Request = tuple[bytes, "asyncio.Future[FindAnswer | None]"]  # (target id, its answer)


@dataclass(slots=True)
class _Candidate:
    contact: Contact
    distance: int
    hop: int
    state: int = _NEW
    alternates: list[Contact] = field(default_factory=list)  # other named addresses
    tried: int = 1  # addresses named for this id so far (the current one included)


@dataclass
class LookupResult:
    """What one key's lookup found."""

    target: bytes
    nearest: list[Contact] = field(default_factory=list)  # answered, nearest first, <= k
    records: list[StoredRecord] = field(default_factory=list)  # from every holder
    holders: list[Contact] = field(default_factory=list)  # contacts that returned records
    lacking: list[Contact] = field(default_factory=list)  # answered without records, nearest 1st
    # peer id -> what it did with the records this lookup asked it to store (in order)
    store_statuses: dict[bytes, list[dht_pb2.StoreStatus]] = field(default_factory=dict)
    hops: int = 0
    timed_out: bool = False


class FindBatcher:
    """Coalesces Find requests to the same peer issued in one loop iteration into one RPC.

    Owns the RPC tasks it starts; :meth:`close` cancels and awaits them.
    """

    def __init__(
        self,
        protocol: DHTProtocol,
        k: int,
        want_values: bool,
        max_keys: int,
        store: Mapping[bytes, Sequence[StoredRecord]] | None = None,
        replication: int = 0,
    ) -> None:
        self.protocol = protocol
        self.k = k
        self.want_values = want_values
        self.max_keys = max_keys
        self.store = store or {}
        self.replication = replication
        self.failed: set[tuple[bytes, str]] = set()  # (peer id, address) that failed
        self._pending: dict[
            tuple[bytes, str],
            tuple[Contact, list[tuple[bytes, asyncio.Future[FindAnswer | None]]]],
        ]
        self._pending = {}
        self._scheduled = False
        self._tasks = TaskSet()
        self.rpcs = 0

    def find(self, contact: Contact, target: bytes) -> asyncio.Future[FindAnswer | None]:
        """Ask ``contact`` about ``target``; the future gives its answer, or None on failure."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[FindAnswer | None] = loop.create_future()
        where = (contact.peer_id, contact.address)
        entry = self._pending.get(where)
        if entry is None:
            entry = self._pending[where] = (contact, [])
        entry[1].append((target, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        for contact, items in pending.values():
            for start in range(0, len(items), self.max_keys):
                self._tasks.spawn(self._send(contact, items[start : start + self.max_keys]))

    async def _send(self, contact: Contact, items: list[_Request]) -> None:
        self.rpcs += 1
        answers: Sequence[FindAnswer | None]
        try:
            targets = [t for t, _ in items]
            records = [r for t in targets for r in self.store.get(t, ())]
            limits = self.protocol.config.limits
            if (
                len(records) > limits.max_records_per_request
                or sum(r.size() for r in records) > limits.max_request_bytes // 2
            ):
                records = []  # too much to ride along: the explicit Store round carries it
            try:
                answers = await self.protocol.call_find(
                    contact,
                    targets,
                    self.k,
                    self.want_values,
                    store=records,
                    replication=self.replication,
                )
            except DHTRPCError:
                self.failed.add((contact.peer_id, contact.address))
                answers = [None] * len(items)
            for (_, future), answer in zip(items, answers, strict=True):
                if not future.done():
                    future.set_result(answer)
        finally:
            for _, future in items:  # when cancelled too: no lookup may wait forever
                if not future.done():
                    future.set_result(None)

    async def close(self) -> None:
        await self._tasks.close()


class Traversal:
    """Lookups of many ids at once; one-shot (``await run()`` once)."""

    def __init__(
        self,
        protocol: DHTProtocol,
        targets: Sequence[bytes],
        *,
        want_values: bool,
        quorum: int = 1,
        k: int | None = None,
        seeds: Sequence[Contact] = (),
        store: Mapping[bytes, Sequence[StoredRecord]] | None = None,
        replication: int = 0,
        converge: int | None = None,
        counts_self: bool = False,
    ) -> None:
        config = protocol.config
        self.protocol = protocol
        self.targets = list(dict.fromkeys(targets))
        self.want_values = want_values
        self.quorum = quorum
        self.k = k or config.k
        self.converge = min(converge or self.k, self.k)
        self.counts_self = counts_self
        self.alpha = config.alpha
        self.seeds = list(seeds)
        self.batcher = FindBatcher(
            protocol, self.k, want_values, config.limits.max_keys_per_request, store, replication
        )

    async def run(self) -> dict[bytes, LookupResult]:
        """Run every lookup under the per-lookup deadline; return one result per target."""
        results = {t: LookupResult(t) for t in self.targets}
        try:
            async with asyncio.timeout(self.protocol.config.lookup_timeout):
                async with asyncio.TaskGroup() as group:
                    for target in self.targets:
                        group.create_task(self._lookup(results[target]))
        except TimeoutError:
            for result in results.values():
                result.timed_out = True
        finally:
            await self.batcher.close()
        return results

    async def _lookup(self, result: LookupResult) -> None:
        target = id_to_int(result.target)
        own_id = self.protocol.identity.peer_id
        routing = self.protocol.routing
        routing.mark_lookup(target)
        candidates: dict[bytes, _Candidate] = {}
        order: list[tuple[int, bytes]] = []  # (distance, peer id), ascending

        def consider(contact: Contact, hop: int) -> None:
            if contact.peer_id == own_id or contact.peer_id in routing.refused:
                return
            cand = candidates.get(contact.peer_id)
            if cand is not None and cand.contact.address == contact.address:
                return  # the common case: a peer named again at the address we know
            known = routing.get(contact.peer_id) if hop > 1 else None
            if known is not None:
                contact = known  # hearsay never overrides the address we heard from its owner
            if cand is not None:
                if (
                    known is None
                    and cand.tried < _MAX_ADDRESSES
                    and contact.address != cand.contact.address
                    and all(c.address != contact.address for c in cand.alternates)
                ):
                    cand.tried += 1
                    cand.alternates.append(contact)
                    if cand.state == _FAILED:
                        retry(cand)
                return
            cand = _Candidate(contact, contact.id_int ^ target, hop)
            candidates[contact.peer_id] = cand
            bisect.insort(order, (cand.distance, contact.peer_id))

        def retry(cand: _Candidate) -> None:
            """After a failure, dial the next address named for the same id, if any."""
            while cand.alternates:
                cand.contact = cand.alternates.pop(0)
                if (cand.contact.peer_id, cand.contact.address) not in self.batcher.failed:
                    cand.state = _NEW
                    return

        for contact in routing.nearest(target, self.k):
            consider(contact, 1)
        for contact in self.seeds:
            consider(contact, 1)

        own_distance = routing.own_int ^ target

        def next_candidate() -> _Candidate | None:
            # paper 2.3: query the nearest not-yet-asked among the k nearest live candidates
            seen = 0
            own_ahead = self.counts_self  # this node is one of the nearest it converges on
            for distance, peer_id in order:
                if own_ahead and own_distance < distance:
                    own_ahead = False
                    seen += 1
                    if seen >= self.converge:
                        return None
                cand = candidates[peer_id]
                if cand.state == _NEW and (peer_id, cand.contact.address) in self.batcher.failed:
                    cand.state = _FAILED
                    retry(cand)
                if cand.state == _FAILED:
                    continue
                if cand.state == _NEW:
                    return cand
                seen += 1
                if seen >= self.converge:
                    return None
            return None

        # A store's lookup in a swarm smaller than a bucket (the table then knows every
        # node it has heard of) asks the nodes that will hold the record all at once: one
        # round trip instead of two, and a closer node an answer names is still asked.
        width = self.alpha
        if self.batcher.store and len(routing) < self.protocol.config.k:
            width = max(width, self.converge)
        in_flight: dict[asyncio.Future[FindAnswer | None], _Candidate] = {}
        value_hop = 0
        try:
            while True:
                # Once holders answer, the lookup is among the key's nodes: ask only as many
                # more as the quorum still needs (refilling to alpha there sent up to two
                # Find requests per read whose answers were never used).
                limit = width
                if self.want_values and result.holders:
                    limit = min(limit, self.quorum - len(result.holders))
                while len(in_flight) < limit:
                    cand = next_candidate()
                    if cand is None:
                        break
                    cand.state = _IN_FLIGHT
                    in_flight[self.batcher.find(cand.contact, result.target)] = cand
                if not in_flight:
                    break
                done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    cand = in_flight.pop(future)
                    answer = future.result()
                    if answer is None:
                        cand.state = _FAILED
                        retry(cand)
                        continue
                    cand.state = _ANSWERED
                    if answer.store_statuses:
                        result.store_statuses[cand.contact.peer_id] = answer.store_statuses
                    if answer.records:
                        result.records.extend(answer.records)
                        result.holders.append(cand.contact)
                        value_hop = value_hop or cand.hop
                    for contact in answer.nearest:
                        consider(contact, cand.hop + 1)
                if self.want_values and len(result.holders) >= self.quorum:
                    break
        finally:
            for future in in_flight:
                future.cancel()
            holders = {c.peer_id for c in result.holders}
            answered = [candidates[p] for _, p in order if candidates[p].state == _ANSWERED]
            result.nearest = [c.contact for c in answered[: self.k]]
            result.lacking = [c.contact for c in answered if c.contact.peer_id not in holders]
            result.hops = value_hop or max((c.hop for c in answered[: self.k]), default=0)


async def traverse(
    protocol: DHTProtocol,
    targets: Sequence[bytes],
    *,
    want_values: bool,
    quorum: int = 1,
    k: int | None = None,
    seeds: Sequence[Contact] = (),
    store: Mapping[bytes, Sequence[StoredRecord]] | None = None,
    replication: int = 0,
    converge: int | None = None,
    counts_self: bool = False,
) -> dict[bytes, LookupResult]:
    """Look up every id in ``targets`` in one traversal; see :class:`Traversal`.

    ``store`` maps target ids to records that ride along with the Find requests; a queried
    node stores them if it is among the ``replication`` nodes nearest to the key it knows
    (see ``DHTProtocol._store_on_find``), and ``LookupResult.store_statuses`` says which did.

    ``converge`` (default k) is how many of the nearest candidates must answer before a
    lookup ends; every answer still names up to k peers. With ``counts_self``, this node
    is one of them where its own id lies among them (a store's lookup: it keeps a replica
    itself, so asking one more node would only be told ``NOT_NEAREST``).
    """
    return await Traversal(
        protocol,
        targets,
        want_values=want_values,
        quorum=quorum,
        k=k,
        seeds=seeds,
        store=store,
        replication=replication,
        converge=converge,
        counts_self=counts_self,
    ).run()
