"""Following: asking the leader the declarations name to take us, and checking the group
it forms before taking part.

A follower asks the leader the balanced split gives it (else the best other candidate),
follows redirects, keeps the stream open once accepted, and takes the formed group only
when it matches its own request and what every member signed. A leader that fails or
refuses is skipped for a while (growing pauses) or for the round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from typing import Any

import grpc

from swarmavg.averaging.errors import NoGroupError, RoundClosedError
from swarmavg.averaging.group import MAX_GROUP_SIZE, GroupInfo
from swarmavg.averaging.matchmaking.answers import FINAL, FIRST, forwarded_sender
from swarmavg.averaging.matchmaking.calling import Calling
from swarmavg.averaging.matchmaking.closing import assign_leaders, short_ids
from swarmavg.averaging.matchmaking.config import MatchmakingEvent
from swarmavg.averaging.matchmaking.declarations import (
    MAX_ADDRESS_CHARS,
    Declaration,
    FollowerAsk,
    check_formed_group,
    declaration_from_join_request,
    group_from_proto,
    leader_candidates,
    leader_entry_declaration,
    leader_order,
    member_from_join_request,
)
from swarmavg.averaging.matchmaking.round import (
    FINAL_CODES_TEXT,
    MEMBER_READS,
    Redirect,
    Round,
    has_group_bits,
    peer_ids,
)
from swarmavg.averaging.stubs import join_group_method
from swarmavg.averaging.tasks import cancel_and_wait
from swarmavg.dht.identity import HeaderError
from swarmavg.proto import averaging_pb2

log = logging.getLogger(__name__)

MAX_BACKOFF = 2.0
"""Longest pause before asking again a leader whose call failed (seconds)."""
DEAD_AFTER = 2
"""Refused connections in a row after which a leader is out of this round's split."""


class Following(Calling):
    """The follower side of a matchmaker."""

    def _roster_leader(self, rnd: Round) -> Redirect | None:
        """The leader a steady-state round will have, asked before any read of the
        declarations: the first in leader order among this peer and the family's roster
        (the peers of its last round there), when they fit one group. Leader order is a
        hash of the key and the id, so every member computes the same one without the
        DHT; the read runs meanwhile, and the group is checked against it as always.
        ``None`` when we lead, the roster is unproven (presence entries), or a read
        stood already."""
        if not rnd.proven_roster or rnd.last_read > -math.inf or not rnd.previous:
            return None
        if len(rnd.previous | {self.peer_id}) > rnd.request.group_size:
            return None  # a split: which group is ours needs the declarations
        key = rnd.request.key
        candidates = {p: a for p, a in rnd.previous_addresses.items() if a and p not in rnd.shunned}
        best = min(candidates, key=lambda p: leader_order(key, p), default=None)
        if best is None or best == self.peer_id:
            return None
        if rnd.me.can_lead and leader_order(key, self.peer_id) < leader_order(key, best):
            return None
        return Redirect(best, candidates[best])

    def _pick_leader(self, rnd: Round, banned: dict[bytes, float]) -> Redirect | None:
        """The leader to ask next: the one the balanced assignment gives us, else the best
        other candidate; ``None`` when we lead (or nobody can)."""
        me = rnd.me
        now = time.monotonic()
        elsewhere = rnd.elsewhere()
        pool = [d for d in rnd.declarations if d.peer_id not in elsewhere] or [me]
        assignment = assign_leaders(pool, rnd.request.group_size)
        mine = assignment.get(self.peer_id)
        excluded = {p for p, until in banned.items() if until > now} | elsewhere
        if mine == self.peer_id:
            # We lead a group of the split; our followers come to us.
            return self._lonely_probe(rnd, excluded)
        # Declarations carry the declarers' wall-clock times: compared on the wall clock.
        candidates = leader_candidates(rnd.declarations, me, time.time(), excluded)
        candidates.sort(key=lambda d: d.peer_id != mine)  # stable: our assigned leader first
        if not candidates:
            return self._lonely_probe(rnd, excluded)
        return Redirect(candidates[0].peer_id, candidates[0].address)

    def _lonely_probe(self, rnd: Round, excluded: set[bytes]) -> Redirect | None:
        """A declarer to ask although it ranks after us, when we lead alone and it has not
        come within the patience: if its group closed without us, its answer
        (``JOIN_REJECT_FULL`` with itself among the members) tells us at once, where the
        peers before us in the order would have told us as we asked them. An open one
        answers ``JOIN_REJECT_NOT_LEADER`` at once and comes to us as before."""
        if rnd.followers or rnd.leader is not None or not rnd.me.can_lead:
            return None
        now = time.monotonic()
        patience = self._patience()
        for d in sorted(rnd.declarations, key=lambda d: d.order):
            if (
                d.peer_id != self.peer_id
                and d.peer_id not in excluded
                and d.can_lead
                and now - rnd.first_seen.get(d.peer_id, now) > patience
            ):
                return Redirect(d.peer_id, d.address)
        return None

    def _round_is_gone(self, rnd: Round) -> NoGroupError | None:
        """Fail soon when the group we belonged to closed without us and nobody is left
        to average with (a late peer must not sit out its whole timeout alone).

        Left to average with: a declarer that is neither in the closed group nor known to
        have stopped looking, and that was first seen less than the patience ago; and a
        peer of the family's last round (a proven roster) that the roster grace still
        waits for, declared or not. After that a declarer that has not joined us, nor
        taken us, is not coming (the closing rule's own test): most often a peer as late
        as we are that already failed this way, whose declaration lives on until it
        expires.

        Nobody is written off within twice the patience after we learned that our group
        closed: the peers of the split's other group may not have declared yet, and one
        whose reads do not show us yet asks us only once we have not come to it within
        the patience after it first saw us (``_lonely_probe``). Failing at once, a peer
        left out of a split of four into two and two failed 24 ms after it declared, and
        its partner, 115 ms behind it, then found nobody either. Counted from our first
        sighting alone, two peers that both asked the closed leader (on a loaded machine,
        longer than the patience) each wrote the other off. After one patience, a peer
        whose reads had not shown it its partner's declaration failed 0.25 s before that
        partner's probe came (4 fresh daemons, 1 round in 90 under load).
        """
        if not rnd.taken or rnd.followers or rnd.leader is not None:
            return None
        now = time.monotonic()
        patience = self._patience()
        if now - rnd.taken_since <= 2 * patience:
            return None
        elsewhere = rnd.elsewhere()
        others = {
            d.peer_id
            for d in rnd.declarations
            if d.peer_id != self.peer_id
            and d.peer_id not in elsewhere
            and now - rnd.first_seen.get(d.peer_id, now) <= patience
        }
        if rnd.proven_roster:  # peers of the family's last round, not the run's presence
            others |= self._leader_view(rnd).awaited_previous - {self.peer_id}
        if 1 + len(others) >= rnd.request.min_group_size:
            return None
        return RoundClosedError(
            f"the round under {rnd.request.key!r} closed before this peer joined: "
            f"{len(rnd.taken)} peer(s) ({short_ids(rnd.taken)}) averaged without it and no "
            f"other peer is looking; min_group_size is {rnd.request.min_group_size}"
        )

    async def _race_with_result(self, rnd: Round, attempt: Any) -> GroupInfo | Redirect | None:
        """Run one join attempt; stop it when our own group forms meanwhile."""
        task: asyncio.Task[GroupInfo | Redirect | None] = asyncio.ensure_future(attempt)
        waits: set[asyncio.Future[Any]] = {task, rnd.result}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(task)
        if task.done() and not task.cancelled() and task.result() is not None:
            return task.result()
        if rnd.result.done():
            return rnd.result.result()
        return None

    async def _try_leader(
        self, rnd: Round, target: Redirect, banned: dict[bytes, float]
    ) -> GroupInfo | Redirect | None:
        """Ask ``target`` to lead us; follow it when accepted until the group forms.

        Returns the formed group, a redirect, or ``None`` (try someone else); updates
        ``banned`` with the ``time.monotonic()`` instant until which to skip ``target``.
        """
        req = rnd.request
        forever = math.inf
        predicted, rnd.predicted = rnd.predicted == target.peer_id, None
        request = self._join_request(rnd, target.peer_id)
        call = join_group_method(self.channels.channel(target.address, target.peer_id))(
            request, timeout=max(0.1, req.give_up_by - time.monotonic() + 1.0)
        )
        following = False
        try:
            asked = time.monotonic()
            # A roster leader may be gone without a trace (a host that stopped answering):
            # it gets a settle time, not a join timeout, before the read decides.
            answer_in = self.settle_time() if predicted else self.config.join_timeout
            async with asyncio.timeout(answer_in):
                first = await call.read()
            self.rpc_latency.observe(time.monotonic() - asked)
            if first is grpc.aio.EOF or self._forged(request, first, FIRST, target):
                banned[target.peer_id] = time.monotonic() + self.config.retry_after
                return None
            code = first.code
            if code == averaging_pb2.JOIN_REDIRECT:
                banned[target.peer_id] = time.monotonic() + self.config.retry_after
                if (
                    len(first.leader_id) == 20
                    and 0 < len(first.leader_address) <= MAX_ADDRESS_CHARS
                ):
                    return Redirect(bytes(first.leader_id), first.leader_address)
                return None
            if code == averaging_pb2.JOIN_GROUP_FORMED:
                # We hold a seat in the group it closed (we had left its stream): take it.
                return await self._take_formed_group(rnd, first, target, banned)
            if code == averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH:
                rnd.mismatched[target.peer_id] = b""
                banned[target.peer_id] = forever
                return None
            if code == averaging_pb2.JOIN_REJECT_FULL and target.peer_id in peer_ids(first.taken):
                self._note_closed(rnd, first, target.peer_id)
            if code == averaging_pb2.JOIN_REJECT_BAD_REQUEST:
                # Most often: the leader has not read our declaration yet. Ask again soon.
                log.debug("%s refused our request: %s", target.peer_id.hex()[:8], first.detail)
                banned[target.peer_id] = time.monotonic() + self._backoff(rnd, target.peer_id)
                return None
            if code == averaging_pb2.JOIN_REJECT_NOT_LOOKING and predicted:
                # The roster's leader has not called yet: it calls us when it does (we
                # declared first), or our reads find where everyone went. Not "elsewhere".
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
                self._refused_by(rnd, target.peer_id)
                return None
            if rnd.closed or rnd.result.done():
                return None  # our own group formed meanwhile; the cancel below leaves
            following = True
            rnd.leader = (target.peer_id, target.address)
            rnd.release_followers(
                averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_REDIRECT,
                    leader_id=target.peer_id,
                    leader_address=target.address,
                ),
            )
            self._notify(MatchmakingEvent.JOINED_LEADER, req.key, target.peer_id)
            leave_by = min(req.give_up_by, self._leave_by(rnd, target.peer_id))
            try:
                async with asyncio.timeout(max(0.0, leave_by - time.monotonic())):
                    final = await call.read()
            except TimeoutError:
                if leave_by >= req.give_up_by:
                    raise
                self._left_silent_leader(rnd, target.peer_id)
                banned[target.peer_id] = forever
                return None
            if final is grpc.aio.EOF or self._forged(request, final, FINAL, target):
                banned[target.peer_id] = time.monotonic() + self._backoff(rnd, target.peer_id)
                return None
            if final.code == averaging_pb2.JOIN_GROUP_FORMED:
                return await self._take_formed_group(rnd, final, target, banned)
            if final.code == averaging_pb2.JOIN_REDIRECT:
                banned[target.peer_id] = time.monotonic() + self.config.retry_after
                if (
                    len(final.leader_id) == 20
                    and 0 < len(final.leader_address) <= MAX_ADDRESS_CHARS
                ):
                    return Redirect(bytes(final.leader_id), final.leader_address)
                return None
            banned[target.peer_id] = time.monotonic() + self.config.retry_after
            return None
        except (grpc.aio.AioRpcError, TimeoutError) as error:
            if predicted and not following:
                return None  # asked on a guess: no ban; the read decides as for anyone
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
            banned[target.peer_id] = time.monotonic() + self._backoff(rnd, target.peer_id)
            if (
                isinstance(error, grpc.aio.AioRpcError)
                and error.code() == grpc.StatusCode.UNAVAILABLE
                and rnd.failures[target.peer_id] >= DEAD_AFTER
            ):
                # Its port refuses us (a killed daemon whose declaration lives on): out of
                # our split, so that the next leader does not wait for it to lead.
                self._refused_by(rnd, target.peer_id)
            return None
        finally:
            if following and not rnd.closed:
                rnd.leader = None
                self._notify(MatchmakingEvent.LEFT_LEADER, req.key, target.peer_id)
            call.cancel()

    async def _take_formed_group(
        self,
        rnd: Round,
        answer: averaging_pb2.JoinResponse,
        leader: Redirect,
        banned: dict[bytes, float],
    ) -> GroupInfo | None:
        """Join the group a leader formed with us (``answer``, which passed
        :meth:`_forged`), once it passed our checks."""
        group = await self._check_group(rnd, answer, leader.peer_id)
        if group is None or rnd.result.done():
            banned[leader.peer_id] = math.inf
            if group is None:
                self._refused_by(rnd, leader.peer_id)
            return None
        # Followers we took meanwhile (we may have left that leader's stream first) are
        # told at once; those of a normal join were redirected when it accepted us.
        rnd.release_followers(
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

    def _refused_by(self, rnd: Round, peer_id: bytes) -> None:
        """A peer that ranks before us will not lead us this round (it refused us, we
        refused the group it formed, or it is dead): leave it out of the split, so that
        the leader the split gives us instead does not keep waiting for it to lead
        (``closing.close_reason``): a peer that refused a forged group and then led the
        refusers would otherwise hold them until its close deadline."""
        declared = rnd.signed.get(peer_id)
        if declared is not None and declared.order < rnd.me.order:
            rnd.shunned.add(peer_id)

    def _leave_by(self, rnd: Round, leader_id: bytes) -> float:
        """``time.monotonic()`` instant at which we leave ``leader_id`` if it has not closed
        our group.

        An honest leader closes by its own close deadline (``matchmaking_time`` after it
        started, or the longer wait of a family's first round), which is ours when it
        started with us, and later by as much as it started later. Its signed deadline says
        so, but it signs what it likes: it counts only up to where it could lie for an
        honest peer, our own close window after the leader's start or after we first saw
        its declaration, whichever came first. Then the grace (``_leader_grace``).
        """
        limit = rnd.close_by
        declared = rnd.signed.get(leader_id)
        if declared is not None:
            now = time.monotonic()
            # The leader signed wall-clock times: moved onto our monotonic clock here.
            to_mono = now - time.time()
            seen = rnd.first_seen.get(leader_id, now)
            window = rnd.close_by - rnd.started
            signed_close = declared.deadline + to_mono
            limit = max(limit, min(signed_close, min(declared.start + to_mono, seen) + window))
        return max(limit, rnd.regroup_by) + self._leader_grace()

    def _left_silent_leader(self, rnd: Round, leader_id: bytes) -> None:
        """Our leader accepted us and did not close by the deadline plus the grace: leave
        it, stop following it under this family for a while, and regroup with the other
        declarers within this call.

        They followed it too (it ranked first for all) and leave it when their own
        deadlines pass, so we expect each of them again until its deadline plus the grace
        plus the patience (``first_seen`` restarts there), and our own close deadline
        moves past that, within our give-up time: the peers that leave last still find
        the group the first ones form.
        """
        log.warning(
            "leader %s accepted this peer under %s and did not close by its deadline: "
            "leaving it; not following it under this key family for a while",
            leader_id.hex()[:12],
            rnd.request.key,
        )
        family = rnd.request.family or rnd.request.key
        self.shun(family, leader_id)
        rnd.shunned.add(leader_id)
        now = time.monotonic()
        # The declarers signed wall-clock times: moved onto our monotonic clock here.
        to_mono = now - time.time()
        grace = self._leader_grace()
        latest = now
        for d in rnd.declarations:
            if d.peer_id in rnd.shunned or d.peer_id == self.peer_id:
                continue
            leaves = min(d.give_up + to_mono, max(d.deadline + to_mono, now) + grace)
            rnd.first_seen[d.peer_id] = max(rnd.first_seen.get(d.peer_id, now), leaves)
            latest = max(latest, leaves)
        last_close = rnd.request.give_up_by - self.config.join_timeout
        rnd.regroup_by = min(latest + self._patience(), last_close)
        rnd.close_by = max(rnd.close_by, rnd.regroup_by)

    def _backoff(self, rnd: Round, peer_id: bytes) -> float:
        """Seconds to skip a peer after its n-th transport failure: doubling, capped."""
        rnd.failures[peer_id] = failures = rnd.failures.get(peer_id, 0) + 1
        return float(min(self.config.retry_after * 2 ** (failures - 1), MAX_BACKOFF))

    def _carried_declarations(
        self, rnd: Round, answer: averaging_pb2.JoinResponse, leader_id: bytes
    ) -> dict[bytes, Declaration]:
        """What the members signed, as a formed group's answer carries it: each forwarded
        request that verifies as its sender's, under our key and live; and the leader's own
        entry when the leader signed the answer (its word, as its declaration is).

        Only for peers of the family's roster (a proven one): they came through the DHT's
        checks in an earlier round. Anyone else's entry is checked against the DHT as
        before: a declaration stored there counts against its storer's address range
        (``dht/quotas.py``), which bounds the identities a hostile leader can list; signed
        requests cost it nothing but keys."""
        found: dict[bytes, Declaration] = {}
        if self._legacy_join or not rnd.proven_roster or has_group_bits(rnd.request.key):
            return found  # under group bits the roster holds only our companions
        now = time.time()
        auth = self.dht.authenticator
        key = rnd.request.key
        for request in answer.member_requests[:MAX_GROUP_SIZE]:
            sender = forwarded_sender(request, leader_id, auth.run_id, now, auth.window)
            if sender is None or sender not in rnd.previous or request.key != key:
                continue
            try:
                member = member_from_join_request(sender, request)
            except (HeaderError, ValueError):
                continue
            declared = declaration_from_join_request(member, request)
            if (
                declared is not None
                and declared.give_up > now
                and declared.within_window(now, self.config.start_window)
            ):
                found[sender] = declared
        if answer.HasField("header"):  # verified in _forged: the leader signed the group
            try:
                group = group_from_proto(answer.group)
            except ValueError:
                return found
            index = group.index_of(leader_id)
            if index is not None and leader_id in rnd.previous:
                found[leader_id] = leader_entry_declaration(group.members[index], key, now)
        return found

    async def _check_group(
        self, rnd: Round, answer: averaging_pb2.JoinResponse, leader_id: bytes
    ) -> GroupInfo | None:
        """The group a leader formed, if it is what we asked for and what its members
        signed; ``None`` (logged, remembered for the NoGroupError) when we refuse it."""
        message = answer.group
        carried = self._carried_declarations(rnd, answer, leader_id)
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
        # DHT was busy (a swarm that starts a round at once): read again, a few
        # times at most, each under a longer deadline after a miss. Refusing a group only
        # because our view lags costs every member a partial round.
        # Only a read that completed counts: a read that missed its deadline saw nothing,
        # and at 256 peers 3 such reads in a row made a whole group's followers refuse it
        # for its leader's declaration, stored 40 s before (seen in benchmarks/scale.py
        # runs). Failed reads go on, each under a longer deadline, until give-up.
        completed = 0
        while completed < MEMBER_READS:
            known = carried.keys() | rnd.signed.keys() | {self.peer_id}  # ours: our ask
            if all(p in known for p in members) or time.monotonic() >= req.give_up_by:
                break
            last_read = rnd.last_read
            await self._refresh_once(rnd)
            if rnd.last_read != last_read:
                completed += 1
            else:  # failed (a failure can be quick): pause, as a store retry does
                await asyncio.sleep(self.config.retry_after * random.uniform(0.5, 1.5))
        try:
            return check_formed_group(message, ask, leader_id, {**carried, **rnd.signed})
        except ValueError as error:
            reason = f"leader {leader_id.hex()[:12]} formed a group this peer refused: {error}"
            log.warning("%s: %s", req.key, reason)
            rnd.refusals.append(reason)
            return None
