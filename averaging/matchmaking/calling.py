"""Calling: a leader that declared after some of its followers tells them it is there.

A peer that declares before its leader (leadership goes by a hash rank, not by arrival)
reads the declarations, finds only itself and the others that came before, and leads
alone until its next read shows the leader: a poll, whose interval grows while the
peer is alone. In the steady state of a training loop that wait is the whole
matchmaking of the peers that finish the previous round first. So a leader calls,
once a round, every declarer the split gives it that declared before it: a signed
``JoinGroup`` to that declarer, which answers ``JOIN_REJECT_NOT_LEADER`` at once (the
caller ranks before it) and, as an event rather than at its next read, joins the
caller. The call carries nothing new on the wire: the declarer trusts nothing of it but
the caller's signed identity and rank; the group it is then given is checked against
the members' signed declarations as every group is (a read starts with the join).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import grpc

from swarmavg.averaging.group import Member, Mode
from swarmavg.averaging.matchmaking.answers import FIRST, answer_fault
from swarmavg.averaging.matchmaking.closing import LeaderView, assign_leaders
from swarmavg.averaging.matchmaking.declarations import (
    MAX_ADDRESS_CHARS,
    Declaration,
    leader_order,
)
from swarmavg.averaging.matchmaking.declaring import Declaring
from swarmavg.averaging.matchmaking.round import Redirect, Round, peer_ids
from swarmavg.averaging.stubs import JOIN_GROUP, join_group_method
from swarmavg.averaging.tasks import cancel_and_wait
from swarmavg.dht.auth import message_digest
from swarmavg.proto import averaging_pb2

log = logging.getLogger(__name__)

MAX_CALLERS = 16
"""Callers a round remembers at once: the best-ranked one is joined, the rest forgotten."""


class Calling(Declaring):
    """Calls from a leader to the declarers that came before it, and their answer."""

    def _join_request(self, rnd: Round, target_id: bytes) -> averaging_pb2.JoinRequest:
        """This round's ``JoinGroup`` request, signed for ``target_id`` alone: nobody
        else can replay it, and nobody can send one in our name. It repeats our whole
        declaration, so that it stands for it where the DHT has not shown it yet."""
        req, me = rnd.request, rnd.me
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
        if not self._legacy_join:
            request.signed_answers = True
            request.deadline = me.deadline
            request.give_up = me.give_up
            request.group_size = me.group_size
            request.codec = me.codec
        request.header.CopyFrom(
            self.dht.signer.sign(target_id, JOIN_GROUP, message_digest(request))
        )
        return request

    def _call_earlier(self, rnd: Round) -> None:
        """As a leader: call each declarer the split gives us that declared before us and
        has not joined (once a round each; the calls run as the round's tasks)."""
        me = rnd.me
        if rnd.leader is not None or rnd.closed or not me.can_lead:
            return
        elsewhere = rnd.elsewhere()
        pool = [d for d in rnd.declarations if d.peer_id not in elsewhere] or [me]
        assignment = assign_leaders(pool, rnd.request.group_size)
        for d in pool:
            if (
                d.peer_id == self.peer_id
                or d.peer_id in rnd.followers
                or d.peer_id in rnd.called
                or not d.can_lead  # a client has no address: it reads, as before
                or d.start >= me.start  # it declared after us: its read finds us
                or assignment.get(d.peer_id) != self.peer_id
            ):
                continue
            self._start_call(rnd, d)

    def _start_call(self, rnd: Round, declared: Declaration) -> None:
        """Call ``declared`` once this round (``_call``), as one of the round's tasks."""
        rnd.called.add(declared.peer_id)
        task = asyncio.ensure_future(self._call(rnd, Redirect(declared.peer_id, declared.address)))
        rnd.calling.add(task)
        task.add_done_callback(rnd.calling.discard)

    def _note_closed(
        self, rnd: Round, answer: averaging_pb2.JoinResponse, target_id: bytes
    ) -> None:
        """``target_id`` answered, in its own checked words, that it is in a group that
        closed under our key: it is out of our split. The members it names are asked at
        once, all together, each of which confirms in its own words (``_call``): only a
        peer's own word counts, as a hostile leader's list of every honest peer used to
        end all their rounds. Asked in turn instead, as the split happened to send us to
        them, two peers left out of a split each led a split that still counted the
        closed group, waited for followers who had averaged already, and both failed
        where they were a group of two."""
        if target_id in rnd.taken:
            return
        rnd.taken.add(target_id)
        rnd.taken_since = min(rnd.taken_since, time.monotonic())
        rnd.changed.set()  # a leader's wait recomputes its split now
        named = peer_ids(answer.taken)
        for d in rnd.declarations:
            if (
                d.peer_id in named
                and d.peer_id != self.peer_id
                and d.peer_id not in rnd.called
                and d.peer_id not in rnd.elsewhere()
                and d.can_lead  # a client has no address to ask
            ):
                self._start_call(rnd, d)

    async def _call(self, rnd: Round, target: Redirect) -> None:
        """Ask ``target`` to take us, read its first answer, and hang up: an open peer
        that ranks after us answers ``JOIN_REJECT_NOT_LEADER`` and comes to us; a peer in
        a group that closed without us says so (``_note_closed``). Any other answer
        changes nothing here (we do not follow a peer we called)."""
        method = join_group_method(self.channels.channel(target.address, target.peer_id))
        request = self._join_request(rnd, target.peer_id)
        call = method(request, timeout=self.config.join_timeout)
        try:
            async with asyncio.timeout(self.config.join_timeout):
                answer = await call.read()
            if answer is not grpc.aio.EOF:
                log.debug(
                    "%s: called %s, answered %d",
                    rnd.request.key,
                    target.peer_id.hex()[:8],
                    answer.code,
                )
                if (
                    answer.code == averaging_pb2.JOIN_REJECT_FULL
                    and target.peer_id in peer_ids(answer.taken)
                    and not self._forged(request, answer, FIRST, target)
                ):
                    self._note_closed(rnd, answer, target.peer_id)
        except (grpc.aio.AioRpcError, TimeoutError) as error:
            log.debug("%s: calling %s failed: %r", rnd.request.key, target.peer_id.hex()[:8], error)
        finally:
            call.cancel()

    def _forged(
        self,
        request: averaging_pb2.JoinRequest,
        answer: averaging_pb2.JoinResponse,
        position: int,
        leader: Redirect,
    ) -> bool:
        """Whether ``answer`` is not the asked peer's own (``answers``): then it is no
        answer, as if the stream had ended; a leader is asked again after a pause. An
        unsigned answer is taken only from a peer not known to sign (an older peer)."""
        if self._legacy_join:
            return False  # an older peer checks no answer
        if not answer.HasField("header") and leader.peer_id not in self.answer_signers:
            return False
        fault = answer_fault(
            self.dht.authenticator, request.header, answer, position, leader.peer_id
        )
        if fault is None:
            return False
        log.warning(
            "an answer from peer %s failed its check (%s): ignored; an attacker on the "
            "path, or a relay, may have altered it",
            leader.peer_id.hex()[:12],
            fault,
        )
        return True

    def _leader_view(self, rnd: Round) -> LeaderView:
        """The round as the closing rules see it (``closing``): a leader's, and a
        follower's when it asks who is still awaited."""
        return LeaderView(
            me=rnd.me,
            members=rnd.member_ids(),
            declarations=rnd.declarations or (rnd.me,),
            first_seen=rnd.first_seen,
            previous=rnd.previous,
            taken=frozenset(rnd.taken | rnd.shunned),
            group_size=rnd.request.group_size,
            min_group_size=rnd.request.min_group_size,
            wanted=rnd.request.wanted,
            gone=frozenset(rnd.gone),
            away=rnd.away(),
            proven_roster=rnd.proven_roster,
            late=rnd.late(time.monotonic()),
        )

    def _note_caller(self, rnd: Round, peer_id: bytes, member: Member) -> None:
        """A peer that ranks before us asked us to take it while we lead alone: remember
        it and wake the search, which joins it (``_answer_caller``)."""
        if (
            rnd.leader is not None
            or rnd.closed
            or member.mode is Mode.CLIENT
            or not member.address
            or len(member.address) > MAX_ADDRESS_CHARS
            or len(rnd.callers) >= MAX_CALLERS
            or leader_order(rnd.request.key, peer_id) >= rnd.me.order
        ):
            return
        rnd.callers.setdefault(peer_id, member.address)
        rnd.caller_came.set()
        rnd.changed.set()

    def _answer_caller(self, rnd: Round, banned: dict[bytes, float]) -> Redirect | None:
        """The best-ranked caller to join now, if any (the others are forgotten); a read
        of the declarations starts with it, so that the group it forms can be checked
        against its members' signed declarations without a read after the close."""
        callers, rnd.callers = rnd.callers, {}
        if rnd.leader is not None or rnd.closed:
            return None
        now = time.monotonic()
        skip = rnd.elsewhere() | {p for p, until in banned.items() if until > now}
        usable = [p for p in callers if p not in skip and banned.get(p, -math.inf) <= now]
        if not usable:
            return None
        best = min(usable, key=lambda p: leader_order(rnd.request.key, p))
        if rnd.reading is None or rnd.reading.done():
            rnd.reading = asyncio.ensure_future(self._refresh_declarations(rnd))
        return Redirect(best, callers[best])

    async def _read_unless_called(self, rnd: Round) -> None:
        """Read the declarations (or wait for the read in flight); a call that comes
        meanwhile ends the wait at once: the read goes on as the round's shared read
        (``rnd.reading``), and the search answers the caller without waiting for the DHT.
        A steady state's leader (``_declares_beside``) stops waiting as well when a
        follower comes or leaves: its close needs the roster, not the read, and the read's
        end wakes it again."""
        if rnd.reading is None or rnd.reading.done():
            rnd.reading = asyncio.ensure_future(self._refresh_declarations(rnd))
        reading = rnd.reading
        rnd.caller_came.clear()
        if rnd.callers:
            return
        waits: set[asyncio.Future[Any]] = {reading}
        called = asyncio.ensure_future(rnd.caller_came.wait())
        waits.add(called)
        if rnd.leader is None and self._declares_beside(rnd):
            rnd.changed.clear()
            waits.add(asyncio.ensure_future(rnd.changed.wait()))
            reading.add_done_callback(lambda _: rnd.changed.set())
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits - {reading}:
                await cancel_and_wait(waiting)
        if reading.done():
            reading.result()  # a failure other than the DHT's own ends the search
