"""Matchmaking over the DHT: peers averaging under one key form groups (docs/averaging.md).

Protocol (rules in :mod:`swarmavg.averaging.matchmaking.declarations`):

1. A peer declares itself under the round's matchmaking key (dictionary value, one subkey
   per declarer) with an expiration at its give-up time.
2. It reads the declarations and asks the best candidate leader (first in leader order: a
   hash of the key and the peer id, see ``declarations.leader_order``) to take it:
   ``JoinGroup``. Until it is accepted somewhere it is itself a potential leader and
   accepts the peers that come after it in that order.
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
to looking, bans that leader for the round, and still meets its own deadline; a follower
whose leader accepted it and does not close by the round's close deadline plus a grace
leaves it, shuns it under the key family and regroups with the others in the same call.
Nothing waits without a deadline: every call has one and the whole search ends at the
peer's give-up time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Collection

from swarmavg.averaging.dht_access import DHTAccess, dictionary_entries
from swarmavg.averaging.errors import NoGroupError, SchemaMismatchError
from swarmavg.averaging.group import GroupInfo, Mode
from swarmavg.averaging.matchmaking.closing import expected_members, roster_grace, short_ids
from swarmavg.averaging.matchmaking.config import (
    MatchmakerConfig,
    MatchmakingEvent,
    MatchRequest,
    Observer,
)
from swarmavg.averaging.matchmaking.declarations import Declaration, user_data_digest
from swarmavg.averaging.matchmaking.following import Following
from swarmavg.averaging.matchmaking.leading import Leading
from swarmavg.averaging.matchmaking.roster import (
    FamilyRoster,
    Presence,
    RunPresence,
    roster_addresses,
)
from swarmavg.averaging.matchmaking.round import (
    ClosedRound,
    Redirect,
    Round,
    give_up_seconds,
    has_group_bits,
    led_group_of,
    remember,
)
from swarmavg.averaging.tasks import cancel_and_wait

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


class Matchmaker(Following, Leading):
    """Forms groups for one peer; serves the ``JoinGroup`` RPC for its rounds in flight.

    Several rounds may run at once under different keys; one key runs one round at a time.
    Create inside the running event loop. The parts: :mod:`.declaring`, :mod:`.following`,
    :mod:`.leading`, the round's record in :mod:`.round`, whom a round expects in
    :mod:`.roster` and :mod:`.closing`.
    """

    def announce(self, mode: Mode) -> None:
        """Start announcing this averager under ``{run}.averagers`` (idempotent): rounds of
        the run's other peers expect it in a family's first round (``roster``)."""
        if self.presence is None:
            address = "" if mode is Mode.CLIENT else self.address
            me = Presence(self.peer_id, address, mode)
            self.presence = RunPresence(
                self.dht,
                self.run_id,
                me,
                timeout=self.config.dht_timeout,
                replicas=self.config.declaration_replicas,
                read_quorum=self.config.read_quorum,
            )
            self.presence.start()

    def carry_previous(self, family: str, next_family: str, companions: Collection[bytes]) -> None:
        """After a round under ``family``: when the next round is under the same family,
        it expects everyone this one saw (its roster). Under another family (Moshpit's
        group bits moved us), only ``companions``, the members that move to the same bits,
        meet us there; nothing stays expected under ``family``."""
        roster = self._last.pop(family, FamilyRoster())
        if has_group_bits(family):
            # Only companions declare under our next key, even when our bits came out
            # unchanged: the others moved to other bits, and waiting for them (alive, so no
            # probe drops them) would hold the group until matchmaking_time. What the round
            # saw says nothing of another family's declarations.
            peers = {p: a for p, a in roster.peers.items() if p in companions}
            roster = FamilyRoster(
                peers, roster.seen if next_family == family else 0, lateness=roster.lateness
            )
        remember(self._last, next_family, roster)

    async def find_group(
        self,
        request: MatchRequest,
        inputs_ready: Awaitable[object] | None = None,
        timings: dict[str, float] | None = None,
    ) -> GroupInfo:
        """Find or lead a group under ``request.key``; return it once it is formed.

        Returns by ``request.give_up_by`` (plus one DHT or RPC deadline at most).

        ``inputs_ready``, when given, is awaited after the declaration is stored and
        before this peer joins or closes any group: the daemon's checked copy of the
        caller's tensors runs meanwhile, and a failure of that check (NaN in
        the caller's own tensors) ends the search before any group counts this peer.

        ``timings``, when given, receives the seconds of each phase (``roster``,
        ``declare``, ``inputs``, ``search``), ``reads``, the reads of the declarations the
        search made, and ``led`` (1.0 when this peer led the group): where a round's
        matchmaking goes, for the result's timings.

        Raises:
            NoGroupError: fewer than ``min_group_size`` peers before the give-up time.
            SchemaMismatchError: no group formed, and peers with another schema were seen.
            ValueError: a round under this key is already in progress here.
        """
        phases = timings if timings is not None else {}
        if request.key in self._rounds:
            raise ValueError(f"already matchmaking under {request.key!r}")
        family = request.family or request.key
        started = time.monotonic()
        roster = await self._roster_for(family, request.give_up_by)
        phases["roster"] = time.monotonic() - started
        close_by = request.close_by
        if roster.peers and not roster.proven and request.latest_close_by:
            # A family's first round: the run's averagers it expects are processes that
            # start seconds apart (a trainer imports torch, loads its data): they are
            # waited for as long as the call allows, not only for matchmaking_time.
            close_by = max(close_by, request.latest_close_by)
        grace_by = math.inf
        if roster.peers and roster.proven:
            # Roster peers that have not declared are waited for as long as the family's
            # members have been late lately, not for the whole window (``roster_grace``).
            grace = roster_grace(roster.lateness, self.settle_time(), close_by - started)
            if grace < close_by - started:  # else the window's deadline says it
                grace_by = started + grace
        # Declarations are read by other peers, so they carry wall-clock times: the one
        # place where the round's monotonic instants move onto the DHT's clock.
        now = time.time()
        to_wall = now - time.monotonic()
        me = Declaration(
            peer_id=self.peer_id,
            address="" if request.mode is Mode.CLIENT else self.address,
            start=now,
            deadline=max(now, close_by + to_wall),
            give_up=max(now, request.give_up_by + to_wall),
            mode=request.mode,
            bandwidth=request.bandwidth,
            schema_hash=request.schema_hash,
            group_size=request.group_size,
            aggregation=request.aggregation,
            codec=request.codec,
            data_port=request.data_port if request.mode is not Mode.CLIENT and self.address else 0,
            user_data_digest=user_data_digest(request.user_data),
            key=request.key,
            signs_answers=not self._legacy_join,
        )
        rnd = Round(
            request,
            me,
            asyncio.get_running_loop().create_future(),
            started=started,
            close_by=close_by,
            previous=frozenset(roster.peers),
            previous_addresses=roster_addresses(roster.peers),
            previous_seen=roster.seen,
            previous_lateness=roster.lateness,
            roster_grace_by=grace_by,
            proven_roster=roster.proven,
            shunned=self.shunned_in(family),
        )
        self._rounds[request.key] = rnd
        try:
            mark = time.monotonic()
            if self._declares_beside(rnd):
                rnd.storing = asyncio.ensure_future(self._declare(rnd))
            else:
                await self._declare(rnd)
            phases["declare"], mark = time.monotonic() - mark, time.monotonic()
            if inputs_ready is not None:
                await inputs_ready
            phases["inputs"], mark = time.monotonic() - mark, time.monotonic()
            group = await self._search(rnd)
            phases["search"] = time.monotonic() - mark
            phases["reads"] = float(rnd.reads)
            phases["led"] = 1.0 if rnd.leader is None else 0.0
            members = frozenset(m.peer_id for m in group.members)
            expiry = request.give_up_by
            closed = ClosedRound(
                expiry, members, led_group_of(rnd), family, request.schema_hash, started
            )
            remember(self._closed, request.key, closed)
            return group
        finally:
            # Also after a failure: a peer stranded in this round expects, in its next
            # one, every peer it saw here (its next round heals the split).
            seen = rnd.roster(time.monotonic())
            if seen.peers:
                remember(self._last, family, seen)
            if self._rounds.get(request.key) is rnd:
                del self._rounds[request.key]
            rnd.disband("the leader stopped matchmaking")
            if rnd.reading is not None:
                await cancel_and_wait(rnd.reading)
            if rnd.probing is not None:
                await cancel_and_wait(rnd.probing)
            if rnd.storing is not None:
                await cancel_and_wait(rnd.storing)
            if rnd.declaring is not None:
                await cancel_and_wait(rnd.declaring)
            for call in list(rnd.calling):
                await cancel_and_wait(call)

    async def _roster_for(self, family: str, give_up_by: float) -> FamilyRoster:
        """Whom a round under ``family`` expects besides its declarers: everyone seen in
        this peer's last round of the family, or, in the family's first round, the run's
        other averaging daemons (their presence entries). With Moshpit group bits a
        first round expects nobody: only the peers of the same bits meet, and a presence
        entry does not say which bits a peer holds."""
        roster = self._last.get(family)
        if roster is not None and roster.peers:
            return roster
        if self.presence is None or not self.config.expect_run_members or has_group_bits(family):
            return roster or FamilyRoster()
        try:
            async with asyncio.timeout(max(0.05, give_up_by - time.monotonic())):
                others = await self.presence.others()
        except TimeoutError:
            return FamilyRoster()
        return FamilyRoster(dict(others), 0, proven=False)

    async def _search(self, rnd: Round) -> GroupInfo:
        me = rnd.me
        banned: dict[bytes, float] = {}  # peer id -> time.monotonic() until which we skip it
        redirect: Redirect | None = None
        redirects = 0
        # time.monotonic() of the next read of the declarations: at once, unless the read
        # made with our store stood for it (``_read_back_stands``) and names a leader to join.
        next_read = 0.0
        if rnd.last_read > -math.inf and self._pick_leader(rnd, banned) is not None:
            next_read = rnd.last_read + self._read_interval(rnd)
        else:
            # The steady state: ask the roster's leader at once, the read running meanwhile.
            redirect = self._roster_leader(rnd)
            # A store beside the search reads the key with it (``store_and_get``): that read
            # is the round's view when it stands, and no second lookup is made meanwhile.
            read_beside = rnd.storing is not None and rnd.previous_seen > 0
            if redirect is not None:
                rnd.predicted = redirect.peer_id
                if not read_beside and (rnd.reading is None or rnd.reading.done()):
                    rnd.reading = asyncio.ensure_future(self._refresh_declarations(rnd))
        while True:
            if rnd.result.done():
                return rnd.result.result()
            now = time.monotonic()
            if rnd.leader is None and me.can_lead:
                self._probe_missing_previous(rnd, now)
                reason = self._close_reason(rnd, now)
                if (
                    reason is None
                    and now >= rnd.close_by
                    and rnd.num_members >= rnd.request.min_group_size
                ):
                    reason = "deadline"
                if reason is not None:
                    return self._close(rnd, reason)
                if self._waits_for_a_fresh_read(rnd):
                    next_read = min(next_read, max(now, rnd.started + self.settle_time()))
            if now >= rnd.request.give_up_by or self._only_other_schemas(rnd, now):
                raise self._no_group_error(rnd)
            if redirect is None and rnd.callers:
                redirect = self._answer_caller(rnd, banned)
            if redirect is None and now >= next_read:
                await self._read_unless_called(rnd)
                next_read = time.monotonic() + self._read_interval(rnd)
                continue  # decide again on what we just read
            late = self._round_is_gone(rnd)
            if late is not None:
                raise late
            target: Redirect | None = redirect
            redirect = None
            if target is None:
                target = self._pick_leader(rnd, banned)
                redirects = 0
            if target is None:
                self._call_earlier(rnd)
                await self._wait_as_leader(rnd, next_read)
                continue
            outcome = await self._race_with_result(rnd, self._try_leader(rnd, target, banned))
            if isinstance(outcome, GroupInfo):
                return outcome
            if isinstance(outcome, Redirect):
                redirects += 1
                if (
                    redirects <= self.config.max_redirects
                    and outcome.peer_id != self.peer_id
                    and outcome.peer_id not in rnd.shunned
                ):
                    redirect = outcome

    def _only_other_schemas(self, rnd: Round, now: float) -> bool:
        """Past the round's close deadline, the only peers seen under our key average
        another tensor layout and nobody else is expected: a configuration error, said
        now (SchemaMismatchError) rather than at the give-up time."""
        if not rnd.mismatched or now < rnd.request.close_by or rnd.leader is not None:
            return False
        if rnd.num_members > 1 or any(d.peer_id != rnd.me.peer_id for d in rnd.declarations):
            return False
        expected = expected_members(self._leader_view(rnd), now, self._patience())
        return expected <= {rnd.me.peer_id}

    def _no_group_error(self, rnd: Round) -> Exception:
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
            f"{give_up_seconds(rnd.me):.1f}s; min_group_size is {req.min_group_size} "
            f"(expected: {short_ids(expected)}; came: {short_ids(came)}; declared: "
            f"{short_ids({d.peer_id for d in rnd.declarations})}){refused}"
        )

    async def shutdown(self) -> None:
        """Disband every pending group here (followers are told at once); stop announcing."""
        for rnd in list(self._rounds.values()):
            rnd.disband("the leader is shutting down")
        if self.presence is not None:
            await self.presence.stop()
