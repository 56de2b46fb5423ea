"""What every part of a matchmaker shares: its identity, settings, measured latencies,
the rounds in flight and what it keeps of past ones (see ``matchmaker.py``)."""

from __future__ import annotations

import collections
import logging
import time

from swarmavg.averaging.dht_access import DHTAccess
from swarmavg.averaging.matchmaking.closing import Latency, settle_time
from swarmavg.averaging.matchmaking.config import MatchmakerConfig, MatchmakingEvent, Observer
from swarmavg.averaging.matchmaking.roster import FamilyRoster, RunPresence
from swarmavg.averaging.matchmaking.round import ClosedRound, Round, remember
from swarmavg.dht.channels import ChannelPool

log = logging.getLogger(__name__)

SILENT_LEADER_BAN = 600.0
"""Seconds a leader that accepted this peer and then did not close in time is not followed
under the same key family (about a hundred rounds of a training loop; it may still join
groups as a follower). Long enough that a stalling leader costs a family one round in
many, short enough that an honest leader once stuck on a broken link comes back."""
MAX_SHUNNED = 256
"""Leaders remembered as silent per family (each one is an identity that stalled a round)."""


MAX_ANSWER_SIGNERS = 4096
"""Peers remembered as signing their ``JoinGroup`` answers."""


class MatchmakerBase:
    """The state the declaring, following and leading parts of a
    :class:`~swarmavg.averaging.matchmaking.matchmaker.Matchmaker` share."""

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
        self._rounds: dict[str, Round] = {}
        self.dht_latency = Latency(initial=self.config.initial_latency)
        """Seconds one DHT read or write of a declaration takes here (measured)."""
        self.rpc_latency = Latency(initial=self.config.initial_latency)
        """Seconds a leader takes to answer ``JoinGroup`` (measured)."""
        self.closes: collections.Counter[str] = collections.Counter()
        """Groups this peer closed as leader, by reason (full, quorum, complete, deadline)."""
        # key -> our round there that formed a group: answers late joiners.
        self._closed: collections.OrderedDict[str, ClosedRound] = collections.OrderedDict()
        # family -> every peer this peer saw in its last round there (``roster``)
        self._last: collections.OrderedDict[str, FamilyRoster] = collections.OrderedDict()
        # family -> {leader that did not close in time: time.monotonic() until it is shunned}
        self.silent_leaders: collections.OrderedDict[str, dict[bytes, float]] = (
            collections.OrderedDict()
        )
        self.presence: RunPresence | None = None
        """This averager's entry among the run's averagers (see :meth:`announce`)."""
        self.answer_signers: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        """Peers whose latest signed declarations said they sign their ``JoinGroup`` answers
        (the most recent :data:`MAX_ANSWER_SIGNERS`): an unsigned answer from one is
        refused, also in a round that asks it before reading the declarations."""
        self._legacy_join = False
        """Join as a peer from before the signed answers and the one-round-trip join
        (private: tests set it to put such a peer beside new ones, no part of the API).
        Its ``JoinGroup`` requests carry neither ``signed_answers`` nor the repeated
        declaration, its declaration has no ``"sa"`` flag, it stores that declaration
        before its search in every round, it ignores the header and the members'
        requests of an answer, and as a leader it signs no answer, forwards no request
        and checks every follower against the declaration it reads."""

    def settle_time(self) -> float:
        """How long a new leader waits before its first close (from measured latency)."""
        return settle_time(self.dht_latency.value, self.rpc_latency.value)

    def _patience(self) -> float:
        """How long a declared peer stays expected before it joins (see ``closing``)."""
        return 2 * self.config.poll_interval + self.settle_time()

    def _leader_grace(self) -> float:
        """Seconds past the round's close deadline a follower waits for its leader to
        close: the leader's last join answers and its close reach the follower within two
        RPC deadlines on a loaded machine."""
        return 2.0 * self.config.join_timeout + self.settle_time()

    def shunned_in(self, family: str) -> set[bytes]:
        """The leaders this peer does not follow under ``family`` now."""
        now = time.monotonic()
        table = self.silent_leaders.get(family, {})
        for peer_id in [p for p, until in table.items() if until <= now]:
            del table[peer_id]
        return set(table)

    def shun(self, family: str, leader: bytes) -> None:
        """Stop following ``leader`` under ``family`` for :data:`SILENT_LEADER_BAN`."""
        table = self.silent_leaders.get(family, {})
        table.pop(leader, None)
        table[leader] = time.monotonic() + SILENT_LEADER_BAN
        while len(table) > MAX_SHUNNED:  # the oldest go first: insertion order
            del table[next(iter(table))]
        remember(self.silent_leaders, family, table)

    def note_answer_signer(self, peer_id: bytes, signs: bool) -> None:
        """Remember whether ``peer_id`` signs its answers, as its latest signed
        declaration says.

        A declaration without the flag takes the peer off the list: it went back to a
        version that signs nothing (an operator's rollback, same identity). Kept on the
        list, it was refused by every peer that had seen it sign, as long as they
        remembered it: its groups split off and their rounds went partial. Only its owner
        can write that declaration, so no one on the path can turn the check off."""
        self.answer_signers.pop(peer_id, None)
        if not signs:
            return
        self.answer_signers[peer_id] = None
        while len(self.answer_signers) > MAX_ANSWER_SIGNERS:  # the oldest go first
            self.answer_signers.popitem(last=False)

    def _dht_budget(self, failures: int, give_up_by: float) -> float:
        """Deadline of one DHT store or read after ``failures`` that missed theirs in a row.

        It doubles with each miss (up to 8x ``dht_timeout``), within the give-up time: when
        a whole swarm starts a round at once, the burst of stores and reads can keep the
        DHT nodes busy for longer than ``dht_timeout``; a fixed deadline then cancels every
        operation before it completes, each retry adds to the same burst, and no peer ever
        sees another (256 peers). A growing one lets the burst drain. ``give_up_by`` is a
        ``time.monotonic()`` instant.
        """
        budget = self.config.dht_timeout * 2.0 ** min(failures, 3)
        return min(budget, max(0.05, give_up_by - time.monotonic()))

    def _notify(self, event: MatchmakingEvent, key: str, peer_id: bytes) -> None:
        log.debug("%s %s %s", key, event.value, peer_id.hex()[:8])
        if self.observer is not None:
            self.observer(event, key, peer_id)
