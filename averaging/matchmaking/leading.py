"""Leading: taking followers, deciding when the group closes, and telling late askers.

A leader answers every ``JoinGroup`` at once from its local state (accept, redirect to
its own leader, or an explicit reject), takes only followers whose request matches what
they signed, closes by the rule in :mod:`~swarmavg.averaging.matchmaking.closing` and
streams the formed group to every follower. After the group formed it still answers late
askers: a member of the group gets its seat back, anyone else learns the group's members
(and is remembered for the family's next round).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import grpc

from swarmavg.averaging.errors import MatchmakingError
from swarmavg.averaging.group import GroupInfo, Member, Mode
from swarmavg.averaging.matchmaking.answers import (
    FINAL,
    FIRST,
    forwarded_requests,
    sign_answer,
)
from swarmavg.averaging.matchmaking.calling import Calling
from swarmavg.averaging.matchmaking.closing import (
    LATENESS_KEPT,
    close_reason,
    expected_members,
    leads_in_split,
    short_ids,
)
from swarmavg.averaging.matchmaking.config import MatchmakingEvent
from swarmavg.averaging.matchmaking.declarations import (
    JoinState,
    decide_join,
    declaration_from_join_request,
    declaration_mismatch,
    group_to_proto,
    leader_order,
    member_from_join_request,
    requested_aggregation,
)
from swarmavg.averaging.matchmaking.group_ranges import (
    admits,
    public_range_of_address,
    public_range_of_host,
)
from swarmavg.averaging.matchmaking.round import (
    FINAL_CODES_TEXT,
    Follower,
    LedGroup,
    Round,
    has_group_bits,
    led_group_of,
)
from swarmavg.averaging.stubs import JOIN_GROUP
from swarmavg.averaging.tasks import cancel_and_wait
from swarmavg.dht.auth import AuthenticationError, message_digest
from swarmavg.dht.identity import HeaderError
from swarmavg.dht.ranges import grpc_peer_host
from swarmavg.proto import averaging_pb2

log = logging.getLogger(__name__)


class Leading(Calling):
    """The leader side of a matchmaker, and the ``JoinGroup`` RPC it serves."""

    def _close_reason(self, rnd: Round, now: float) -> str | None:
        fresh = rnd.last_read >= max(rnd.last_change, rnd.started + self.settle_time())
        return close_reason(
            self._leader_view(rnd),
            now,
            rnd.started,
            self.settle_time(),
            self._patience(),
            fresh=fresh,
        )

    def _waits_for_a_fresh_read(self, rnd: Round) -> bool:
        """Everyone expected is in, but the last read may have missed a newcomer."""
        if rnd.num_members < rnd.request.min_group_size:
            return False
        view = self._leader_view(rnd)
        if not leads_in_split(view):
            return False  # it joins the leader the split gives it: no close to read for
        return expected_members(view, time.monotonic(), self._patience()) <= view.members

    def _probe_missing_previous(self, rnd: Round, now: float) -> None:
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

    async def _probe(self, rnd: Round, addresses: Mapping[bytes, str]) -> None:
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

    async def _wait_as_leader(self, rnd: Round, next_read: float) -> None:
        """Sleep until a follower arrives or leaves, the group forms, or the next check."""
        now = time.monotonic()
        wake = min(next_read, rnd.request.give_up_by)
        if rnd.close_by > now:
            wake = min(wake, rnd.close_by)
        if rnd.roster_grace_by > now:
            wake = min(wake, rnd.roster_grace_by)  # the late roster peers stop counting
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
            await cancel_and_wait(changed)

    def _close(self, rnd: Round, reason: str = "full") -> GroupInfo:
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
        carried = [f.request for f in rnd.followers.values() if f.request is not None]
        if self._legacy_join:
            carried = []  # an older leader forwards no request
        rnd.release_followers(
            averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_GROUP_FORMED,
                leader_id=self.peer_id,
                group=group_to_proto(group),
                member_requests=forwarded_requests(carried),
            ),
        )
        rnd.result.set_result(group)
        self._notify(MatchmakingEvent.GROUP_FORMED, req.key, self.peer_id)
        return group

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
            # Unsigned: a header that did not verify binds nothing (signed, this answer
            # could be replayed onto the stream of the peer the header names).
            yield averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_REJECT_BAD_REQUEST,
                leader_id=self.peer_id,
                detail=str(error),
            )
            return
        position = FIRST
        async with contextlib.aclosing(self._answer_join(request, peer_id, context)) as answers:
            async for answer in answers:
                if request.signed_answers and not self._legacy_join:
                    # A copy: one final answer object is shared by every follower's stream.
                    copy = averaging_pb2.JoinResponse()
                    copy.CopyFrom(answer)
                    answer = sign_answer(self.dht.signer, request.header, copy, position)
                position = FINAL
                yield answer

    async def _answer_join(
        self,
        request: averaging_pb2.JoinRequest,
        peer_id: bytes,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncGenerator[averaging_pb2.JoinResponse]:
        """The answers to a verified request from ``peer_id``: one final answer, or
        ``JOIN_ACCEPTED`` and then the final one."""
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
                # it, rather than leave its seat empty and every member partial.
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
                shunned=frozenset(rnd.shunned),
            )
            return decide_join(
                state,
                leader_order(request.key, peer_id),
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
            reason = await self._verify_follower(rnd, member, request)
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
        ranges = frozenset(
            r
            for r in (
                public_range_of_address(member.address),
                public_range_of_host(grpc_peer_host(context.peer())),
            )
            if r is not None
        )
        crowded = None
        if code == averaging_pb2.JOIN_ACCEPTED:
            crowded = admits(self._member_ranges(rnd), ranges, rnd.request.group_size)
        if crowded is not None:
            yield averaging_pb2.JoinResponse(
                code=averaging_pb2.JOIN_REJECT_FULL,
                leader_id=self.peer_id,
                detail=f"this group holds its share of members from address range {crowded}",
            )
            return
        if code != averaging_pb2.JOIN_ACCEPTED:
            if code == averaging_pb2.JOIN_REJECT_NOT_LEADER:
                self._note_caller(rnd, peer_id, member)
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
        follower = Follower(
            member,
            asyncio.get_running_loop().create_future(),
            request.declared_start,
            ranges,
            request if declaration_from_join_request(member, request) is not None else None,
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
                left = max(0.0, rnd.request.give_up_by - time.monotonic())
                async with asyncio.timeout(left + 1.0):
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
            # it never blocks the group.
            if not rnd.closed and rnd.followers.get(peer_id) is follower:
                del rnd.followers[peer_id]
                rnd.last_change = time.monotonic()
                rnd.changed.set()
                self._notify(MatchmakingEvent.FOLLOWER_LEFT, request.key, peer_id)

    def _member_ranges(self, rnd: Round) -> list[frozenset[str]]:
        """The public ranges of the group so far, the leader's own address first."""
        mine = public_range_of_address(rnd.me.address)
        return [frozenset({mine} if mine else ()), *(f.ranges for f in rnd.followers.values())]

    async def _verify_follower(
        self, rnd: Round, member: Member, request: averaging_pb2.JoinRequest
    ) -> str | None:
        """Why a would-be follower's request differs from its signed declaration, or
        ``None``: a leader lists only members whose entries their owners signed.

        A request that repeats the declaration stands for it (the follower signed both)
        when its sender is of the family's proven roster (it came through the DHT's checks
        in an earlier round; ``Following._carried_declarations``): no read of the DHT.
        Anyone else's, and an older peer's, is checked against the declaration read; so is
        every request under Moshpit's group bits, whose roster holds only our companions
        (the read is what finds the other groups' members that came to our bits)."""
        declared_start = request.declared_start
        asked = time.monotonic()
        declaration = rnd.signed.get(member.peer_id)
        carried = declaration_from_join_request(member, request)
        now = time.time()
        if (
            carried is not None
            and not self._legacy_join
            and rnd.proven_roster
            and not has_group_bits(rnd.request.key)
            and member.peer_id in rnd.previous
            and carried.key == rnd.request.key
            and carried.give_up > now
            and carried.within_window(now, self.config.start_window)
        ):
            declaration = carried
        if declaration_mismatch(member, declaration) is not None:
            await self._refresh_once(rnd)  # it may have declared after our last read
            declaration = rnd.signed.get(member.peer_id)
        if declaration_mismatch(member, declaration) is not None and rnd.last_read < asked:
            # The read we shared began before the request came, maybe before the
            # follower's store (it stores, then asks): one that began after it cannot
            # miss the declaration. Refused, the follower would wait out a backoff.
            await self._refresh_once(rnd)
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
            # How late it came counts toward the family's grace: next time it is waited for.
            roster.observe_lateness(time.monotonic() - entry.started, LATENESS_KEPT)

    def _led_group(self, key: str, rnd: Round | None) -> LedGroup | None:
        """The group we led and closed under ``key``, while late joiners may ask."""
        if rnd is not None:
            return led_group_of(rnd)
        entry = self._closed.get(key)
        if entry is None or entry.expiry < time.monotonic():
            return None
        return entry.led
