"""The record of one matchmaking round, and what a matchmaker keeps of closed ones.

A :class:`Round` is the state of one peer's search under one key: its declaration, what it
read of the others', its followers while it leads, its leader while it follows. The
matchmaker's parts (declaring, following, leading) read and change it; nothing here does
I/O.

Two clocks, one per quantity: declarations (``Round.me``, ``declarations``, ``signed``) carry
wall-clock times, because other peers read them and compare them with their own clocks;
every local instant (the request's ``close_by`` and ``give_up_by``, and the round's own
fields below) is a ``time.monotonic()`` one. Wall times move onto the monotonic clock only
where a peer's signed time bounds a local wait.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmavg.averaging.dht_access import dictionary_entries
from swarmavg.averaging.group import MAX_GROUP_SIZE, GroupInfo, Member
from swarmavg.averaging.matchmaking.closing import LATENESS_KEPT, arrival_lateness
from swarmavg.averaging.matchmaking.config import MatchRequest
from swarmavg.averaging.matchmaking.declarations import Declaration, decode_declaration
from swarmavg.averaging.matchmaking.roster import FamilyRoster
from swarmavg.proto import averaging_pb2

REMEMBERED_KEYS = 256
"""Closed rounds and family rosters kept per matchmaker (one entry per key or family)."""
MEMBER_READS = 3
"""Reads of the declarations a follower makes at most to see every member of its group."""
FINAL_CODES_TEXT = {
    averaging_pb2.JOIN_REJECT_NOT_LOOKING: "not matchmaking under that key",
    averaging_pb2.JOIN_REJECT_NOT_LEADER: "you lead, not I",
    averaging_pb2.JOIN_REJECT_FULL: "group full or closed",
    averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH: "different tensor schema",
    averaging_pb2.JOIN_REJECT_BAD_REQUEST: "bad request",
    averaging_pb2.JOIN_REJECT_AGGREGATION_MISMATCH: "different aggregation rule",
}


@dataclass
class Follower:
    member: Member
    outcome: asyncio.Future[averaging_pb2.JoinResponse]
    declared_start: float
    """The start it signed, which its request repeated (checked before it was accepted)."""
    ranges: frozenset[str] = frozenset()
    """The public address ranges it counts against (``group_ranges``)."""
    request: averaging_pb2.JoinRequest | None = None
    """Its signed request, when it stands for its declaration: forwarded with the formed
    group, so the members check its entry without reading the DHT."""


@dataclass
class Round:
    request: MatchRequest
    me: Declaration
    result: asyncio.Future[GroupInfo]
    started: float
    """``time.monotonic()`` when this peer started looking."""
    close_by: float
    """``time.monotonic()`` at which, as a leader, it closes a group that is not full
    (the request's ``close_by``, later in a family's first round: ``latest_close_by``)."""
    previous: frozenset[bytes] = frozenset()
    """The family's roster: whom this round expects besides the declarers it reads
    (see ``roster``)."""
    previous_addresses: Mapping[bytes, str] = field(default_factory=dict)
    """Where the roster's peers listen (client-mode ones are absent)."""
    proven_roster: bool = True
    """``previous`` comes from a round of the family, not from presence entries."""
    previous_seen: int = 0
    """Declarations of our schema and codec the previous round saw in the end (0: none)."""
    previous_lateness: tuple[float, ...] = ()
    """The roster's lateness of the family's recent rounds (``FamilyRoster.lateness``)."""
    roster_grace_by: float = math.inf
    """``time.monotonic()`` after which, as a leader, it stops waiting for roster peers
    that have not declared (``closing.roster_grace``; never in a family's first rounds)."""
    gone: set[bytes] = field(default_factory=set)
    """Previous members whose address refused a connection: dead, not merely late."""
    probing: asyncio.Task[None] | None = None
    """The one probe of the previous members that have not declared (see ``_probe``)."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    followers: dict[bytes, Follower] = field(default_factory=dict)
    leader: tuple[bytes, str] | None = None
    closed: bool = False
    mismatched: dict[bytes, bytes] = field(default_factory=dict)
    failures: dict[bytes, int] = field(default_factory=dict)
    declarations: tuple[Declaration, ...] = ()
    """The live declarations of our schema and codec at the last read, our own included."""
    signed: dict[bytes, Declaration] = field(default_factory=dict)
    """Every live declaration read under our key whose start lies in the window, by peer id:
    what members signed, against which a group's entries are checked."""
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
    taken_since: float = math.inf
    """``time.monotonic()`` when a closed leader first told us its group formed without us:
    nobody is written off within twice the patience after it (see
    ``Following._round_is_gone``)."""
    shunned: set[bytes] = field(default_factory=set)
    """Declarers this peer will not follow this round although they rank before it: a
    leader that accepted it and did not close by the round's close deadline plus the
    grace (remembered for the family, see ``MatchmakerBase.silent_leaders``), or one that
    refused it for the round. They are out of the split this peer computes."""
    regroup_by: float = -math.inf
    """``time.monotonic()`` until which, after leaving a silent leader, this peer waits for
    the other declarers to leave it too (see ``Following._regroup``)."""
    not_looking: set[bytes] = field(default_factory=set)
    """Declarers that answered they no longer look under our key (they averaged or gave
    up; their declaration outlives them until it expires)."""
    lonely_reads: int = 0
    """Reads of the declarations in a row while alone (see ``_read_interval``)."""
    declaring: asyncio.Task[None] | None = None
    """Retries of a declaration whose first store did not finish in time (see ``_declare``)."""
    read_failures: int = 0
    reads: int = 0
    predicted: bytes | None = None
    """The roster's leader this peer asked before reading the declarations
    (``Following._roster_leader``), until it answered."""
    callers: dict[bytes, str] = field(default_factory=dict)
    """Open peers that rank before this one and asked it to take them while it led alone
    (a leader calling the declarers that came before it: ``Leading._call_earlier``), by
    peer id, with where they listen: the search joins them at once instead of at its next
    read of the declarations."""
    caller_came: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a caller is added to ``callers``: a read of the declarations in progress
    stops holding up the search (``Calling._read_unless_called``)."""
    called: set[bytes] = field(default_factory=set)
    """Declarers this peer called as their leader (each once a round)."""
    calling: set[asyncio.Task[None]] = field(default_factory=set)
    """Those calls in flight."""
    storing: asyncio.Task[None] | None = None
    """The store of our declaration when it runs beside the search (a steady state:
    ``Declaring._declares_beside``)."""
    """Reads of the declarations this round made (its store's read-back aside)."""
    """Reads of the declarations in a row that missed their deadline (see ``_dht_budget``)."""

    @property
    def num_members(self) -> int:
        return 1 + len(self.followers)

    def member_ids(self) -> frozenset[bytes]:
        return frozenset((self.me.peer_id, *self.followers))

    def elsewhere(self) -> set[bytes]:
        """Declarers that will not join us: in a group that closed, or no longer looking;
        and the leaders we shun, which we will not join."""
        return self.taken | self.not_looking | self.shunned

    def away(self) -> frozenset[bytes]:
        """Peers that will not come although alive: they declared under our key with
        another schema or codec, or answered that they no longer look under it."""
        ours = {d.peer_id for d in self.declarations}
        foreign = {p for p in self.signed if p not in ours}
        return frozenset(foreign | self.not_looking | set(self.mismatched) | set(self.other_codecs))

    def late(self, now: float) -> frozenset[bytes]:
        """Roster peers not waited for any more: the roster grace ran out (at ``now``)
        before they declared or joined."""
        if now < self.roster_grace_by:
            return frozenset()
        declared = {d.peer_id for d in self.declarations}
        return frozenset(self.previous - declared - self.member_ids())

    def lateness(self) -> float | None:
        """How late the last member of the group this round formed arrived, as this peer
        saw it (``closing.arrival_lateness``); None when no group of two or more formed,
        or when the round was a family's first (its roster came from the run's presence
        entries): processes that start seconds apart say nothing of a training loop's
        rounds. Only a leader's own view counts beside the signed starts: it reads a
        follower's declaration as it joins, where a follower reads the others' at its
        polls, seconds late when it was redirected."""
        if not self.proven_roster or not self.previous:
            return None
        if not self.result.done() or self.result.cancelled():
            return None
        others = [m.peer_id for m in self.result.result().members if m.peer_id != self.me.peer_id]
        if not others:
            return None
        starts = [self.me.start, *(self.signed[p].start for p in others if p in self.signed)]
        seen = []
        if self.leader is None:
            seen = [self.first_seen[p] - self.started for p in others if p in self.first_seen]
        return arrival_lateness(starts, seen)

    def roster(self, now: float) -> FamilyRoster:
        """Every peer this round saw under its family (the next round's expectation):
        declarers of our schema and codec, our group, groups that closed elsewhere; and
        the family's lateness, this round's added. Roster peers that were still late at
        ``now`` (the round's end) are left out: a stopped trainer is not waited for again
        round after round, and a late one that asks a member of the closed group is
        noted there again (``Leading._note_late_asker``)."""
        peers: dict[bytes, str | None] = {d.peer_id: d.address or None for d in self.declarations}
        left_out = self.away() | self.gone | self.late(now)
        for peer_id in (*self.followers, *self.taken, *self.previous):
            if peer_id in left_out:
                continue
            declared = self.signed.get(peer_id)
            peers.setdefault(
                peer_id, declared.address if declared else self.previous_addresses.get(peer_id)
            )
        if self.result.done() and not self.result.cancelled():
            for member in self.result.result().members:
                peers.setdefault(member.peer_id, member.address)
        peers.pop(self.me.peer_id, None)
        roster = FamilyRoster(peers, len(self.declarations), lateness=self.previous_lateness)
        lateness = self.lateness()
        if lateness is not None:
            roster.observe_lateness(lateness, LATENESS_KEPT)
        return roster

    def release_followers(self, final: averaging_pb2.JoinResponse) -> None:
        """Answer every follower waiting on this round with ``final``; unless the group
        formed, forget them (their streams end with that answer)."""
        for follower in self.followers.values():
            if not follower.outcome.done():
                follower.outcome.set_result(final)
        if final.code != averaging_pb2.JOIN_GROUP_FORMED:
            self.followers.clear()

    def disband(self, detail: str) -> None:
        """Tell the followers of a group that never closed that it is off; end the round."""
        if not self.closed:
            self.release_followers(
                averaging_pb2.JoinResponse(
                    code=averaging_pb2.JOIN_DISBANDED, leader_id=self.me.peer_id, detail=detail
                )
            )
        if not self.result.done():
            self.result.cancel()


@dataclass(frozen=True)
class LedGroup:
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
class ClosedRound:
    """A round of ours under a key that formed its group: late askers learn of it."""

    expiry: float
    """``time.monotonic()`` after which it is forgotten (its members gave up by then)."""
    members: frozenset[bytes]
    led: LedGroup | None
    """The group, if we led it."""
    family: str
    schema_hash: bytes
    started: float = math.nan
    """``time.monotonic()`` when this peer started the round: a late asker's lateness is
    measured from it."""


@dataclass(frozen=True)
class Redirect:
    peer_id: bytes
    address: str


def decode_declarations(record: Any, key: str) -> list[Declaration]:
    """The well-formed declarations in a DHT read of ``key`` (``None``: none)."""
    found = []
    for subkey, value in dictionary_entries(record).items():
        declaration = decode_declaration(subkey, value, key)
        if declaration is not None:
            found.append(declaration)
    return found


def led_group_of(rnd: Round) -> LedGroup | None:
    """The group ``rnd`` closed with this peer as its leader, if it did."""
    if rnd.leader is not None or not rnd.result.done() or rnd.result.cancelled():
        return None
    starts = {p: f.declared_start for p, f in rnd.followers.items()}
    return LedGroup(rnd.result.result(), starts)


def has_group_bits(family: str) -> bool:
    """Whether a family's key carries Moshpit group bits (``...0b01``, not ``...0b``)."""
    return bool(family.rpartition(".0b")[2])


def give_up_seconds(me: Declaration) -> float:
    return me.give_up - me.start


def peer_ids(raw: Any) -> set[bytes]:
    """Peer ids from a peer's message: 20 bytes each, at most a group's worth."""
    return {bytes(p) for p in list(raw)[:MAX_GROUP_SIZE] if len(p) == 20}


def remember(table: collections.OrderedDict[str, Any], key: str, value: Any) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > REMEMBERED_KEYS:
        table.popitem(last=False)
