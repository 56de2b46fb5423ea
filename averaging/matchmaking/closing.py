"""Which leader each declarer joins, and when a leader closes its group (pure logic).

A leader closes as soon as every peer it has reason to expect is in, instead of waiting
out a fixed window (docs/averaging.md, "When a group closes"). It expects:

- the peers declared under the key that the balanced assignment (:func:`assign_leaders`)
  gives to it, once it has seen their declarations;
- the family's roster (``previous``): every peer seen under the same key family
  (``step-41`` and ``step-42`` are one family) in this peer's last round there, not only
  the members of its last group, so that a round that split is one group again in the
  next round; in the first round of a family, the run's averaging daemons
  (:mod:`~swarmavg.averaging.matchmaking.roster`). A roster peer stays expected until it
  has declared (then the assignment decides) and, once it declared and the assignment
  gives it to this leader, until it joins: a roster peer is known to call, so a slow join
  on a loaded machine is waited for, up to the upper bound;
- whatever the caller expects: a ``group_size`` given with the call is a number of peers
  the caller knows of (the training wrappers count them in the progress records), so
  the leader waits for that many (up to the upper bound) and a full group closes at once,
  or, when more peers are known than one group holds, for its share of the balanced
  split (:func:`wanted_here`); the daemon's default group size is only a cap.

Two guards keep a fast close from splitting a swarm. A leader never closes earlier than
one *settle time* after it started looking, so peers that called at about the same time
have declared; the settle time is derived from the DHT and RPC latencies this peer
measured (:class:`Latency`), not a constant. And a declared peer outside the roster that
does not join within its *patience* (it went to another leader, or died) stops being
expected, so one lost peer cannot hold a group until the upper bound, ``matchmaking_time``.

A roster peer that has not declared is waited for only for the family's *roster grace*
(:func:`roster_grace`), not for the whole upper bound: a trainer whose process stopped (a
laptop's lid closed) leaves its daemon alive, so no probe finds it dead, and every
member of the next round would otherwise stand idle for ``matchmaking_time``. The grace
follows how late the family's members arrived in its recent rounds
(:func:`arrival_lateness`; a high percentile times :data:`GRACE_FACTOR`, plus a floor),
so a member that is always a little late (a slower machine, a loaded one) is still
waited for; a family's first rounds, with nothing observed yet, wait the whole upper
bound. A peer that missed the grace is not counted in ``wanted`` either, and it stays in
the roster: the next round waits its grace for it again, it joins whichever round it
reaches, and how late it asked a closed leader counts toward that leader's grace.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from swarmavg.averaging.matchmaking.declarations import Declaration

MIN_SETTLE = 0.02
"""Seconds: the settle time never goes below this, however fast the DHT answered."""
MAX_SETTLE = 1.0
"""Seconds: nor above this, however slow: a slower swarm relies on the fast quorum."""
GRACE_FACTOR = 2.0
"""The roster grace is this many times how late the last member arrived in the family's
recent rounds (their :data:`LATENESS_PERCENTILE`)."""
MIN_GRACE = 1.0
"""Seconds: the roster grace's floor (with the settle time), for rounds whose members all
arrived at once: a member's declaration still takes a DHT write and a read to be seen, and
a member that restarted (a new client, a checkpoint loaded) comes a little later than its
usual arrival: with a floor of 0.5 s, three trainers on one loaded machine, one restarted
from a checkpoint, missed its first round one time in three."""
LATENESS_KEPT = 16
"""Rounds of a family whose arrivals its roster remembers."""
LATENESS_PERCENTILE = 0.9
"""Which of the remembered rounds' lateness the grace follows (nearest rank: with 16
rounds the second latest, with fewer than 10 the latest)."""
MIN_LATENESS_ROUNDS = 3
"""Rounds of a family observed before its roster grace applies: until then, the full wait."""
_FAMILY_TAIL = re.compile(r"\d+$")


class Latency:
    """A smoothed latency (seconds) measured by this peer: an exponential moving average
    that follows increases at once and decreases slowly, so one fast sample on a loaded
    machine does not make the next settle time too short."""

    def __init__(self, initial: float, smoothing: float = 0.25) -> None:
        if not (initial > 0 and math.isfinite(initial)) or not 0 < smoothing <= 1:
            raise ValueError("need initial > 0 (finite) and 0 < smoothing <= 1")
        self.value = initial
        self._smoothing = smoothing
        self.samples = 0

    def observe(self, seconds: float) -> None:
        """Add one measurement; negative, NaN and infinite ones are ignored."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        self.samples += 1
        if seconds > self.value:
            self.value = seconds
        else:
            self.value += self._smoothing * (seconds - self.value)


def settle_time(dht_latency: float, rpc_latency: float) -> float:
    """How long a new leader waits before its first close.

    A peer that called at the same moment as the leader becomes visible after one DHT
    write, and arrives after one DHT read and one ``JoinGroup`` call; twice the sum
    covers the jitter of a loaded machine.
    """
    return min(MAX_SETTLE, max(MIN_SETTLE, 2.0 * (2.0 * dht_latency + rpc_latency)))


def arrival_lateness(starts: Collection[float], seen_after: Collection[float]) -> float:
    """How late the last member of a formed group arrived, as one member saw it (seconds).

    The larger of two views: the spread of the members' signed declared starts (wall-clock
    times, the same for every member; a member's forged start can only widen it), and how
    long after its own start this member first read each other member's declaration (its
    own clock: it includes the DHT's write and read, and does not depend on the members'
    clocks agreeing). Non-finite values are ignored; never negative.
    """
    spread = 0.0
    finite = [s for s in starts if math.isfinite(s)]
    if finite:
        spread = max(finite) - min(finite)
    seen = max((x for x in seen_after if math.isfinite(x)), default=0.0)
    return max(0.0, spread, seen)


def roster_grace(lateness: Sequence[float], settle: float, upper: float) -> float:
    """Seconds after its start that a leader waits for roster peers that have not declared.

    ``GRACE_FACTOR`` times the :data:`LATENESS_PERCENTILE` of how late the last member
    arrived in the family's last :data:`LATENESS_KEPT` rounds (``lateness``, oldest
    first), plus a floor of ``max(MIN_GRACE, settle)``,
    never more than ``upper`` (the round's ``matchmaking_time``). With fewer than
    :data:`MIN_LATENESS_ROUNDS` rounds observed: ``upper`` (a family's first rounds,
    where trainers still start apart).
    """
    recent = sorted(x for x in lateness[-LATENESS_KEPT:] if x >= 0 and math.isfinite(x))
    if len(recent) < MIN_LATENESS_ROUNDS:
        return upper
    # The nearest-rank LATENESS_PERCENTILE: one outlier among 16 rounds (a member that
    # was itself held up that once) does not make every later round wait the window.
    high = recent[math.ceil(LATENESS_PERCENTILE * len(recent)) - 1]
    return min(upper, GRACE_FACTOR * high + max(MIN_GRACE, settle))


def key_family(key: str) -> str:
    """The key without its trailing number: consecutive rounds of one loop share it."""
    return _FAMILY_TAIL.sub("", key)


def assign_leaders(declarations: Iterable[Declaration], group_size: int) -> dict[bytes, bytes]:
    """Split the declarers into balanced groups; map each peer id to its leader's id.

    Every peer reads the same declarations, so every peer computes the same split. With
    ``n`` declarers there are ``k = ceil(n / group_size)`` groups whose sizes differ by at
    most one (17 with a size of 16: 9 + 8, never 16 + 1). The leaders are the first ``k``
    declarers (in leader order) that can lead; the others are dealt to them in turn, in
    leader order. Each member therefore comes after its leader or cannot lead itself,
    which keeps the join protocol's deadlock freedom (see ``declarations``).

    Args:
        declarations: live declarations of one schema (the caller's own included).
        group_size: the most members per group.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    ordered = sorted({d.peer_id: d for d in declarations}.values(), key=lambda d: d.order)
    leaders = [d.peer_id for d in ordered if d.can_lead]
    if not leaders:
        return {}
    leaders = leaders[: min(len(leaders), math.ceil(len(ordered) / group_size))]
    assignment = {leader: leader for leader in leaders}
    others = [d.peer_id for d in ordered if d.peer_id not in assignment]
    for i, peer_id in enumerate(others):
        assignment[peer_id] = leaders[i % len(leaders)]
    return assignment


@dataclass(frozen=True)
class LeaderView:
    """What a leader knows when it decides whether to close (a snapshot of its round).

    Attributes:
        me: the leader's own declaration.
        members: peer ids in its group so far, itself included.
        declarations: the live same-schema declarations it read last (its own included).
        first_seen: when (``time.monotonic()``) it first saw each declaration.
        previous: the family's roster: peers seen in this peer's previous round under
            the same key family (or, in a family's first round, the run's averaging
            daemons).
        taken: peers out of this leader's split: known to be in a group that already
            closed elsewhere, or leaders it will not follow (``Round.shunned``).
        group_size: the most members it takes.
        min_group_size: the fewest members it may close with.
        wanted: members the caller expects (0: none beyond the declared ones).
        gone: previous members found dead (their address refused a connection): neither
            expected, nor counted in ``wanted``, which the caller most likely counted them
            in (from the records they left behind).
        away: roster peers that will not come to this round although alive: they
            declared under the key with another schema or codec, or answered that they
            no longer look under it.
        proven_roster: ``previous`` comes from a round of the family (its peers averaged
            under it), not from the run's presence entries (peers that may average under
            other keys): only such a roster closes a group at once (``"quorum"``).
        late: roster peers that had not declared when the roster grace ran out
            (:func:`roster_grace`): neither expected nor counted in ``wanted`` while
            they have not declared.
    """

    me: Declaration
    members: frozenset[bytes]
    declarations: tuple[Declaration, ...]
    first_seen: Mapping[bytes, float]
    previous: frozenset[bytes]
    taken: frozenset[bytes]
    group_size: int
    min_group_size: int
    wanted: int = 0
    gone: frozenset[bytes] = frozenset()
    away: frozenset[bytes] = frozenset()
    proven_roster: bool = True
    late: frozenset[bytes] = frozenset()

    @property
    def awaited_previous(self) -> frozenset[bytes]:
        """Roster peers that are neither elsewhere, nor dead, nor away, nor late."""
        return self.previous - self.taken - self.gone - self.away - self.late


def wanted_here(view: LeaderView) -> int:
    """How many of the peers the caller expects this leader's group must hold.

    The caller's ``wanted`` counts the swarm (the training wrappers count its progress
    records), less the previous members found dead or late (past the roster grace). While
    those peers fit in one group, the leader waits for all of them. Once more peers are
    known than one group holds, the balanced split (:func:`assign_leaders`) gives each
    leader only its share, at least the smallest group of the split: waiting for the
    whole count there could never be met (5 peers with a given group size of 4 form
    2 + 3), and every group of the split would wait out ``matchmaking_time``. Which
    peers the leader still waits for is then the expected set's to decide.
    """
    wanted = view.wanted - len((view.gone | view.late) - view.members)
    if wanted <= 0:
        return wanted
    # Peers in groups that closed elsewhere count: they are part of the same split.
    known = len({d.peer_id for d in view.declarations} | view.members)
    swarm = max(wanted, known)
    groups = math.ceil(swarm / view.group_size)
    return min(wanted, swarm // groups)


def expected_members(view: LeaderView, now: float, patience: float) -> frozenset[bytes]:
    """The peers the leader still waits for (members already in included).

    A declarer counts while the assignment gives it to this leader and it was seen less
    than ``patience`` seconds ago (or has joined), or, for a roster peer, as long as the
    assignment gives it to this leader; a roster peer that has not declared counts too.
    """
    # Peers known to be in a closed group are out of the split: they are not coming.
    pool = [d for d in view.declarations if d.peer_id not in view.taken]
    assignment = assign_leaders(pool, view.group_size)
    declared = {d.peer_id for d in view.declarations}
    expected = set(view.members)
    awaited = view.awaited_previous
    for d in pool:
        if assignment.get(d.peer_id) != view.me.peer_id:
            continue
        if d.peer_id in awaited or now - view.first_seen.get(d.peer_id, now) <= patience:
            expected.add(d.peer_id)
    expected |= {p for p in awaited if p not in declared}
    return frozenset(expected)


def leads_in_split(view: LeaderView) -> bool:
    """Whether the split of the live declarers (less those elsewhere) makes this peer a
    leader. When a peer that ranks before it declares later (leadership goes by a hash of
    the key and the id, not by who came first), the split gives this peer and its
    followers to that one: it joins it with them rather than close a group that strands
    the newcomer (its followers are redirected as it joins)."""
    pool = [d for d in view.declarations if d.peer_id not in view.taken]
    mine = assign_leaders(pool, view.group_size).get(view.me.peer_id)
    return mine is None or mine == view.me.peer_id


def close_reason(
    view: LeaderView,
    now: float,
    started: float,
    settle: float,
    patience: float,
    *,
    fresh: bool,
) -> str | None:
    """Why the leader should close now, or ``None``.

    - never, short of full, while the split gives this peer to another leader
      (:func:`leads_in_split`).
    - ``"full"``: ``group_size`` members.
    - ``"quorum"``: every expected peer is in, and the family's roster (from a round of
      the family, not the run's presence entries) is not empty: every roster peer has
      declared (so the split is computed on everyone) and those the split gives to this
      leader are in. The steady state of a training loop closes the moment its last
      member joins. A first round waits for the run's averagers the same way but closes
      as ``"complete"``: one of them may lead a group of the split that will not take
      its share (a hostile or failing leader), and the settle time and a fresh read give
      the refused peers time to come.
    - ``"complete"``: every expected peer is in, the settle time since ``started`` has
      passed, and the last read of the declarations is ``fresh`` (it began after the last
      join and after the settle time), so a peer that declared meanwhile would be seen.

    The upper bound (``matchmaking_time``) is the caller's to enforce.
    """
    size = len(view.members)
    if size >= view.group_size:
        return "full"
    if size < max(view.min_group_size, wanted_here(view)):
        return None
    if not leads_in_split(view):
        return None
    if not expected_members(view, now, patience) <= view.members:
        return None
    if view.proven_roster and view.awaited_previous - {view.me.peer_id}:
        return "quorum"
    if now >= started + settle and fresh:
        return "complete"
    return None


def read_back_suffices(
    seen: Collection[bytes], previous: Collection[bytes], previous_seen: int, group_size: int
) -> bool:
    """Whether the read a peer made with the store of its declaration may stand for the
    round's first read of the declarations (``DHTNode.store_and_get``).

    That read can miss a store made at the same moment elsewhere; taken as the round's
    view on its own, it once split 5 peers of a group size of 4 into 4 + 1 (a peer that saw
    4 counted one group). It stands only when it holds every member of the peer's previous
    round in the family, at least as many declarations as that round saw in the end
    (``previous_seen``), and fewer than the group size, so that one peer it missed cannot
    turn one group into a split: the last declarers of a steady swarm see everyone and
    join a DHT read sooner; anyone else, and every first round, reads as before.

    Args:
        seen: peer ids of the live declarations of the peer's schema and codec in the read,
            its own included.
        previous: the other members of its previous round in the family (empty: none).
        previous_seen: how many such declarations that round saw in the end (0: none).
        group_size: the most members of a group this round.
    """
    if not previous or previous_seen < 1:
        return False
    members = set(seen)
    return set(previous) <= members and previous_seen <= len(members) < group_size


def short_ids(peer_ids: Collection[bytes]) -> str:
    """Peer ids for a log line or an error message: sorted, 12 hex digits each."""
    return ", ".join(sorted(p.hex()[:12] for p in peer_ids)) or "none"
