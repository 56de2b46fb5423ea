"""A trainer's ties to the rest of its run, over the daemon: its trainer entry, the
warnings when it trains alone, and the start barrier.

:class:`~swarmavg.averaging.training.company.CompanyWatch` decides when to speak (pure);
this module does the DHT reads and writes around it for a wrapper
(:class:`~swarmavg.averaging.training.base.SwarmOptimizer` owns one):

* **the trainer entry** under ``{daemon run}.trainers``
  (:mod:`~swarmavg.averaging.run_records.trainers`), written when the trainer joins and
  every third of the progress ``ttl``, which ``swarmavg peers`` lists and the daemon shows
  in ``swarmavg status``;
* **the warnings**: alone (never met anyone, or the others left), company back, no global
  step for long, each naming what to check;
* **the start barrier** (:meth:`CompanyLink.await_start`): before the first global step
  (``CollaborativeOptimizer``) or the first inner step (``DiLoCo``, ``StreamingDiLoCo``),
  wait for the run's other trainers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping

from swarmavg.averaging.run_records.progress import GlobalProgress
from swarmavg.averaging.run_records.trainers import (
    AVERAGERS_SUFFIX,
    TrainerEntry,
    describe_runs,
    other_daemons,
    runs_by_daemon,
    trainers_key,
    training_runs,
)
from swarmavg.averaging.training.company import CompanyWatch, Event
from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.averaging.training.swarm import SwarmLink, swarm_errors
from swarmavg.averaging.training.verbose import eta_text

log = logging.getLogger("swarmavg.averaging.training.base")
"""The wrappers' logger: a user who follows ``swarmavg.averaging.training.base`` (the
wrappers' own messages) sees these too."""

DEFAULT_START_TIMEOUT = 60.0
"""Seconds a trainer's first global step waits for the other trainers of its run
(:meth:`CompanyLink.await_start`): about the spread of a swarm's start (each trainer
imports torch, loads its data, and its daemon joins), bounded so that a daemon without a
trainer delays a run by this much once."""
START_POLL = 0.2
"""Seconds between two reads of the progress while the first global step waits."""


class CompanyLink:
    """A trainer's entry, warnings and start barrier (see the module docstring).

    Args:
        link: the wrapper's link to the swarm (its run id and client).
        tracker: the wrapper's progress tracker (the others' records, the ``ttl``).
        kind: the wrapper's method as ``swarmavg peers`` names it.
        watch: decides when to speak.
        min_peers: daemons (this one included) whose trainers must report in the run
            before the first global step.
        start_timeout: seconds the first global step waits for them at most (0: no wait).

    Raises:
        ValueError: ``min_peers`` below 1 or a negative ``start_timeout``.
    """

    def __init__(
        self,
        link: SwarmLink,
        tracker: ProgressTracker,
        kind: str,
        watch: CompanyWatch,
        *,
        min_peers: int = 1,
        start_timeout: float = DEFAULT_START_TIMEOUT,
    ) -> None:
        if min_peers < 1:
            raise ValueError(f"min_peers must be at least 1, got {min_peers}")
        if start_timeout < 0:
            raise ValueError(f"start_timeout must not be negative, got {start_timeout}")
        self.link = link
        self.tracker = tracker
        self.kind = kind
        self.watch = watch
        self.min_peers = min_peers
        self.start_timeout = start_timeout
        self._start_waited = False
        self._next_entry = -math.inf  # monotonic time the trainer entry is due again
        self._daemon_run: str | None = None  # the daemon's run id, read on first use

    def joined(self) -> None:
        """Write the trainer entry now (at join, not after the first step: a trainer of
        another run on a daemon that is up must not hold the others' start barrier)."""
        self._next_entry = time.monotonic() + self.tracker.ttl / 3
        try:
            self._write_entry(time.monotonic())
        except swarm_errors() as exc:
            log.debug("could not write the trainer entry: %s", exc)

    def after_step(self, epoch: int) -> None:
        """Refresh this trainer's entry under the daemons' run and warn when it has had no
        company for a while (:mod:`~swarmavg.averaging.training.company`)."""
        now = time.monotonic()
        progress = self.tracker.last
        company = any(p.peer_id != self.tracker.peer_id for p in progress.peers)
        event = self.watch.update(company, epoch, now)
        try:
            if now >= self._next_entry or event not in (None, Event.STALLED):
                self._next_entry = now + self.tracker.ttl / 3
                self._write_entry(now)
            if event is not None:
                self._say(event, progress, now)
        except swarm_errors() as exc:
            log.debug("could not write or read the trainer entries: %s", exc)

    @property
    def start_pending(self) -> bool:
        """Whether :meth:`await_start` would still wait (it has not run, and this trainer
        has not met another one): lets a wrapper skip the progress read it needs."""
        return not self._start_waited and not self.watch.met and self.start_timeout > 0

    def await_start(self, progress: GlobalProgress, before: str = "global step") -> GlobalProgress:
        """The start barrier: before this trainer's first global step, wait for the other
        trainers of its run, so that it does not take the run's first steps alone
        (``before`` names that step in the log lines: DiLoCo waits before its first inner
        step).

        It waits (at most ``start_timeout`` seconds, once per wrapper) while fewer than
        ``min_peers`` daemons report progress in the run, and, whatever ``min_peers``
        says, while the run's other averaging daemons (their presence entries under
        ``{daemon run}.averagers``) exist but none of their trainers reports yet. A trainer
        that has met another trainer, or a daemon that is the only one, does not wait.
        The batches it has accumulated wait with it (nothing is lost); it steps alone
        after the timeout, and says so.
        """
        if self._start_waited or self.watch.met:
            return progress
        self._start_waited = True
        if self.start_timeout == 0:
            return progress
        own = self.tracker.peer_id
        presence_at = -math.inf
        present: set[str] = set()
        deadline = time.monotonic() + self.start_timeout
        waited = False
        while True:
            now = time.monotonic()
            reporting = {p.peer_id for p in progress.peers} - {own}
            if now - presence_at >= 10 * START_POLL:
                present, presence_at = self._present_daemons(own), now
            needed = max(self.min_peers - 1, 1 if present else 0)
            if len(reporting) >= needed:
                if waited:
                    log.info(
                        "run %r: %d other trainer(s) in; first %s",
                        self.link.run_id,
                        len(reporting),
                        before,
                    )
                return progress
            if now >= deadline:
                log.warning(
                    "run %r: %d of %d other trainer(s) reported within start_timeout=%.0f s; "
                    "taking the first %s without the rest",
                    self.link.run_id,
                    len(reporting),
                    needed,
                    self.start_timeout,
                    before,
                )
                return progress
            if not waited:
                waited = True
                log.info(
                    "run %r: waiting up to %.0f s for %d other trainer(s) before the first "
                    "%s (min_peers=%d, %d other daemon(s) of the run present)",
                    self.link.run_id,
                    self.start_timeout,
                    needed,
                    before,
                    self.min_peers,
                    len(present),
                )
            time.sleep(START_POLL)
            self.tracker.report()  # keep this trainer's record alive for the others
            progress = self.tracker.refresh()

    def _present_daemons(self, own: str) -> set[str]:
        """The run's other averaging daemons that may bring a trainer of this run: those
        whose trainers all train another run are left out (empty when the DHT cannot
        say)."""
        daemon_run = self._daemon_run_id()
        if daemon_run is None:
            return set()
        try:
            present = other_daemons(
                self.link.client.dht.get(f"{daemon_run}{AVERAGERS_SUFFIX}"), own
            )
            runs = runs_by_daemon(self.link.client.dht.get(trainers_key(daemon_run)))
        except swarm_errors() as exc:
            log.debug("could not read the run's averaging daemons: %s", exc)
            return set()
        return {d for d in present if self.link.run_id in runs.get(d, {self.link.run_id})}

    def _daemon_run_id(self) -> str | None:
        if self._daemon_run is None:
            status = self.link.client.status()
            run = status.get("run_id") if isinstance(status, Mapping) else None
            self._daemon_run = run if isinstance(run, str) and run else ""
        return self._daemon_run or None

    def _write_entry(self, now: float) -> None:
        daemon_run = self._daemon_run_id()
        if daemon_run is None:
            return
        # "alone" once this process has said so in its log: the status and ``swarmavg
        # peers`` then tell the same story, not every start's first seconds
        alone = self.watch.alone_for(now) if self.watch.warned else 0.0
        entry = TrainerEntry(self.link.run_id, self.kind, alone, time.time())
        self.link.client.dht.store(
            trainers_key(daemon_run),
            entry.to_record(),
            ttl=self.tracker.ttl,
            subkey=self.tracker.subkey,
        )

    def _say(self, event: Event, progress: GlobalProgress, now: float) -> None:
        run = self.link.run_id
        if event is Event.COMPANY:
            log.info("run %r: another trainer is here again; training together", run)
            return
        if event is Event.STALLED:
            log.warning(
                "run %r: no global step for %.0f s: the swarm has %d/%d samples towards "
                "epoch %d at %.1f samples/s (next step in %s); lower target_batch_size or "
                "add trainers for more frequent steps",
                run,
                self.watch.stalled_after,
                progress.samples,
                progress.target,
                progress.epoch,
                progress.samples_per_second,
                eta_text(progress.eta),
            )
            return
        daemon_run = self._daemon_run_id()
        raw = self.link.client.dht.get(trainers_key(daemon_run)) if daemon_run else None
        others = [r for r in training_runs(raw) if r.run != run or r.trainers > 1]
        seen = describe_runs(others)
        if event is Event.LEFT_ALONE:
            log.warning(
                "run %r: the other trainers left %.0f s ago; this process now trains alone "
                "and its global steps are its own (training runs seen under the daemons' "
                "run %r: %s)",
                run,
                self.watch.alone_for(now),
                daemon_run,
                seen,
            )
            return
        log.warning(
            "run %r: no other trainer of this run seen for %.0f s; this process trains "
            "alone. Check that every trainer uses the same run id (training runs seen under "
            "the daemons' run %r: %s; run_id=None takes the daemon's) and that the daemons "
            "joined one another (swarmavg peers)",
            run,
            self.watch.alone_for(now),
            daemon_run,
            seen,
        )
