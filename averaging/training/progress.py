"""A training process's side of the swarm's progress: its reports and its reads (usable on
its own).

Each training process reports the samples it has accumulated towards the run's current
global step under the run's progress key, and reads everyone's records back to learn the
swarm's epoch, its samples towards ``target_batch_size`` and when it will be reached. The
records' format and the pure rules over them (:class:`PeerProgress`, :func:`aggregate`,
:func:`swarm_epoch`, what one daemon may count for) live in
:mod:`swarmavg.averaging.run_records.progress`, which the daemon reads too; this module
adds :class:`RateMeter` and :class:`ProgressTracker`, which makes the two DHT calls. No
record can make a wrapper's call invalid: a swarm that reports more peers than a group
holds is clamped where the round is asked for (``SwarmLink.average``).

Example, without any optimizer wrapper::

    tracker = ProgressTracker(client, run_id="my-run", target_batch_size=4096)
    for batch in loader:
        train_step(batch)
        tracker.add_samples(len(batch))
        tracker.report()
        progress = tracker.refresh()
        print(progress.samples, "/", progress.target, "eta", progress.eta, "s")
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future
from dataclasses import replace
from typing import Any, Protocol

from swarmavg.averaging.run_records.metrics import Metrics, check_metrics
from swarmavg.averaging.run_records.progress import (
    MAX_EPOCH_LEAD,
    MAX_SHARE_RATIO,
    STATE_ID_BYTES,
    GlobalProgress,
    PeerProgress,
    aggregate,
    ahead_of,
    parse_records,
    within_epoch_lead,
)
from swarmavg.averaging.training.background import LatestWork
from swarmavg.averaging.training.no_shows import NoShows

log = logging.getLogger(__name__)

SETTLE_TIMEOUT = 30.0
"""Seconds :meth:`ProgressTracker.report` waits for the background stores in flight (each
store also has the client's own call deadline)."""
SOON_INTERVAL = 0.5
"""Least seconds between two of :meth:`ProgressTracker.report_soon`'s skippable reports.

Each store is a call through the daemon, and its client-side work (the record, protobuf,
gRPC) holds the GIL for a millisecond or two on the tracker's thread, which the training
thread then waits for: at every inner step of a 50 ms step that was 2-3 ms, 5% of the step
(``benchmarks/lm_testbed.py``, docs/benchmarks.md "Training"). What reads these reports (a
late joiner's catch-up, the swarm's throughput) does not need them fresher than a second;
the reports a round depends on (``latest=True``) are never skipped."""


class DHTLike(Protocol):
    """The part of the client's ``dht`` attribute (docs/peer.md) the tracker uses."""

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: str | None = None) -> bool: ...

    def get(self, key: str) -> Any: ...


class ClientLike(Protocol):
    """The part of the swarmavg client (docs/peer.md) the tracker uses."""

    @property
    def dht(self) -> DHTLike: ...

    def status(self) -> dict[str, Any]: ...


class RateMeter:
    """Samples per second of one process: an exponential moving average over intervals.

    Time spent outside training (averaging rounds, loading state) is excluded by calling
    :meth:`pause`; the next interval then starts at the next :meth:`update`.
    """

    def __init__(self, smoothing: float = 0.3) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.rate = 0.0
        self._last: float | None = None

    def update(self, samples: int, now: float | None = None) -> float:
        """Record that ``samples`` were processed since the previous update; return the rate."""
        now = time.monotonic() if now is None else now
        if self._last is not None and now > self._last:
            instant = samples / (now - self._last)
            if self.rate == 0.0:
                self.rate = instant
            else:
                self.rate += self.smoothing * (instant - self.rate)
        self._last = now
        return self.rate

    def pause(self) -> None:
        """Forget the start of the current interval (time until the next update is not counted)."""
        self._last = None

    def start(self, now: float | None = None) -> None:
        """Start an interval now (before the first batch of a session or after a pause)."""
        self._last = time.monotonic() if now is None else now


class ProgressTracker:
    """Reports this process's progress to the DHT and reads the swarm's.

    Args:
        client: a connected swarmavg client.
        run_id: the training run; the records live under ``"{run_id}.progress"``.
        target_batch_size: samples per global step.
        ttl: seconds a record stays in the DHT without being refreshed. A process that
            dies is forgotten after this long; keep it above the longest pause between two
            reports (a training step plus an averaging round).
        peer_id: the daemon's peer id; read from ``client.status()`` when None.
        max_epoch_lead: records further ahead of the swarm's majority epoch are ignored
            (:func:`within_epoch_lead`).
        no_shows: daemons that missed a round they were expected at; their records count
            again once they report anew (shared with the rounds' caller; see ``no_shows``).
        soon_interval: least seconds between two skippable :meth:`report_soon` reports.

    Not thread-safe: one tracker per training process, used from one thread (the stores of
    :meth:`report_soon` run on the tracker's own thread, one at a time).
    """

    def __init__(
        self,
        client: ClientLike,
        run_id: str,
        target_batch_size: int,
        *,
        ttl: float = 30.0,
        peer_id: str | None = None,
        max_epoch_lead: int = MAX_EPOCH_LEAD,
        no_shows: NoShows | None = None,
        soon_interval: float = SOON_INTERVAL,
    ) -> None:
        if target_batch_size <= 0:
            raise ValueError(f"target_batch_size must be positive, got {target_batch_size}")
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        if not run_id:
            raise ValueError("run_id must not be empty")
        if not soon_interval >= 0:
            raise ValueError(f"soon_interval must not be negative, got {soon_interval}")
        self.client = client
        self.run_id = run_id
        self.target_batch_size = target_batch_size
        self.ttl = ttl
        self.max_epoch_lead = max_epoch_lead
        self.no_shows = NoShows() if no_shows is None else no_shows
        self.peer_id = peer_id if peer_id is not None else _peer_id_of(client)
        # Several processes may share one daemon: each writes its own subkey, which names
        # the daemon as its owner (``[owner:<hex>]``, dht/records.py): the daemon signs it
        # and the DHT accepts nothing else under a progress key (averaging/protocol_keys.py).
        self.subkey = f"{uuid.uuid4().hex[:12]}[owner:{self.peer_id}]"
        self.key = f"{run_id}.progress"
        self.epoch = 0
        self.samples = 0
        self.meter = RateMeter()
        self.metrics: Metrics = ()
        self.rejoins = 0
        """Sent with every record (:attr:`PeerProgress.rejoins`)."""
        self.state_id: Callable[[], bytes] | None = None
        """Gives the id sent as :attr:`PeerProgress.state` (None: none is sent)."""
        self.inflight: int | None = None
        """Sent as :attr:`PeerProgress.inflight`."""
        self.final = False
        """Sent as :attr:`PeerProgress.final`."""
        self.last: GlobalProgress = aggregate((), target_batch_size)
        self._ignored = 0  # records ignored by the last refresh, to log changes only
        self._capped: frozenset[str] = frozenset()  # likewise, daemons counted for less
        self._reporter = LatestWork("progress report")  # report_soon's thread, made on use
        self.soon_interval = soon_interval
        self._last_soon = -math.inf  # monotonic time of report_soon's last store

    def add_samples(self, n: int) -> None:
        """Count ``n`` samples processed towards the current epoch."""
        if n < 0:
            raise ValueError(f"sample count must not be negative, got {n}")
        self.samples += n
        self.meter.update(n)

    def set_epoch(self, epoch: int, samples: int = 0) -> None:
        """Move to ``epoch`` with ``samples`` already accumulated (after a global step)."""
        if epoch < 0 or samples < 0:
            raise ValueError(f"epoch and samples must not be negative, got {epoch}, {samples}")
        self.epoch = epoch
        self.samples = samples

    def set_metrics(self, metrics: Mapping[str, object]) -> None:
        """Replace the user metrics sent with the next reports (an empty map clears them).

        Raises:
            ValueError: the metrics break the record's rules
                (:func:`~swarmavg.averaging.run_records.metrics.check_metrics`).
        """
        self.metrics = check_metrics(metrics)

    @property
    def local(self) -> PeerProgress:
        """This process's current record."""
        return PeerProgress(
            self.peer_id,
            self.epoch,
            self.samples,
            self.meter.rate,
            time.time(),
            target=self.target_batch_size,
            metrics=self.metrics,
            rejoins=self.rejoins,
            state=self.state_id()[:STATE_ID_BYTES] if self.state_id is not None else b"",
            inflight=self.inflight,
            final=self.final,
        )

    def report(self) -> bool:
        """Store this process's record in the DHT; return the DHT's answer."""
        self._settle()
        return self._store(self.local)

    def report_and_refresh(self) -> GlobalProgress:
        """:meth:`report`, then :meth:`refresh`, in the time of one of them.

        Each is a round trip through the daemon to the DHT's nearest peers, and neither
        needs the other's answer (:meth:`refresh` takes this process's record from
        memory), so a wrapper that reports and reads at every step or sync pays one round
        trip instead of two: on a 100 ms link, 0.1 s less per step. The store runs on the
        reports' thread, after any report still in flight (the DHT never ends on an older
        record), while this thread reads; a failed store raises here, after the read, as
        :meth:`report`'s would (a failed read raises first, the store going on).
        """
        stored = self._reporter.submit(_outcome_of, self._store, self.local)
        progress = self.refresh()
        try:
            _, error = stored.result()  # the store's own call deadline bounds the wait
        except CancelledError:  # replaced by a newer report before it started
            return progress
        if error is not None:
            raise error
        return progress

    def leave(self) -> bool:
        """Tell the swarm this process stopped training (idempotent).

        Without it, its last record would count as a group member until ``ttl`` runs out,
        and the others' rounds would wait for it. The goodbye record replaces the last one
        (it expires later) and is ignored by :func:`aggregate`.
        """
        self._reporter.close(timeout=SETTLE_TIMEOUT)
        self._reporter = LatestWork("progress report")  # its thread is only made on use
        return self._store(PeerProgress(self.peer_id, self.epoch, 0, 0.0, time.time(), left=True))

    def report_soon(self, *, latest: bool = False) -> Future[Any] | None:
        """Store this process's record without waiting for the DHT's answer.

        For the reports between two synchronisations (DiLoCo's inner steps), which only a
        late joiner's catch-up and the swarm's throughput read: a store is a round trip
        through the daemon to the DHT's nearest peers, and waiting for it at every inner
        step would put the network back on the training path that DiLoCo takes it off. The
        record is taken now and stored on the tracker's own thread. A report made while the
        previous one is still in flight, or less than ``soon_interval`` seconds after the
        previous one, is skipped (the next one carries newer figures), and
        :meth:`report` and :meth:`leave` first wait for the one in flight, so the DHT never
        ends on an older record than the last one sent. A failed store is logged, not
        raised: the next report replaces it.

        ``latest=True`` is for a record that must reach the DHT (a new epoch, the samples
        a round is weighed by): it is never skipped; it is stored right after the one in
        flight, and replaces a report still waiting to start.

        Returns:
            the store's future (its result is None when the store failed; cancelled when a
            newer report replaced it), or None when the report was skipped.
        """
        now = time.monotonic()
        if not latest and (now - self._last_soon < self.soon_interval or self._reporter.busy()):
            return None
        self._last_soon = now
        return self._reporter.submit(self._store, self.local)

    def _store(self, record: PeerProgress) -> bool:
        """Store ``record`` under this process's subkey; return the DHT's answer.

        The subkey names the daemon that signs it. A daemon restarted without
        ``--identity`` comes back as another peer and refuses to sign for its old id
        (``ValueError``), so a refused store checks the daemon's id once and, when it
        changed, goes on under the new one (the old id's record expires with its ttl).
        """
        try:
            return self._store_once(record)
        except ValueError:
            if not self._follow_daemon():
                raise
        return self._store_once(replace(record, peer_id=self.peer_id))

    def _store_once(self, record: PeerProgress) -> bool:
        return bool(
            self.client.dht.store(self.key, record.to_record(), ttl=self.ttl, subkey=self.subkey)
        )

    def _follow_daemon(self) -> bool:
        """Take the daemon's current peer id when it is not the one this tracker reports
        under; return whether it changed."""
        try:
            peer_id = _peer_id_of(self.client)
        except (ValueError, ConnectionError, TimeoutError) as error:
            log.debug("could not read the daemon's peer id: %s", error)
            return False
        if peer_id == self.peer_id:
            return False
        log.warning(
            "the daemon now runs as peer %s (was %s): progress is reported under the new id",
            peer_id[:12],
            self.peer_id[:12],
        )
        self.peer_id = peer_id
        self.subkey = f"{self.subkey.split('[', 1)[0]}[owner:{peer_id}]"
        return True

    def _settle(self) -> None:
        """Wait for :meth:`report_soon`'s stores in flight (failures are logged there)."""
        if not self._reporter.settle(SETTLE_TIMEOUT):
            log.warning("a background progress report still runs after %.0fs", SETTLE_TIMEOUT)

    def refresh(self) -> GlobalProgress:
        """Read every live record and return the swarm's progress (this process included).

        This process's own record is taken from memory, not from the DHT, so the answer
        counts everything it has reported and accumulated even when the DHT lags.
        """
        raw = self.client.dht.get(self.key)
        now = time.time()
        others, ignored = parse_records(raw, now, skip=self.subkey)
        others, ahead = within_epoch_lead(others, self.epoch, self.max_epoch_lead)
        ignored += ahead
        others = self.no_shows.admitted(others)
        records = [self.local, *others]
        if ignored != self._ignored:
            log.warning(
                "ignoring %d malformed or implausible progress record(s) under %s",
                ignored,
                self.key,
            )
            self._ignored = ignored
        progress = aggregate(records, self.target_batch_size, now=now, trusted=self.peer_id)
        if progress.capped != self._capped:
            if progress.capped - self._capped:
                log.warning(
                    "counting %d daemon(s) for less progress than they claim under %s "
                    "(more than %.0fx the median daemon's): %s",
                    len(progress.capped),
                    self.key,
                    MAX_SHARE_RATIO,
                    ", ".join(sorted(p[:12] for p in progress.capped)),
                )
            self._capped = progress.capped
        if not ahead_of(records[0], progress.epoch) and progress.epoch < self.epoch:
            # A report's lag (and a round in flight) ahead of the majority's records: in
            # step, so its own epoch is the one to look at.
            progress = progress.at_epoch(self.epoch)
        self.last = progress
        return self.last


def _outcome_of(job: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    """``job(*args)``'s result or its error, for a caller on another thread that raises it
    itself (the reports' thread would log it and go on)."""
    try:
        return job(*args), None
    except Exception as error:
        return None, error


def _peer_id_of(client: ClientLike) -> str:
    status = client.status()
    peer_id = status.get("peer_id") if isinstance(status, Mapping) else None
    if not isinstance(peer_id, str) or not peer_id:
        raise ValueError("client.status() names no peer_id; pass peer_id explicitly")
    return peer_id


__all__ = ["ClientLike", "DHTLike", "ProgressTracker", "RateMeter"]
