"""A training run's progress records as the DHT holds them: their format, validation and
the swarm's progress computed from them (pure; no network, no torch).

Every training process reports how many samples it has accumulated towards the run's
current global step ("epoch") under one DHT key, with its own subkey, so the records of
all peers live side by side (dictionary values, docs/dht.md). Reading that key back gives
the swarm's global progress: the swarm's epoch, how many samples the swarm has gathered
towards it, how fast, and when it will reach ``target_batch_size``. The swarm's epoch is
the one most daemons are at (:func:`swarm_epoch`), not the newest one: a trainer that ran
ahead alone is the one that moves back, not the swarm that follows it.

Records come from other peers, so :meth:`PeerProgress.from_record` validates them and
drops what is malformed instead of trusting it, and :func:`aggregate` ignores what is
implausible (:func:`plausible`: a clock far ahead of the reader's, an absurd rate; and
:func:`within_epoch_lead`: an epoch far ahead of the swarm's majority) and bounds what one
daemon counts for (:func:`credit`). Records are signed by their daemon (the subkey names
it; averaging/protocol_keys.py), and a record that names another daemon inside is ignored.

Both sides read them: the wrappers' tracker (averaging/training/progress.py) and the
daemon's run view (``swarmavg peers``, the monitor), which therefore never loads the
training package.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from swarmavg.averaging.run_records.metrics import Metrics, parse_metrics

log = logging.getLogger(__name__)

MAX_EPOCH = 2**53
"""Larger epochs in a record are treated as malformed (they would not survive msgpack floats)."""
MAX_CLOCK_SKEW = 600.0
"""Seconds a record's ``time`` may be ahead of the reader's clock; a record further in the
future is implausible (volunteers' clocks differ, but not by this much)."""
MAX_SAMPLES_PER_SECOND = 1e12
"""A process reporting a higher rate is implausible (it would make every other process
stop waiting for the epoch's last batches, ``CollaborativeOptimizer.max_wait``)."""
STATE_ID_BYTES = 16
"""Bytes of a record's ``state`` id (:attr:`PeerProgress.state`)."""
AHEAD_TOLERANCE = 2
"""Epochs a process may be ahead of the swarm's epoch (:func:`swarm_epoch`) and still be
in step with it: the majority's records lag one step behind its own report, and with
``delay_updates`` its round of the previous epoch may still be in flight (its record says
``inflight``), which adds one. Further ahead, it took global steps alone and moves back
(:meth:`ProgressTracker.refresh`)."""
MAX_EPOCH_LEAD = 8
"""Epochs a record may be ahead of the swarm's majority (:func:`within_epoch_lead`)."""
MAX_SHARE_RATIO = 4.0
"""How many times the median daemon's samples (and samples per second) one daemon's
records may count for at an epoch (:func:`credit`). Samples are self-reported: without a
bound, one record claiming ``2**53`` samples ends every epoch at once. A daemon faster than
this many medians (a GPU among CPUs) counts as this many medians, or as its fair share of
the target, whichever is more: its epoch then ends a little later than it could."""


@dataclass(frozen=True)
class PeerProgress:
    """One training process's progress towards the next global step.

    Attributes:
        peer_id: the daemon's peer id (hex). Processes that share a daemon share it and
            average as one group member.
        epoch: the global step this process is accumulating towards.
        samples: samples accumulated in ``epoch`` so far.
        samples_per_second: this process's recent throughput.
        time: the reporter's wall clock (``time.time()``) when it reported.
        left: the process has stopped training (its last record; it no longer counts).
        target: the ``target_batch_size`` the process steps at (0: not said; records of
            older versions), so that a reader without an optimizer (``swarmavg peers``)
            can tell how far the swarm is from its next step.
        metrics: the user's metrics (loss, ...) as name-sorted pairs
            (:mod:`swarmavg.averaging.run_records.metrics`).
        rejoins: how often the process adopted the swarm's epoch after it had lost it
            (it was behind, or ahead alone; docs/training.md, "Staying in one swarm").
            Optional (0: none, or an older writer); ``swarmavg peers`` shows it.
        state: a short id of the process's shared state (:data:`STATE_ID_BYTES` bytes):
            two processes that report the same non-empty id hold bit-identical
            parameters (empty: not known, e.g. after a local step). Lets a closing
            trainer skip the final agreement round when it has nothing to change.
        inflight: the epoch of a round this process still runs in the background
            (``delay_updates``; None: none). A process one epoch behind joins that round
            late; when no process runs one, the round of its epoch is over and it loads
            the swarm's state at once instead of waiting for a round nobody will join.
        final: the process is in ``close()``: ``state`` is the one it stops with (its
            final agreement waits for the records of the others that stop with it).
    """

    peer_id: str
    epoch: int
    samples: int
    samples_per_second: float
    time: float
    left: bool = False
    target: int = 0
    metrics: Metrics = ()
    rejoins: int = 0
    state: bytes = b""
    inflight: int | None = None
    final: bool = False

    def to_record(self) -> dict[str, Any]:
        """The msgpack-able DHT value."""
        record: dict[str, Any] = {
            "peer": self.peer_id,
            "epoch": self.epoch,
            "samples": self.samples,
            "sps": self.samples_per_second,
            "time": self.time,
        }
        if self.left:
            record["left"] = True
        if self.target:
            record["target"] = self.target
        if self.metrics:
            record["metrics"] = dict(self.metrics)
        if self.rejoins:
            record["rejoins"] = self.rejoins
        if self.state:
            record["state"] = self.state
        if self.inflight is not None:
            record["inflight"] = self.inflight
        if self.final:
            record["final"] = True
        return record

    @classmethod
    def from_record(cls, record: object) -> PeerProgress | None:
        """Parse a DHT value written by another peer; None when it is malformed."""
        if not isinstance(record, Mapping):
            return None
        peer, epoch, samples = record.get("peer"), record.get("epoch"), record.get("samples")
        sps, when = record.get("sps"), record.get("time")
        if not isinstance(peer, str) or not 0 < len(peer) <= 128:
            return None
        if not (_is_int(epoch) and _is_int(samples) and _is_finite(sps) and _is_finite(when)):
            return None
        if not (0 <= epoch <= MAX_EPOCH and 0 <= samples <= MAX_EPOCH and sps >= 0):
            return None
        left = record.get("left", False)
        if not isinstance(left, bool):
            return None
        # Both optional (older writers send neither); when present they must be valid, or
        # the record is malformed as a whole (the DHT then refuses to store it).
        target = record.get("target", 0)
        if not (_is_int(target) and 0 <= target <= MAX_EPOCH):
            return None
        metrics = parse_metrics(record.get("metrics", {}))
        if metrics is None:
            return None
        # Optional too (older writers send none of them), valid when present.
        rejoins, state = record.get("rejoins", 0), record.get("state", b"")
        inflight, final = record.get("inflight"), record.get("final", False)
        if not isinstance(final, bool):
            return None
        if not (_is_int(rejoins) and 0 <= rejoins <= MAX_EPOCH):
            return None
        if not (isinstance(state, bytes) and len(state) <= STATE_ID_BYTES):
            return None
        if inflight is not None and not (_is_int(inflight) and 0 <= inflight <= MAX_EPOCH):
            return None
        return cls(
            peer,
            int(epoch),
            int(samples),
            float(sps),
            float(when),
            left,
            int(target),
            metrics,
            int(rejoins),
            state,
            None if inflight is None else int(inflight),
            final,
        )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class GlobalProgress:
    """The swarm's progress towards its next global step, as seen by one reader.

    Attributes:
        epoch: the swarm's global epoch (:func:`swarm_epoch`): the one most daemons are
            at, the newest on a tie; with no other live daemon, the newest any record
            reports, left ones included (a newcomer then loads the run's state).
        samples: samples accumulated towards ``epoch`` by every process at that epoch.
        target: ``target_batch_size``; the swarm steps once ``samples >= target``.
        num_peers: distinct daemons (group members) at ``epoch`` or one epoch behind it.
            Right after a global step some processes have not reported their new epoch
            yet; they will join the next round, so they count as members of it.
        num_processes: training processes at ``epoch`` or one behind it.
        samples_per_second: the swarm's total throughput (processes at ``epoch``).
        eta: seconds until ``samples`` reaches ``target`` at that throughput (0 when
            reached, ``inf`` when nobody is making progress).
        peers: every valid record read of a process still training, at any epoch.
        capped: the daemons at ``epoch`` whose claimed samples or rate counted for less
            than they said (:func:`credit`).
        trusted: the reader's own daemon, whose records are never capped (None: none).
    """

    epoch: int
    samples: int
    target: int
    num_peers: int
    num_processes: int
    samples_per_second: float
    eta: float
    peers: tuple[PeerProgress, ...]
    capped: frozenset[str] = frozenset()
    trusted: str | None = None

    @property
    def ready(self) -> bool:
        """True when the swarm has gathered ``target`` samples for ``epoch``."""
        return self.samples >= self.target

    def members(self) -> dict[str, float]:
        """The daemons counted in ``num_peers``, each with the time of its newest record:
        who a round at this progress expects (see ``no_shows``)."""
        newest: dict[str, float] = {}
        for p in self.peers:
            if self.epoch - 1 <= p.epoch <= self.epoch:
                newest[p.peer_id] = max(newest.get(p.peer_id, 0.0), p.time)
        return newest

    def round_members(self, own_peer: str) -> dict[str, float]:
        """Who a round of daemon ``own_peer`` at this progress waits for.

        The :meth:`members`; but when ``own_peer`` is the only one (it would step alone),
        every other live daemon too, at whatever epoch: they are catching up with it
        (loading its state), and a round that waits for them keeps it from running away
        alone meanwhile, which would leave them chasing an epoch they never reach (issue
        39). A daemon that does not come is a no-show like any other.
        """
        members = self.members()
        if set(members) - {own_peer}:
            return members
        others: dict[str, float] = {}
        for p in self.peers:
            if p.peer_id != own_peer:
                others[p.peer_id] = max(others.get(p.peer_id, 0.0), p.time)
        return {**members, **others} if others else members

    def at_epoch(self, epoch: int) -> GlobalProgress:
        """The same records seen from ``epoch``: its samples, its members (at it or one
        behind), as if it were the swarm's epoch (the view of a process a little ahead of
        the majority's records, or of those left one epoch behind it)."""
        return _progress_at(epoch, self.peers, self.target, self.trusted)

    def daemons_at(self, epoch: int) -> set[str]:
        """The daemons with a live record at exactly ``epoch``."""
        return {p.peer_id for p in self.peers if p.epoch == epoch}

    def round_in_flight(self, epoch: int) -> bool:
        """Whether a process past ``epoch`` says it still runs the round of ``epoch`` in
        the background (``delay_updates``): a process at ``epoch`` can still join it."""
        return any(p.inflight == epoch and p.epoch > epoch for p in self.peers)

    def samples_per_peer(self) -> dict[str, float]:
        """Throughput of each daemon (summed over its processes), at any epoch."""
        rates: dict[str, float] = {}
        for p in self.peers:
            rates[p.peer_id] = rates.get(p.peer_id, 0.0) + p.samples_per_second
        return rates


def within_epoch_lead(
    records: Iterable[PeerProgress], own_epoch: int, max_lead: int = MAX_EPOCH_LEAD
) -> tuple[list[PeerProgress], int]:
    """Drop records whose epoch jumps too far ahead of the swarm's majority.

    The reference is the larger of ``own_epoch`` and the lower median of the other daemons'
    epochs (each daemon counted once, at its newest live record; at its goodbye when every
    record is one, so that a newcomer to a finished run sees where it ended); a record more than
    ``max_lead`` epochs past it is ignored. One identity (or a minority of them) therefore
    cannot drag the swarm to epoch 2**53; an honest swarm spreads over one or two epochs, and a
    newcomer reads the records before reporting its own, so it sees the veterans' epoch as the
    majority's and catches up. What it cannot stop: a majority of the daemons a reader sees
    (a sybil majority, or a lone newcomer next to one liar) defines the epoch (docs/training.md).

    Returns:
        the kept records and how many were dropped.
    """
    records = list(records)
    newest: dict[str, int] = {}
    # The live records decide; only when every process left do the goodbyes say where the
    # run ended (a newcomer to a finished run then loads its state rather than start over).
    live = [p for p in records if not p.left] or records
    for p in live:
        newest[p.peer_id] = max(newest.get(p.peer_id, 0), p.epoch)
    epochs = sorted(newest.values())
    majority = epochs[(len(epochs) - 1) // 2] if epochs else 0
    limit = max(own_epoch, majority) + max_lead
    kept = [p for p in records if p.epoch <= limit]
    return kept, len(records) - len(kept)


def swarm_epoch(records: Iterable[PeerProgress]) -> int:
    """The swarm's epoch: the one most daemons are at.

    Each daemon counts once, at its newest live record. An epoch's support is the number
    of daemons at it or one behind it (right after a step, some members have not reported
    the new epoch yet: they are in the same round); the epoch with the most support is
    the swarm's, the newest of those on a tie, so that a newcomer joins the veterans and
    two daemons that differ follow the one ahead. With at most one live daemon (the
    reader alone), it is the newest epoch of any record, goodbyes included: a newcomer to
    a run whose trainers left loads the run's state instead of starting over.

    Why not the newest epoch: a trainer that took global steps alone (before the others
    came, or cut off from them) would make every other trainer load its state and throw
    away the swarm's own work, and one far enough ahead is not even seen by them
    (:func:`within_epoch_lead`), so it stays alone for good. With the majority's epoch,
    the one ahead is the one that moves back. One record, or a minority of daemons, cannot
    move the swarm's epoch; a majority of the daemons a reader sees defines it.
    """
    records = list(records)
    newest: dict[str, int] = {}
    for p in records:
        if not p.left:
            newest[p.peer_id] = max(newest.get(p.peer_id, 0), p.epoch)
    if len(newest) <= 1:
        return max((p.epoch for p in records), default=0)
    count: dict[int, int] = {}
    for epoch in newest.values():
        count[epoch] = count.get(epoch, 0) + 1
    return max(count, key=lambda e: (count[e] + count.get(e - 1, 0), e))


def ahead_of(record: PeerProgress, swarm: int) -> bool:
    """Whether the process of ``record`` is ahead of the swarm's epoch ``swarm``: it took
    global steps the swarm did not take (alone, before the others came or cut off from
    them), so it must move back to the swarm's epoch. One epoch ahead is the lag of the
    others' reports; one more is allowed while its record says a round of the previous
    epoch is in flight (:data:`AHEAD_TOLERANCE`)."""
    settled = record.epoch - 1 if record.inflight == record.epoch - 1 else record.epoch
    return settled >= swarm + AHEAD_TOLERANCE


def plausible(record: PeerProgress, now: float) -> bool:
    """Whether a well-formed record could come from an honest process (see the limits
    :data:`MAX_CLOCK_SKEW` and :data:`MAX_SAMPLES_PER_SECOND`)."""
    return record.time <= now + MAX_CLOCK_SKEW and (
        record.samples_per_second <= MAX_SAMPLES_PER_SECOND
    )


def aggregate(
    records: Iterable[PeerProgress],
    target: int,
    *,
    now: float | None = None,
    trusted: str | None = None,
) -> GlobalProgress:
    """Combine the processes' records into the swarm's progress.

    Only processes at the swarm's epoch (:func:`swarm_epoch`) count towards it: a process
    at an older epoch is behind and will catch up (load state) rather than contribute, and
    one ahead of it will move back. Processes that left say which epoch the run reached
    when no other process is live (a newcomer then loads the state instead of starting
    over), but count for nothing else. Implausible records (:func:`plausible`, judged at
    ``now``, default the wall clock) count for nothing at all. Each daemon counts for at
    most what :func:`credit` allows, except ``trusted`` (the reader's own daemon).
    """
    if target <= 0:
        raise ValueError(f"target must be positive, got {target}")
    now = time.time() if now is None else now
    records = tuple(p for p in records if plausible(p, now))
    peers = tuple(p for p in records if not p.left)
    return _progress_at(swarm_epoch(records), peers, target, trusted)


@dataclass(frozen=True)
class Credit:
    """What the records of one epoch count for (:func:`credit`).

    Attributes:
        samples: each daemon's samples as counted.
        rates: each daemon's samples per second as counted.
        capped: the daemons that claimed more than they were counted for.
    """

    samples: dict[str, int]
    rates: dict[str, float]
    capped: frozenset[str]


def credit(
    current: Iterable[PeerProgress],
    target: int,
    trusted: str | None = None,
    ratio: float = MAX_SHARE_RATIO,
) -> Credit:
    """Bound what each daemon's records at one epoch count for.

    A daemon's processes are summed first (one daemon is one identity, however many
    subkeys it writes: many records cannot count for many peers). Then each daemon other
    than ``trusted`` counts for at most ``ratio`` times the lower median of the daemons'
    samples, or its fair share ``target / daemons`` if that is more, and its rate for at
    most ``ratio`` times the lower median rate. The lower median is an honest daemon's
    figure as long as fewer than half the daemons lie upwards (with two daemons, the
    reader and one liar, it is the smaller one: the reader's), so one member that lies can
    shorten an epoch by at most its fair share plus ``ratio`` medians, never end it at once.
    The fair-share floor keeps an honest daemon that is ahead right after a global step
    (the others still at 0) from counting for nothing.
    """
    samples: dict[str, int] = {}
    rates: dict[str, float] = {}
    for p in current:
        samples[p.peer_id] = samples.get(p.peer_id, 0) + p.samples
        rates[p.peer_id] = rates.get(p.peer_id, 0.0) + p.samples_per_second
    if not samples:
        return Credit({}, {}, frozenset())
    max_samples = max(ratio * _lower_median(samples.values()), target / len(samples))
    max_rate = ratio * _lower_median(rates.values())
    capped: set[str] = set()
    for peer in samples:
        if peer == trusted:
            continue
        if samples[peer] > max_samples or rates[peer] > max_rate:
            capped.add(peer)
        samples[peer] = min(samples[peer], math.floor(max_samples))
        rates[peer] = min(rates[peer], max_rate)
    return Credit(samples, rates, frozenset(capped))


def _lower_median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def _progress_at(
    epoch: int, peers: tuple[PeerProgress, ...], target: int, trusted: str | None = None
) -> GlobalProgress:
    current = [p for p in peers if p.epoch == epoch]
    active = [p for p in peers if epoch - 1 <= p.epoch <= epoch]
    counted = credit(current, target, trusted)
    samples = sum(counted.samples.values())
    rate = sum(counted.rates.values())
    remaining = max(0, target - samples)
    if remaining == 0:
        eta = 0.0
    elif rate > 0:
        eta = remaining / rate
    else:
        eta = math.inf
    return GlobalProgress(
        epoch=epoch,
        samples=samples,
        target=target,
        num_peers=len({p.peer_id for p in active}),
        num_processes=len(active),
        samples_per_second=rate,
        eta=eta,
        peers=peers,
        capped=counted.capped,
        trusted=trusted,
    )


def parse_records(
    raw: object, now: float, *, skip: str | None = None
) -> tuple[list[PeerProgress], int]:
    """The valid records of a progress key's value (``client.dht.get(key)``), read at ``now``.

    Args:
        raw: the DHT value: a map subkey -> record (anything else holds no record).
        now: the reader's wall clock, for :func:`plausible`.
        skip: a subkey to leave out (the reader's own).

    Returns:
        the records that parse, are plausible and name the daemon their subkey names as its
        owner, and how many others were ignored.
    """
    records: list[PeerProgress] = []
    ignored = 0
    if not isinstance(raw, Mapping):
        return records, ignored
    for subkey, value in raw.items():
        if subkey == skip:
            continue
        parsed = PeerProgress.from_record(value)
        # The DHT checked that the subkey's named owner signed the entry; a record that
        # claims another daemon's id inside it is a forgery.
        if parsed is not None and plausible(parsed, now) and owner_of(subkey) == parsed.peer_id:
            records.append(parsed)
        else:
            ignored += 1
    return records, ignored


def owner_of(subkey: object) -> str | None:
    """The owner (hex) an owned subkey names (``...[owner:<hex>]``), or None."""
    if not isinstance(subkey, str) or not subkey.endswith("]"):
        return None
    _, sep, owner = subkey[:-1].rpartition("[owner:")
    return owner if sep else None


__all__ = [
    "Credit",
    "GlobalProgress",
    "PeerProgress",
    "aggregate",
    "ahead_of",
    "credit",
    "owner_of",
    "parse_records",
    "plausible",
    "swarm_epoch",
    "within_epoch_lead",
]
