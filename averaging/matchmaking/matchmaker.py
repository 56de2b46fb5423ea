"""Matchmaking over the DHT: peers averaging under one key form groups (docs/averaging.md).

Protocol (rules in :mod:`swarmavg.averaging.matchmaking.declarations`):

1. A peer declares itself under the round's matchmaking key (dictionary value, one subkey
   per declarer) with an expiration at its give-up time.
2. It reads the declarations and asks the best candidate leader (earliest declared start,
   ties by peer id) to take it: ``JoinGroup``. Until it is accepted somewhere it is itself a
   potential leader and accepts later peers.
3. A leader answers every request at once from its local state (accept, redirect to its own
   leader, or an explicit reject code), so two peers that ask each other never wait on each
   other. An accepted follower keeps the stream open; the leader streams the outcome on it.
4. When a peer is accepted, it redirects its own followers to its new leader.
5. The leader closes the group as soon as every peer it expects is in (the rule is in
   :mod:`~swarmavg.averaging.matchmaking.closing`), when ``group_size`` is reached, or at
   its deadline (``matchmaking_time``, an upper bound) once it has ``min_group_size``
   members, and streams the :class:`GroupInfo` to every follower.
6. A peer that asks a leader whose group already closed learns it at once
   (``JOIN_REJECT_FULL`` with the group's members); when no one else is left to average
   with, it fails at once instead of waiting out its timeout alone.

Failures: a follower whose stream breaks is removed from the leader's pending group at once
(the handler's ``finally``); a follower whose leader dies (stream error) or disbands returns
to looking, bans that leader for the round, and still meets its own deadline. Nothing waits
without a deadline: every call has one and the whole search ends at the peer's give-up time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from swarmavg.averaging.dht_access import DHTAccess, dictionary_entries
from swarmavg.averaging.errors import MatchmakingError, NoGroupError, SchemaMismatchError
from swarmavg.averaging.group import MAX_GROUP_SIZE, GroupInfo, Member, Mode
from swarmavg.averaging.matchmaking.closing import (
    Latency,
    LeaderView,
    assign_leaders,
    close_reason,
    expected_members,
    read_back_suffices,
    settle_time,
    short_ids,
)
from swarmavg.averaging.matchmaking.config import (
    MatchmakerConfig,
    MatchmakingEvent,
    MatchRequest,
    Observer,
)
from swarmavg.averaging.matchmaking.declarations import (
    MAX_ADDRESS_CHARS,
    Declaration,
    FollowerAsk,
    JoinState,
    check_formed_group,
    decide_join,
    declaration_mismatch,
    declaration_subkey,
    decode_declaration,
    group_to_proto,
    leader_candidates,
    member_from_join_request,
    mismatched_schemas,
    requested_aggregation,
    user_data_digest,
)
from swarmavg.averaging.matchmaking.roster import (
    FamilyRoster,
    Presence,
    RunPresence,
    roster_addresses,
)
from swarmavg.averaging.stubs import JOIN_GROUP, join_group_method
from swarmavg.dht.auth import AuthenticationError, message_digest
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.identity import HeaderError
from swarmavg.proto import averaging_pb2

log = logging.getLogger(__name__)

__all__ = [
    "DHTAccess",
    "MatchRequest",
    "Matchmaker",
    "MatchmakerConfig",
    "MatchmakingEvent",
    "Observer",
    "dictionary_entries",
]

MAX_BACKOFF = 2.0
"""Longest pause before asking again a leader whose call failed (seconds)."""
_REMEMBERED_KEYS = 256
"""Closed rounds and previous groups kept per matchmaker (one entry per key or family)."""
FINAL_CODES_TEXT = {
    averaging_pb2.JOIN_REJECT_NOT_LOOKING: "not matchmaking under that key",
    averaging_pb2.JOIN_REJECT_NOT_LEADER: "you lead, not I",
    averaging_pb2.JOIN_REJECT_FULL: "group full or closed",
    averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH: "different tensor schema",
    averaging_pb2.JOIN_REJECT_BAD_REQUEST: "bad request",
    averaging_pb2.JOIN_REJECT_AGGREGATION_MISMATCH: "different aggregation rule",
}


async def _cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel a helper task and wait for it, without swallowing our own cancellation."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:  # its outcome is read (or dropped) by the caller
        pass


_MEMBER_READS = 3
"""Reads of the declarations a follower makes at most to see every member of its group."""


@dataclass
class _Follower:
    member: Member
    outcome: asyncio.Future[averaging_pb2.JoinResponse]
    declared_start: float
    """The start it signed, which its request repeated (checked before it was accepted)."""


@dataclass
class _Round:
    request: MatchRequest
    me: Declaration
    result: asyncio.Future[GroupInfo]
    started: float
    """``time.monotonic()`` when this peer started looking."""
    previous: frozenset[bytes] = frozenset()
    """The family's roster: whom this round expects besides the declarers it reads
    (see ``roster``)."""
    previous_addresses: Mapping[bytes, str] = field(default_factory=dict)
    """Where the roster's peers listen (client-mode ones are absent)."""
    proven_roster: bool = True
    """``previous`` comes from a round of the family, not from presence entries."""
    previous_seen: int = 0
    """Declarations of our schema and codec the previous round saw in the end (0: none)."""
    gone: set[bytes] = field(default_factory=set)
    """Previous members whose address refused a connection: dead, not merely late."""
    probing: asyncio.Task[None] | None = None
    """The one probe of the previous members that have not declared (see ``_probe``)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    followers: dict[bytes, _Follower] = field(default_factory=dict)
    leader: tuple[bytes, str] | None = None
    closed: bool = False
    mismatched: dict[bytes, bytes] = field(default_factory=dict)
    failures: dict[bytes, int] = field(default_factory=dict)
    declarations: tuple[Declaration, ...] = ()
    """The live declarations of our schema and codec at the last read, our own included."""
    signed: dict[bytes, Declaration] = field(default_factory=dict)
    """Every live declaration read under our key whose start lies in the window, by peer id:
    what members signed, against which a group's entries are checked (issue 17)."""
    other_codecs: dict[bytes, str] = field(default_factory=dict)
    """Peers of our schema seen averaging with another codec (they never group with us)."""
    refusals: list[str] = field(default_factory=list)
    """Why this peer refused groups that leaders formed (for the NoGroupError)."""
    reading: asyncio.Task[None] | None = None
    """A read of the declarations in flight that join requests wait for (one at a time)."""
    first_seen: dict[bytes, float] = field(default_factory=dict)
    last_read: float = -math.inf
    """``time.monotonic()`` when the last successful read of the declarations started."""
    last_change: float = -math.inf
    """``time.monotonic()`` when a follower last joined or left."""
    taken: set[bytes] = field(default_factory=set)
    """Peers that closed leaders told us are in their (already formed) group."""
    not_looking: set[bytes] = field(default_factory=set)
    """Declarers that answered they no longer look under our key (they averaged or gave
    up; their declaration outlives them until it expires)."""
    lonely_reads: int = 0
    """Reads of the declarations in a row while alone (see ``_read_interval``)."""
    declaring: asyncio.Task[None] | None = None
    """Retries of a declaration whose first store did not finish in time (see ``_declare``)."""
    read_failures: int = 0
    """Reads of the declarations in a row that missed their deadline (see ``_dht_budget``)."""

    @property
    def num_members(self) -> int:
        return 1 + len(self.followers)

    def member_ids(self) -> frozenset[bytes]:
        return frozenset((self.me.peer_id, *self.followers))

    def elsewhere(self) -> set[bytes]:
        """Declarers that will not join us: in a group that closed, or no longer looking."""
        return self.taken | self.not_looking

    def away(self) -> frozenset[bytes]:
        """Peers that will not come although alive: they declared under our key with
        another schema or codec, or answered that they no longer look under it."""
        ours = {d.peer_id for d in self.declarations}
        foreign = {p for p in self.signed if p not in ours}
        return frozenset(foreign | self.not_looking | set(self.mismatched) | set(self.other_codecs))

    def roster(self) -> FamilyRoster:
        """Every peer this round saw under its family (the next round's expectation):
        declarers of our schema and codec, our group, groups that closed elsewhere."""
        peers: dict[bytes, str | None] = {d.peer_id: d.address or None for d in self.declarations}
        for peer_id in (*self.followers, *self.taken, *self.previous):
            if peer_id in self.away() or peer_id in self.gone:
                continue
            declared = self.signed.get(peer_id)
            peers.setdefault(
                peer_id, declared.address if declared else self.previous_addresses.get(peer_id)
            )
        if self.result.done() and not self.result.cancelled():
            for member in self.result.result().members:
                peers.setdefault(member.peer_id, member.address)
        peers.pop(self.me.peer_id, None)
        return FamilyRoster(peers, len(self.declarations))


@dataclass(frozen=True)
class _ClosedRound:
    """A round of ours under a key that formed its group: late askers learn of it."""

    expiry: float
    """``time.monotonic()`` after which it is forgotten (its members gave up by then)."""
    members: frozenset[bytes]
    led: _LedGroup | None
    """The group, if we led it."""
    family: str
    schema_hash: bytes


@dataclass(frozen=True)
class _LedGroup:
    """A group this peer led and closed, and the declared start of each member in it."""

    group: GroupInfo
    starts: Mapping[bytes, float]

    def seat_of(self, peer_id: bytes, declared_start: float) -> bool:
        """Whether this request comes from a member of the group, for that same round
        (a later round of the member under a reused key declares a later start)."""
        return self.group.index_of(peer_id) is not None and self.starts.get(peer_id) == (
            declared_start
        )


@dataclass(frozen=True)
class _Redirect:
    peer_id: bytes
    address: str


class Matchmaker:
    """Forms groups for one peer; serves the ``JoinGroup`` RPC for its rounds in flight.

    Several rounds may run at once under different keys; one key runs one round at a time.
    Create inside the running event loop.
    """

    def __init__(
        self,
        dht: DHTAccess,
        run_id: str,
        address: str | None,
        channels: ChannelPool,
        config: MatchmakerConfig | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.dht = dht
        self.run_id = run_id
        self.peer_id = dht.peer_id
        self.address = address or ""
        self.channels = channels
        self.config = config or MatchmakerConfig()
        self.observer = observer
        self._rounds: dict[str, _Round] = {}
        self.dht_latency = Latency(initial=self.config.initial_latency)
        """Seconds one DHT read or write of a declaration takes here (measured)."""
        self.rpc_latency = Latency(initial=self.config.initial_latency)
        """Seconds a leader takes to answer ``JoinGroup`` (measured)."""
        self.closes: collections.Counter[str] = collections.Counter()
        """Groups this peer closed as leader, by reason (full, quorum, complete, deadline)."""
        # key -> our round there that formed a group: answers late joiners.
        self._closed: collections.OrderedDict[str, _ClosedRound] = collections.OrderedDict()
        # family -> every peer this peer saw in its last round there (``roster``)
        self._last: collections.OrderedDict[str, FamilyRoster] = collections.OrderedDict()
        self.presence: RunPresence | None = None
        """This averager's entry among the run's averagers (see :meth:`announce`)."""

    def announce(self, mode: Mode) -> None:
        """Start announcing this averager under ``{run}.averagers`` (idempotent): rounds of
        the run's other peers expect it in a family's first round (``roster``)."""
        if self.presence is None:
            address = "" if mode is Mode.CLIENT else self.address
            me = Presence(self.peer_id, address, mode)
            self.presence = RunPresence(self.dht, self.run_id, me, timeout=self.config.dht_timeout)
            self.presence.start()

    def carry_previous(self, family: str, next_family: str, companions: Collection[bytes]) -> None:
        """After a round under ``family``: when the next round is under the same family,
        it expects everyone this one saw (its roster). Under another family (Moshpit's
        group bits moved us), only ``companions``, the members that move to the same bits,
        meet us there; nothing stays expected under ``family``."""
        roster = self._last.pop(family, FamilyRoster())
        if _has_group_bits(family):
            # Only companions declare under our next key, even when our bits came out
            # unchanged: the others moved to other bits, and waiting for them (alive, so no
            # probe drops them) would hold the group until matchmaking_time. What the round
            # saw says nothing of another family's declarations.
            peers = {p: a for p, a in roster.peers.items() if p in companions}
            roster = FamilyRoster(peers, roster.seen if next_family == family else 0)
        _remember(self._last, next_family, roster)

    def settle_time(self) -> float:
        """How long a new leader waits before its first close (from measured latency)."""
        return settle_time(self.dht_latency.value, self.rpc_latency.value)

    def _patience(self) -> float:
        """How long a declared peer stays expected before it joins (see ``closing``)."""
        return 2 * self.config.poll_interval + self.settle_time()

    # ------------------------------------------------------------------ follower side

    async def find_group(
        self, request: MatchRequest, inputs_ready: Awaitable[object] | None = None
    ) -> GroupInfo:
        """Find or lead a group under ``request.key``; return it once it is formed.

        Returns by ``request.give_up_by`` (plus one DHT or RPC deadline at most).

        ``inputs_ready``, when given, is awaited after the declaration is stored and
        before this peer joins or closes any group: the daemon's checked copy of the
        caller's tensors runs meanwhile (issue 21), and a failure of that check (NaN in
        the caller's own tensors) ends the search before any group counts this peer.

        Raises:
            NoGroupError: fewer than ``min_group_size`` peers before the give-up time.
            SchemaMismatchError: no group formed, and peers with another schema were seen.
            ValueError: a round under this key is already in progress here.
        """
        if request.key in self._rounds:
            raise ValueError(f"already matchmaking under {request.key!r}")
        # Declarations are read by other peers, so they carry wall-clock times: the one
        # place where the round's monotonic instants move onto the DHT's clock.
        now = time.time()
        to_wall = now - time.monotonic()
        me = Declaration(
            peer_id=self.peer_id,
            address="" if request.mode is Mode.CLIENT else self.address,
            start=now,
            deadline=max(now, request.close_by + to_wall),
            give_up=max(now, request.give_up_by + to_wall),
            mode=request.mode,
            bandwidth=request.bandwidth,
            schema_hash=request.schema_hash,
            group_size=request.group_size,
            aggregation=request.aggregation,
            codec=request.codec,
            data_port=request.data_port if request.mode is not Mode.CLIENT and self.address else 0,
            user_data_digest=user_data_digest(request.user_data),
        )
        family = request.family or request.key
        started = time.monotonic()
        roster = await self._roster_for(family, request.give_up_by)
        rnd = _Round(
            request,
            me,
            asyncio.get_running_loop().create_future(),
            started=started,
            previous=frozenset(roster.peers),
            previous_addresses=roster_addresses(roster.peers),
            previous_seen=roster.seen,
            proven_roster=roster.proven,
        )
        self._rounds[request.key] = rnd
        try:
            await self._declare(rnd)
            if inputs_ready is not None:
                await inputs_ready
            group = await self._search(rnd)
            members = frozenset(m.peer_id for m in group.members)
            expiry = rnd.started + _give_up_seconds(me)
            closed = _ClosedRound(expiry, members, _led_group(rnd), family, request.schema_hash)
            _remember(self._closed, request.key, closed)
            return group
        finally:
            # Also after a failure: a peer stranded in this round expects, in its next
            # one, every peer it saw here (its next round heals the split).
            seen = rnd.roster()
            if seen.peers:
                _remember(self._last, family, seen)
            if self._rounds.get(request.key) is rnd:
                del self._rounds[request.key]
            self._disband(rnd, "the leader stopped matchmaking")
            if rnd.reading is not None:
                await _cancel_and_wait(rnd.reading)
            if rnd.probing is not None:
                await _cancel_and_wait(rnd.probing)
            if rnd.declaring is not None:
                await _cancel_and_wait(rnd.declaring)

    async def _roster_for(self, family: str, give_up_by: float) -> FamilyRoster:
        """Whom a round under ``family`` expects besides its declarers: everyone seen in
        this peer's last round of the family, or, in the family's first round, the run's
        other averaging daemons (their presence entries). With Moshpit group bits a
        first round expects nobody: only the peers of the same bits meet, and a presence
        entry does not say which bits a peer holds."""
        roster = self._last.get(family)
        if roster is not None and roster.peers:
            return roster
        if self.presence is None or not self.config.expect_run_members or _has_group_bits(family):
            return roster or FamilyRoster()
        try:
            async with asyncio.timeout(max(0.05, give_up_by - time.monotonic())):
                others = await self.presence.others()
        except TimeoutError:
            return FamilyRoster()
        return FamilyRoster(dict(others), 0, proven=False)

    def _dht_budget(self, failures: int, give_up: float) -> float:
        """Deadline of one DHT store or read after ``failures`` that missed theirs in a row.

        It doubles with each miss (up to 8x ``dht_timeout``), within the give-up time: when
        a whole swarm starts a round at once, the burst of stores and reads can keep the
        DHT nodes busy for longer than ``dht_timeout``; a fixed deadline then cancels every
        operation before it completes, each retry adds to the same burst, and no peer ever
        sees another (issue 21, 256 peers). A growing one lets the burst drain.
        """
        budget = self.config.dht_timeout * 2.0 ** min(failures, 3)
        return min(budget, max(0.05, give_up - time.time()))

    async def _store_declaration(self, rnd: _Round, budget: float, read_back: bool = False) -> bool:
        """Store our declaration; with ``read_back``, the same lookup reads the key too,
        and the read stands for the round's first read when it passes ``_read_back_stands``."""
        subkey = declaration_subkey(self.peer_id)
        args = (rnd.request.key, rnd.me.encode(), rnd.me.give_up)
        replicas = self.config.declaration_replicas
        try:
            started = time.monotonic()
            async with asyncio.timeout(budget):
                if read_back:
                    ok, record = await self.dht.store_and_get(
                        *args, subkey=subkey, replicas=replicas
                    )
                else:
                    ok = await self.dht.store(*args, subkey=subkey, replicas=replicas)
            self.dht_latency.observe(time.monotonic() - started)
        except (TimeoutError, grpc.aio.AioRpcError) as error:
            log.debug("declaring under %s failed: %r", rnd.request.key, error)
            return False
        if read_back:
            found = _decode_declarations(record)
            if self._read_back_stands(rnd, found):
                self._apply_declarations(rnd, found, started)
        return ok

    def _read_back_stands(self, rnd: _Round, found: list[Declaration]) -> bool:
        """Whether a read made with our store stands for the round's first read (the rule
        is :func:`~swarmavg.averaging.matchmaking.closing.read_back_suffices`)."""
        seen = {
            p
            for p, d in self._current(rnd, found, time.time()).items()
            if d.schema_hash == rnd.me.schema_hash and d.codec == rnd.me.codec
        }
        return read_back_suffices(seen, rnd.previous, rnd.previous_seen, rnd.request.group_size)

    def _current(
        self, rnd: _Round, found: list[Declaration], now: float
    ) -> dict[bytes, Declaration]:
        """The declarations of ``found`` that are live at wall time ``now``, ours included.

        A start outside the window is ignored (issue 17): the earliest start leads, so a
        declaration with start=-1e300 would otherwise lead every round."""
        current = {
            d.peer_id: d
            for d in found
            if d.give_up > now and d.within_window(now, self.config.start_window)
        }
        current[self.peer_id] = rnd.me
        return current

    async def _declare(self, rnd: _Round) -> None:
        """Store our declaration; when the store misses its deadline, keep retrying it in
        the background (``rnd.declaring``) while we look for a leader: a peer nobody can
        see can never lead, and when every peer's first store failed, nobody would."""
        budget = self._dht_budget(0, rnd.me.give_up)
        if not await self._store_declaration(rnd, budget, read_back=bool(rnd.previous_seen)):
            log.info(
                "declaration of %s under %s not stored yet; retrying while joining others",
                self.peer_id.hex()[:12],
                rnd.request.key,
            )
            rnd.declaring = asyncio.ensure_future(self._keep_declaring(rnd))
        self._notify(MatchmakingEvent.DECLARED, rnd.request.key, self.peer_id)

    async def _keep_declaring(self, rnd: _Round) -> None:
        failures = 1
        while time.time() < rnd.me.give_up and not rnd.closed:
            # jittered, so that a swarm's retries do not arrive as one burst again
            await asyncio.sleep(self.config.retry_after * random.uniform(0.5, 1.5))
            if await self._store_declaration(rnd, self._dht_budget(failures, rnd.me.give_up)):
                log.info(
                    "declaration of %s under %s stored at try %d, %.1fs after the start",
                    self.peer_id.hex()[:12],
                    rnd.request.key,
                    failures + 1,
                    time.monotonic() - rnd.started,
                )
                return
            failures += 1
        if not rnd.closed:
            log.warning(
                "declaration of %s under %s was never stored; only joined others",
                self.peer_id.hex()[:12],
                rnd.request.key,
            )

    async def _read_declarations(
        self, key: str, give_up: float, failures: int = 0
    ) -> list[Declaration] | None:
        """The declarations under ``key``; ``None`` when the read failed (not: nobody)."""
        budget = self._dht_budget(failures, give_up)
        try:
            started = time.monotonic()
            async with asyncio.timeout(budget):
                record = await self.dht.get(key, latest=True, quorum=self.config.read_quorum)
            self.dht_latency.observe(time.monotonic() - started)
        except (TimeoutError, grpc.aio.AioRpcError) as error:
            log.debug("reading declarations under %s failed: %r", key, error)
            return None
        return _decode_declarations(record)

    async def _search(self, rnd: _Round) -> GroupInfo:
        me = rnd.me
        banned: dict[bytes, float] = {}  # peer id -> unix time until which we skip it
        redirect: _Redirect | None = None
        redirects = 0
        # time.monotonic() of the next read of the declarations: at once, unless the read
        # made with our store stood for it (``_read_back_stands``) and names a leader to join.
        next_read = 0.0
        if rnd.last_read > -math.inf and self._pick_leader(rnd, banned) is not None:
            next_read = rnd.last_read + self._read_interval(rnd)
        while True:
            if rnd.result.done():
                return rnd.result.result()
            now = time.monotonic()
            if rnd.leader is None and me.can_lead:
                self._probe_missing_previous(rnd, now)
                reason = self._close_reason(rnd, now)
                if (
                    reason is None
                    and now >= rnd.request.close_by
                    and rnd.num_members >= rnd.request.min_group_size
                ):
                    reason = "deadline"
                if reason is not None:
                    return self._close(rnd, reason)
                if self._waits_for_a_fresh_read(rnd):
                    next_read = min(next_read, max(now, rnd.started + self.settle_time()))
            if now >= rnd.request.give_up_by:
                raise self._no_group_error(rnd)
            if redirect is None and now >= next_read:
                await self._refresh_declarations(rnd)
                next_read = time.monotonic() + self._read_interval(rnd)
                continue  # decide again on what we just read
            late = self._round_is_gone(rnd)
            if late is not None:
                raise late
            target: _Redirect | None = redirect
            redirect = None
            if target is None:
                target = self._pick_leader(rnd, banned)
                redirects = 0
            if target is None:
                await self._wait_as_leader(rnd, next_read)
                continue
            outcome = await self._race_with_result(rnd, self._try_leader(rnd, target, banned))
            if isinstance(outcome, GroupInfo):
                return outcome
            if isinstance(outcome, _Redirect):
                redirects += 1
                if redirects <= self.config.max_redirects and outcome.peer_id != self.peer_id:
                    redirect = outcome

    async def _refresh_declarations(self, rnd: _Round) -> None:
        """Read the declarations under our key; keep the live ones of our schema."""
        started = time.monotonic()
        found = await self._read_declarations(rnd.request.key, rnd.me.give_up, rnd.read_failures)
        if found is None:
            rnd.read_failures += 1
            return  # keep what we knew: a failed read must not look like an empty key
        rnd.read_failures = 0
        self._apply_declarations(rnd, found, started)

    def _apply_declarations(self, rnd: _Round, found: list[Declaration], started: float) -> None:
        """Take a read of the declarations that began at ``started`` as the round's view."""
        now_wall = time.time()
        # Remembered across reads: a later read may fail or miss them.
        for other in mismatched_schemas(found, rnd.me):
            rnd.mismatched[other.peer_id] = other.schema_hash
        signed = self._current(rnd, found, now_wall)
        rnd.signed = signed
        for other in signed.values():
            if other.schema_hash == rnd.me.schema_hash and other.codec != rnd.me.codec:
                rnd.other_codecs[other.peer_id] = other.codec
        live = {
            p: d
            for p, d in signed.items()
            if d.schema_hash == rnd.me.schema_hash and d.codec == rnd.me.codec
        }
        for peer_id in live:
            rnd.first_seen.setdefault(peer_id, started)
        rnd.declarations = tuple(live.values())
        rnd.last_read = started

    def _read_interval(self, rnd: _Round) -> float:
        """Seconds until the next read of the declarations.

        A peer still alone reads again soon (one settle time, doubling up to
        ``poll_interval``): it may have read before an earlier peer's declaration was
        visible, and would otherwise sit as a leader nobody joins while its peers wait for
        it. Once it has company, or follows someone, it polls at ``poll_interval``; the
        doubling bounds the load a large swarm puts on the DHT.
        """
        if rnd.leader is not None or rnd.followers:
            rnd.lonely_reads = 0
            return self.config.poll_interval
        interval = min(self.config.poll_interval, self.settle_time() * 2.0**rnd.lonely_reads)
        rnd.lonely_reads += 1
        return interval

    def _leader_view(self, rnd: _Round) -> LeaderView:
        return LeaderView(
            me=rnd.me,
            members=rnd.member_ids(),
            declarations=rnd.declarations or (rnd.me,),
            first_seen=rnd.first_seen,
            previous=rnd.previous,
            taken=frozenset(rnd.taken),
            group_size=rnd.request.group_size,
            min_group_size=rnd.request.min_group_size,
            wanted=rnd.request.wanted,
            gone=frozenset(rnd.gone),
            away=rnd.away(),
            proven_roster=rnd.proven_roster,
        )

    def _close_reason(self, rnd: _Round, now: float) -> str | None:
        fresh = rnd.last_read >= max(rnd.last_change, rnd.started + self.settle_time())
        return close_reason(
            self._leader_view(rnd),
            now,
            rnd.started,
            self.settle_time(),
            self._patience(),
            fresh=fresh,
        )

    def _waits_for_a_fresh_read(self, rnd: _Round) -> bool:
        """Everyone expected is in, but the last read may have missed a newcomer."""
        if rnd.num_members < rnd.request.min_group_size:
            return False
        view = self._leader_view(rnd)
        return expected_members(view, time.monotonic(), self._patience()) <= view.members

    def _pick_leader(self, rnd: _Round, banned: dict[bytes, float]) -> _Redirect | None:
        """The leader to ask next: the one the balanced assignment gives us, else the best
        other candidate; ``None`` when we lead (or nobody can)."""
        me = rnd.me
        now_wall = time.time()
        elsewhere = rnd.elsewhere()
        pool = [d for d in rnd.declarations if d.peer_id not in elsewhere] or [me]
        assignment = assign_leaders(pool, rnd.request.group_size)
        mine = assignment.get(self.peer_id)
        if mine == self.peer_id:
            return None  # we lead a group of the split; our followers come to us
        excluded = {p for p, until in banned.items() if until > now_wall} | rnd.taken
        candidates = leader_candidates(rnd.declarations, me, now_wall, excluded)
        candidates.sort(key=lambda d: d.peer_id != mine)  # stable: our assigned leader first
        if not candidates:
            return None
        return _Redirect(candidates[0].peer_id, candidates[0].address)

    def _round_is_gone(self, rnd: _Round) -> NoGroupError | None:
        """Fail at once when the group we belonged to closed without us and nobody is left
        to average with (a late peer must not sit out its whole timeout alone).

        Left to average with: a declarer that is neither in the closed group nor known to
        have stopped looking, and that was first seen less than the patience ago. After
        that a declarer that has not joined us, nor taken us, is not coming (the closing
        rule's own test): most often a peer as late as we are that already failed this
        way, whose declaration lives on until it expires.
        """
        if not rnd.taken or rnd.followers or rnd.leader is not None:
            return None
        now = time.monotonic()
        patience = self._patience()
        elsewhere = rnd.elsewhere()
        others = [
            d
            for d in rnd.declarations
            if d.peer_id != self.peer_id
            and d.peer_id not in elsewhere
            and now - rnd.first_seen.get(d.peer_id, now) <= patience
        ]
        if 1 + len(others) >= rnd.request.min_group_size:
            return None
        return NoGroupError(
            f"the round under {rnd.request.key!r} closed before this peer joined: "
            f"{len(rnd.taken)} peer(s) ({short_ids(rnd.taken)}) averaged without it and no "
            f"other peer is looking; min_group_size is {rnd.request.min_group_size}"
        )

    def _probe_missing_previous(self, rnd: _Round, now: float) -> None:
        """Once per round, after the settle time: dial the previous members that have not
        declared. A killed daemon's port refuses the connection at once, so the fast quorum
        stops waiting for it instead of holding the group until ``close_by``; a peer that
        is only slow (or unreachable: a timeout proves nothing) stays expected."""
        if rnd.probing is not None or now < rnd.started + self.settle_time():
            return
        declared = {d.peer_id for d in rnd.declarations}
        missing = {
            peer_id: address
            for peer_id, address in rnd.previous_addresses.items()
            if peer_id not in declared
            and peer_id not in rnd.taken
            and peer_id not in rnd.followers
            and peer_id not in rnd.signed
        }
        if missing:
            rnd.probing = asyncio.ensure_future(self._probe(rnd, missing))

    async def _probe(self, rnd: _Round, addresses: Mapping[bytes, str]) -> None:
        async def refused(address: str) -> bool:
            host, _, port = address.rpartition(":")
            try:
                async with asyncio.timeout(self.config.join_timeout):
                    _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            except (TimeoutError, ValueError):
                return False  # no answer is not a refusal: it may be a slow or far peer
            except OSError:
                return True  # refused, or no route to it: nothing listens there
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return False

        answers = await asyncio.gather(*(refused(a) for a in addresses.values()))
        dead = {peer_id for peer_id, no in zip(addresses, answers, strict=True) if no}
        if dead:
            log.info(
                "previous member(s) %s of %s refused a connection: not waiting for them",
                short_ids(dead),
                rnd.request.key,
            )
            rnd.gone |= dead
            rnd.changed.set()

    async def _wait_as_leader(self, rnd: _Round, next_read: float) -> None:
        """Sleep until a follower arrives or leaves, the group forms, or the next check."""
        now = time.monotonic()
        wake = min(next_read, rnd.request.give_up_by)
        if rnd.request.close_by > now:
            wake = min(wake, rnd.request.close_by)
        rnd.changed.clear()
        changed: asyncio.Future[Any] = asyncio.ensure_future(rnd.changed.wait())
        waits: set[asyncio.Future[Any]] = {changed, rnd.result}
        try:
            await asyncio.wait(
                waits,
                timeout=max(0.0, wake - now) + 0.001,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            await _cancel_and_wait(changed)

    async def _race_with_result(self, rnd: _Round, attempt: Any) -> GroupInfo | _Redirect | None:
        """Run one join attempt; stop it when our own group forms meanwhile."""
        task: asyncio.Task[GroupInfo | _Redirect | None] = asyncio.ensure_future(attempt)
        waits: set[asyncio.Future[Any]] = {task, rnd.result}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel_and_wait(task)
        if task.done() and not task.cancelled() and task.result() is not None:
            return task.result()
        if rnd.result.done():
            return rnd.result.result()
        return None

    async def _try_leader(
        self, rnd: _Round, target: _Redirect, banned: dict[bytes, float]
    ) -> GroupInfo | _Redirect | None:
        """Ask ``target`` to lead us; follow it when accepted until the group forms.

        Returns the formed group, a redirect, or ``None`` (try someone else); updates
        ``banned`` with how long to skip ``target``.
        """
        req, me = rnd.request, rnd.me
        forever = math.inf
        request = averaging_pb2.JoinRequest(
            key=req.key,
            schema_hash=req.schema_hash,
            mode=int(req.mode),
            bandwidth=req.bandwidth,
            user_data=req.user_data,
            declared_start=me.start,
            data_port=req.data_port,
            aggregation=req.aggregation,
        )
        # Signed for the leader we dial (its id is in its declaration): nobody else can
        # replay this request, and nobody can send one in our name.
        request.header.CopyFrom(
            self.dht.signer.sign(target.peer_id, JOIN_GROUP, message_digest(request))
        )
        call = join_group_method(self.channels.channel(target.address))(
            request, timeout=max(0.1, me.give_up - time.time() + 1.0)
        )
        following = False
        try:
            asked = time.monotonic()
            async with asyncio.timeout(self.config.join_timeout):
                first = await call.read()
            self.rpc_latency.observe(time.monotonic() - asked)
            if first is grpc.aio.EOF:
                banned[target.peer_id] = time.time() + self.config.retry_after
                return None
            code = first.code
            if code == averaging_pb2.JOIN_REDIRECT:
                banned[target.peer_id] = time.time() + self.config.retry_after
                if (
                    len(first.leader_id) == 20
                    and 0 < len(first.leader_address) <= MAX_ADDRESS_CHARS
                ):
                    return _Redirect(bytes(first.leader_id), first.leader_address)
                return None
            if code == averaging_pb2.JOIN_GROUP_FORMED:
                # We hold a seat in the group it closed (we had left its stream): take it.
                return await self._take_formed_group(rnd, first.group, target, banned)
            if code == averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH:
                rnd.mismatched[target.peer_id] = b""
                banned[target.peer_id] = forever
                return None
            if code == averaging_pb2.JOIN_REJECT_FULL and first.taken:
                rnd.taken |= _peer_ids(first.taken)
            if code == averaging_pb2.JOIN_REJECT_BAD_REQUEST:
                # Most often: the leader has not read our declaration yet. Ask again soon.
                log.debug("%s refused our request: %s", target.peer_id.hex()[:8], first.detail)
                banned[target.peer_id] = time.time() + self._backoff(rnd, target.peer_id)
                return None
            if code == averaging_pb2.JOIN_REJECT_NOT_LOOKING:
                rnd.not_looking.add(target.peer_id)
            if code != averaging_pb2.JOIN_ACCEPTED:
                log.debug(
                    "%s rejected us: %s %s",
                    target.peer_id.hex()[:8],
                    FINAL_CODES_TEXT.get(code, code),
                    first.detail,
                )
                banned[target.peer_id] = forever
                return None
            if rnd.closed or rnd.result.done():
                return None  # our own group formed meanwhile; the cancel below leaves
            following = True
            rnd.leader = (target.peer_id, target.address)
            self._release_followers(
                rnd,
                averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_REDIRECT,
                    leader_id=target.peer_id,
                    leader_address=target.address,
                ),
            )
            self._notify(MatchmakingEvent.JOINED_LEADER, req.key, target.peer_id)
            async with asyncio.timeout(max(0.0, me.give_up - time.time())):
                final = await call.read()
            if final is grpc.aio.EOF:
                banned[target.peer_id] = time.time() + self._backoff(rnd, target.peer_id)
                return None
            if final.code == averaging_pb2.JOIN_GROUP_FORMED:
                return await self._take_formed_group(rnd, final.group, target, banned)
            if final.code == averaging_pb2.JOIN_REDIRECT:
                banned[target.peer_id] = time.time() + self.config.retry_after
                if (
                    len(final.leader_id) == 20
                    and 0 < len(final.leader_address) <= MAX_ADDRESS_CHARS
                ):
                    return _Redirect(bytes(final.leader_id), final.leader_address)
                return None
            banned[target.peer_id] = time.time() + self.config.retry_after
            return None
        except (grpc.aio.AioRpcError, TimeoutError) as error:
            # Dead, or only slow (a loaded machine): retry later with a growing pause
            # rather than writing it off; a dead peer fails fast, a slow one may answer.
            if (
                isinstance(error, grpc.aio.AioRpcError)
                and error.code() == grpc.StatusCode.UNAUTHENTICATED
            ):
                # Our own signed request refused: most likely our clock is off by more than
                # the peers' auth_window (docs/security.md); say so where a user looks.
                log.warning(
                    "leader %s refused our join: %s", target.peer_id.hex()[:8], error.details()
                )
            else:
                log.debug("leader %s failed: %r", target.peer_id.hex()[:8], error)
            banned[target.peer_id] = time.time() + self._backoff(rnd, target.peer_id)
            return None
        finally:
            if following and not rnd.closed:
                rnd.leader = None
                self._notify(MatchmakingEvent.LEFT_LEADER, req.key, target.peer_id)
            call.cancel()

    async def _take_formed_group(
        self,
        rnd: _Round,
        message: averaging_pb2.GroupDescription,
        leader: _Redirect,
        banned: dict[bytes, float],
    ) -> GroupInfo | None:
        """Join the group a leader formed with us, once it passed our checks."""
        group = await self._check_group(rnd, message, leader.peer_id)
        if group is None or rnd.result.done():
            banned[leader.peer_id] = math.inf
            return None
        # Followers we took meanwhile (we may have left that leader's stream first) are
        # told at once; those of a normal join were redirected when it accepted us.
        self._release_followers(
            rnd,
            averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_DISBANDED,
                leader_id=self.peer_id,
                detail="this peer is in a group that formed elsewhere",
            ),
        )
        rnd.leader = (leader.peer_id, leader.address)
        rnd.closed = True
        rnd.result.set_result(group)
        self._notify(MatchmakingEvent.GROUP_FORMED, rnd.request.key, self.peer_id)
        return group

    def _backoff(self, rnd: _Round, peer_id: bytes) -> float:
        """Seconds to skip a peer after its n-th transport failure: doubling, capped."""
        rnd.failures[peer_id] = failures = rnd.failures.get(peer_id, 0) + 1
        return float(min(self.config.retry_after * 2 ** (failures - 1), MAX_BACKOFF))

    async def _check_group(
        self, rnd: _Round, message: averaging_pb2.GroupDescription, leader_id: bytes
    ) -> GroupInfo | None:
        """The group a leader formed, if it is what we asked for and what its members
        signed; ``None`` (logged, remembered for the NoGroupError) when we refuse it."""
        req = rnd.request
        ask = FollowerAsk(
            peer_id=self.peer_id,
            address=rnd.me.address or None,
            mode=req.mode,
            bandwidth=req.bandwidth,
            user_data=req.user_data,
            data_port=rnd.me.data_port,
            schema_hash=req.schema_hash,
            codec=req.codec,
            min_group_size=req.min_group_size,
            group_size=req.group_size,
            aggregation=req.aggregation,
        )
        members = [bytes(m.peer_id) for m in message.members[:MAX_GROUP_SIZE]]
        # A member declared after our last read, or our read missed its deadline while the
        # DHT was busy (a swarm that starts a round at once, issue 21): read again, a few
        # times at most, each under a longer deadline after a miss. Refusing a group only
        # because our view lags costs every member a partial round.
        # Only a read that completed counts: a read that missed its deadline saw nothing,
        # and at 256 peers 3 such reads in a row made a whole group's followers refuse it
        # for its leader's declaration, stored 40 s before (docs/benchmarks.md, "Scale,
        # session 8"). Failed reads go on, each under a longer deadline, until give-up.
        completed = 0
        while completed < _MEMBER_READS:
            if all(p in rnd.signed for p in members) or time.time() >= rnd.me.give_up:
                break
            last_read = rnd.last_read
            await self._refresh_once(rnd)
            if rnd.last_read != last_read:
                completed += 1
            else:  # failed (a failure can be quick): pause, as a store retry does
                await asyncio.sleep(self.config.retry_after * random.uniform(0.5, 1.5))
        try:
            return check_formed_group(message, ask, leader_id, rnd.signed)
        except ValueError as error:
            reason = f"leader {leader_id.hex()[:12]} formed a group this peer refused: {error}"
            log.warning("%s: %s", req.key, reason)
            rnd.refusals.append(reason)
            return None

    async def _refresh_once(self, rnd: _Round) -> None:
        """Read the declarations, sharing one read among everyone who needs it now."""
        if rnd.reading is None or rnd.reading.done():
            rnd.reading = asyncio.ensure_future(self._refresh_declarations(rnd))
        await asyncio.shield(rnd.reading)

    async def _verify_follower(
        self, rnd: _Round, member: Member, declared_start: float
    ) -> str | None:
        """Why a would-be follower's request differs from its signed declaration, or
        ``None``: a leader lists only members whose entries their owners signed."""
        declaration = rnd.signed.get(member.peer_id)
        if declaration_mismatch(member, declaration) is not None:
            await self._refresh_once(rnd)  # it may have declared after our last read
            declaration = rnd.signed.get(member.peer_id)
        reason = declaration_mismatch(member, declaration)
        if reason is None and declaration is not None:
            if declaration.start != declared_start:
                reason = "declared start differs from its signed one"
            elif declaration.codec != rnd.request.codec:
                reason = (
                    f"it averages with codec {declaration.codec!r}, this group with "
                    f"{rnd.request.codec!r}"
                )
        return reason

    def _no_group_error(self, rnd: _Round) -> Exception:
        req = rnd.request
        mismatched = set(rnd.mismatched)
        if mismatched:
            ids = ", ".join(sorted(p.hex()[:12] for p in mismatched))
            return SchemaMismatchError(
                f"no group formed under {req.key!r}: peer(s) {ids} average tensors of another "
                f"schema (different count, order, shapes or dtypes; our schema hash "
                f"{req.schema_hash.hex()[:12]}); every peer must pass the same tensor layout"
            )
        came = rnd.member_ids()
        expected = expected_members(self._leader_view(rnd), time.monotonic(), self._patience())
        refused = f"; refused: {'; '.join(rnd.refusals[-3:])}" if rnd.refusals else ""
        if rnd.other_codecs:
            codecs = ", ".join(
                f"{p.hex()[:12]} ({c!r})" for p, c in sorted(rnd.other_codecs.items())[:4]
            )
            refused += (
                f"; peer(s) {codecs} average with another codec than {req.codec!r}: "
                "a group has one codec, which every member asked for"
            )
        return NoGroupError(
            f"only {rnd.num_members} peer(s) gathered under {req.key!r} within "
            f"{_give_up_seconds(rnd.me):.1f}s; min_group_size is {req.min_group_size} "
            f"(expected: {short_ids(expected)}; came: {short_ids(came)}; declared: "
            f"{short_ids({d.peer_id for d in rnd.declarations})}){refused}"
        )

    # ------------------------------------------------------------------ leader side

    def _close(self, rnd: _Round, reason: str = "full") -> GroupInfo:
        """Freeze the member list, answer every follower, resolve our own result."""
        req = rnd.request
        log.debug(
            "closing %s with %d member(s) (%s) after %.3fs",
            req.key,
            rnd.num_members,
            reason,
            time.monotonic() - rnd.started,
        )
        me = Member(
            peer_id=self.peer_id,
            address=rnd.me.address or None,
            mode=req.mode,
            bandwidth=req.bandwidth,
            user_data=req.user_data,
            data_port=req.data_port if rnd.me.address else 0,
        )
        members = sorted([me, *(f.member for f in rnd.followers.values())], key=lambda m: m.peer_id)
        try:
            group = GroupInfo(
                group_id=os.urandom(16),
                members=tuple(members),
                schema_hash=req.schema_hash,
                codec=req.codec,
                aggregation=req.aggregation,
            )
        except ValueError as error:
            # e.g. only aux members: no one sends. Not a group anyone can use.
            raise MatchmakingError(f"cannot form a group: {error}") from None
        rnd.closed = True
        self.closes[reason] += 1
        self._release_followers(
            rnd,
            averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_GROUP_FORMED,
                leader_id=self.peer_id,
                group=group_to_proto(group),
            ),
        )
        rnd.result.set_result(group)
        self._notify(MatchmakingEvent.GROUP_FORMED, req.key, self.peer_id)
        return group

    def _release_followers(self, rnd: _Round, final: averaging_pb2.JoinResponse) -> None:
        for follower in rnd.followers.values():
            if not follower.outcome.done():
                follower.outcome.set_result(final)
        if final.code != averaging_pb2.JOIN_GROUP_FORMED:
            rnd.followers.clear()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[averaging_pb2.JoinResponse]:
        """Answer a would-be follower at once; if accepted, stream the outcome later."""
        try:
            peer_id = self.dht.authenticator.check(
                request.header, JOIN_GROUP, message_digest(request)
            )
        except AuthenticationError as error:
            # A copied or replayed header: refused before it can displace anyone's join.
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
        except HeaderError as error:
            yield averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_REJECT_BAD_REQUEST,
                leader_id=self.peer_id,
                detail=str(error),
            )
            return
        try:
            member = member_from_join_request(peer_id, request)
            aggregation = requested_aggregation(request)
        except (HeaderError, ValueError) as error:
            yield averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_REJECT_BAD_REQUEST,
                leader_id=self.peer_id,
                detail=str(error),
            )
            return
        rnd = self._rounds.get(request.key)
        if rnd is None or rnd.result.done():
            self._note_late_asker(request.key, peer_id, member, bytes(request.schema_hash))
            taken = self._closed_members(request.key)
            if rnd is not None and rnd.result.done() and not rnd.result.cancelled():
                taken = frozenset(m.peer_id for m in rnd.result.result().members)
            led = self._led_group(request.key, rnd)
            if led is not None and led.seat_of(peer_id, request.declared_start):
                # A member of the group we closed asks again: it left its stream after we
                # gave it a seat (its first answer came after its join_timeout on a busy
                # loop) or lost it. It is in the group the others are averaging now: tell
                # it, rather than leave its seat empty and every member partial (issue 21).
                yield averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_GROUP_FORMED,
                    leader_id=self.peer_id,
                    group=group_to_proto(led.group),
                    detail="you are a member of the group that formed",
                )
                return
            if taken is not None:  # our group under that key already formed
                yield averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_REJECT_FULL,
                    leader_id=self.peer_id,
                    taken=sorted(taken),
                    detail="the group under that key already formed",
                )
                return
            code = (
                averaging_pb2.JOIN_REJECT_FULL
                if rnd is not None and rnd.closed
                else (averaging_pb2.JOIN_REJECT_NOT_LOOKING)
            )
            yield averaging_pb2.JoinResponse(code=code, leader_id=self.peer_id)
            return
        if peer_id == self.peer_id:
            yield averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_REJECT_BAD_REQUEST,
                leader_id=self.peer_id,
                detail="a peer cannot join itself",
            )
            return
        stale = rnd.followers.pop(peer_id, None) if not rnd.closed else None
        if stale is not None and not stale.outcome.done():
            # The follower gave up on its earlier stream (e.g. our answer came after its
            # deadline) and asks again before we noticed: the newer request wins.
            stale.outcome.set_result(
                averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_DISBANDED,
                    leader_id=self.peer_id,
                    detail="superseded by a newer request from the same peer",
                )
            )
        can_lead = member.mode is not Mode.CLIENT and bool(member.address)

        def decide() -> averaging_pb2.JoinCode:
            """The answer to this request on the round's present state (asked twice: the
            follower's verification reads the DHT, and the round may move meanwhile)."""
            state = JoinState(
                me=rnd.me,
                following=rnd.leader is not None,
                closed=rnd.closed,
                num_members=rnd.num_members,
                group_size=rnd.request.group_size,
            )
            return decide_join(
                state,
                (request.declared_start, peer_id),
                can_lead,
                bytes(request.schema_hash),
                aggregation,
            )

        code = decide()
        if code == averaging_pb2.JOIN_REDIRECT and rnd.leader is not None:
            yield averaging_pb2.JoinResponse(
                code=code, leader_id=rnd.leader[0], leader_address=rnd.leader[1]
            )
            return
        if code == averaging_pb2.JOIN_ACCEPTED:
            reason = await self._verify_follower(rnd, member, request.declared_start)
            if reason is not None:
                yield averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_REJECT_BAD_REQUEST,
                    leader_id=self.peer_id,
                    detail=f"not what you signed: {reason}",
                )
                return
            if self._rounds.get(request.key) is not rnd or rnd.result.done():
                yield averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_REJECT_NOT_LOOKING, leader_id=self.peer_id
                )
                return
            code = decide()  # the read took a while: decide again on the present state
            if code == averaging_pb2.JOIN_REDIRECT and rnd.leader is not None:
                yield averaging_pb2.JoinResponse(
                    code=code, leader_id=rnd.leader[0], leader_address=rnd.leader[1]
                )
                return
        if code != averaging_pb2.JOIN_ACCEPTED:
            detail = FINAL_CODES_TEXT.get(code, "")
            if code == averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH:
                rnd.mismatched[peer_id] = bytes(request.schema_hash)
                detail = (
                    f"schema hash {bytes(request.schema_hash).hex()[:12]} differs from "
                    f"the leader's {rnd.request.schema_hash.hex()[:12]}"
                )
            if code == averaging_pb2.JOIN_REJECT_AGGREGATION_MISMATCH:
                detail = (
                    f"the leader averages with {rnd.request.aggregation!r}, not {aggregation!r}"
                )
            yield averaging_pb2.JoinResponse(code=code, leader_id=self.peer_id, detail=detail)
            return
        follower = _Follower(
            member, asyncio.get_running_loop().create_future(), request.declared_start
        )
        rnd.followers[peer_id] = follower
        rnd.last_change = time.monotonic()
        rnd.changed.set()
        self._notify(MatchmakingEvent.FOLLOWER_ACCEPTED, request.key, peer_id)
        try:
            if rnd.num_members >= rnd.request.group_size:
                with contextlib.suppress(MatchmakingError):
                    self._close(rnd)
            yield averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_ACCEPTED, leader_id=self.peer_id, deadline=rnd.me.deadline
            )
            try:
                async with asyncio.timeout(max(0.0, rnd.me.give_up - time.time()) + 1.0):
                    final = await asyncio.shield(follower.outcome)
            except TimeoutError:
                final = averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_DISBANDED,
                    leader_id=self.peer_id,
                    detail="the leader gave up",
                )
            yield final
        finally:
            # A follower whose stream died before the group closed is simply forgotten:
            # it never blocks the group (issue 5).
            if not rnd.closed and rnd.followers.get(peer_id) is follower:
                del rnd.followers[peer_id]
                rnd.last_change = time.monotonic()
                rnd.changed.set()
                self._notify(MatchmakingEvent.FOLLOWER_LEFT, request.key, peer_id)

    def _closed_members(self, key: str) -> frozenset[bytes] | None:
        """Members of our group that formed under ``key``, while late joiners may ask."""
        entry = self._closed.get(key)
        if entry is None or entry.expiry < time.monotonic():
            return None
        return entry.members

    def _note_late_asker(self, key: str, peer_id: bytes, member: Member, schema: bytes) -> None:
        """A peer of our schema asked to join after our group under ``key`` formed: the
        next round of the family expects it (a late peer is waited for next time)."""
        entry = self._closed.get(key)
        if entry is None or entry.expiry < time.monotonic() or entry.schema_hash != schema:
            return
        if peer_id in entry.members or peer_id == self.peer_id:
            return
        roster = self._last.get(entry.family)
        if roster is not None:
            roster.add(peer_id, member.address)

    def _led_group(self, key: str, rnd: _Round | None) -> _LedGroup | None:
        """The group we led and closed under ``key``, while late joiners may ask."""
        if rnd is not None:
            return _led_group(rnd)
        entry = self._closed.get(key)
        if entry is None or entry.expiry < time.monotonic():
            return None
        return entry.led

    async def shutdown(self) -> None:
        """Disband every pending group here (followers are told at once); stop announcing."""
        for rnd in list(self._rounds.values()):
            self._disband(rnd, "the leader is shutting down")
        if self.presence is not None:
            await self.presence.stop()

    def _disband(self, rnd: _Round, detail: str) -> None:
        """Tell the followers of a group that never closed that it is off; end the round."""
        if not rnd.closed:
            self._release_followers(
                rnd,
                averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_DISBANDED, leader_id=self.peer_id, detail=detail
                ),
            )
        if not rnd.result.done():
            rnd.result.cancel()

    def _notify(self, event: MatchmakingEvent, key: str, peer_id: bytes) -> None:
        log.debug("%s %s %s", key, event.value, peer_id.hex()[:8])
        if self.observer is not None:
            self.observer(event, key, peer_id)


def _decode_declarations(record: Any) -> list[Declaration]:
    """The well-formed declarations in a DHT read of a key (``None``: none)."""
    found = []
    for subkey, value in dictionary_entries(record).items():
        declaration = decode_declaration(subkey, value)
        if declaration is not None:
            found.append(declaration)
    return found


def _led_group(rnd: _Round) -> _LedGroup | None:
    """The group ``rnd`` closed with this peer as its leader, if it did."""
    if rnd.leader is not None or not rnd.result.done() or rnd.result.cancelled():
        return None
    starts = {p: f.declared_start for p, f in rnd.followers.items()}
    return _LedGroup(rnd.result.result(), starts)


def _has_group_bits(family: str) -> bool:
    """Whether a family's key carries Moshpit group bits (``...0b01``, not ``...0b``)."""
    return bool(family.rpartition(".0b")[2])


def _give_up_seconds(me: Declaration) -> float:
    return me.give_up - me.start


def _peer_ids(raw: Any) -> set[bytes]:
    """Peer ids from a peer's message: 20 bytes each, at most a group's worth."""
    return {bytes(p) for p in list(raw)[:MAX_GROUP_SIZE] if len(p) == 20}


def _remember(table: collections.OrderedDict[str, Any], key: str, value: Any) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > _REMEMBERED_KEYS:
        table.popitem(last=False)
