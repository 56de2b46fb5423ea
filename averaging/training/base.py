"""What every training wrapper shares: its link to the swarm, its progress, its lifecycle.

:class:`SwarmOptimizer` is the base of :class:`~swarmavg.averaging.training.collaborative.
CollaborativeOptimizer` and :class:`~swarmavg.averaging.training.diloco.DiLoCo`. It holds
the parts that do not depend on *what* a wrapper averages or *when*:

* the :class:`~swarmavg.averaging.training.swarm.SwarmLink` (rounds, state sharing,
  counters) and the :class:`~swarmavg.averaging.training.progress.ProgressTracker`;
* joining the swarm (a late joiner loads the newest state before its first step);
* the common part of ``step()`` (the closure, the batch size);
* publishing state every ``publish_state_every`` epochs, loading it when behind;
* one shared state (docs/training.md): the digest every round attaches, the verdict on
  the group's digests (:mod:`swarmavg.averaging.training.consensus`), the repair of a
  member that differs and the publication its holders make for it;
* ``close()`` (idempotent; withdraws the progress record), ``with`` support, checkpoint
  kinds;
* the hierarchical mode's envelope (:meth:`SwarmOptimizer._as_machine`): with a
  :class:`~swarmavg.averaging.training.local_group.LocalGroup`, only the group's leader
  talks to the daemon, and every other rank takes the leader's outcome (its state, its
  warnings, its failure) from one broadcast.

A subclass builds its own fields after ``super().__init__`` and then calls
:meth:`_join_swarm`, which may already call its :meth:`_catch_up`.

A wrapper is a real ``torch.optim.Optimizer`` (learning-rate schedulers, ``isinstance``
checks, optimizer hooks): its ``param_groups`` and ``state`` are the wrapped local
optimizer's own objects, so a scheduler that sets ``group["lr"]`` on the wrapper sets it on
the optimizer that steps. This module imports torch; the daemon never imports it (only the
torch-free ``progress`` module of this package).
"""

from __future__ import annotations

import logging
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from swarmavg.averaging.run_records.progress import STATE_ID_BYTES, GlobalProgress, PeerProgress
from swarmavg.averaging.training.background import LatestWork
from swarmavg.averaging.training.company import (
    DEFAULT_ALONE_AFTER,
    DEFAULT_STALLED_AFTER,
    CompanyWatch,
)
from swarmavg.averaging.training.company_link import DEFAULT_START_TIMEOUT, CompanyLink
from swarmavg.averaging.training.consensus import (
    Provenance,
    Role,
    Verdict,
    judge,
    provenance_id,
)
from swarmavg.averaging.training.digest import state_digest
from swarmavg.averaging.training.local_group import LocalGroup, LocalGroupError, outcome_timeout
from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.averaging.training.state import TrainingState, pack_state
from swarmavg.averaging.training.swarm import (
    RoundResultLike,
    RoundStats,
    SwarmClient,
    SwarmLink,
    SwarmRoundWarning,
    swarm_errors,
)
from swarmavg.averaging.training.tensors import collect_params, copy_into
from swarmavg.averaging.training.verbose import ProgressLog

log = logging.getLogger(__name__)

_W = TypeVar("_W", bound="SwarmOptimizer")


def resolve_run(client: SwarmClient | None, run_id: str | None) -> str:
    """The training run of a wrapper: ``run_id``, or its daemon's run id when None.

    One run id is the common case (``swarmavg peer --run-id X`` and trainers that follow
    it); a wrapper's own run id is a second namespace on the same daemons, useful on
    purpose and silent when mistyped (docs/training.md, "Run ids").

    Raises:
        ValueError: an empty ``run_id``, a daemon whose status names no run, or no client
            to ask (a follower rank of a local group: every rank passes the run id, so
            that the ranks' states name one run).
    """
    if run_id is not None:
        if not run_id:
            raise ValueError("run_id must not be empty (None: the daemon's run id)")
        return run_id
    if client is None:
        raise ValueError(
            "run_id=None takes the daemon's run id, but this rank has no client to ask: "
            "pass run_id on every rank of a local group"
        )
    status = client.status()
    run = status.get("run_id") if isinstance(status, Mapping) else None
    if not isinstance(run, str) or not run:
        raise ValueError("the daemon's status names no run_id; pass run_id explicitly")
    return run


FINAL_POLL = 0.05
"""Seconds between two reads of the progress while ``close()`` waits for the final records
of the processes that stop with it (a DHT read through the daemon each)."""


class SwarmOptimizer(torch.optim.Optimizer, ABC):
    """The swarm side of a training wrapper (see the module docstring).

    Args:
        params: the parameters the wrapper trains (``model.parameters()``).
        local_optimizer: the optimizer that steps on this process's own batches (its
            ``zero_grad`` clears the parameters' gradients).
        client: a connected swarmavg client (``swarmavg.peer.connect()``).
        run_id: the training run; every key the wrapper averages under starts with it.
        progress_key: the run id under which progress is reported (a wrapper may keep its
            records apart from another wrapper's in the same run).
        target_samples: samples the swarm processes per epoch.
        batch_size_per_step: samples behind one ``step()`` call.
        codec, aggregation, averaging_timeout, min_group_size, state_timeout: the rounds'
            settings (:class:`~swarmavg.averaging.training.swarm.SwarmLink`).
        progress_ttl: seconds a progress record lives in the DHT.
        publish_state_every: publish the state every this many epochs (0: never).
        peer_id: the daemon's peer id (read from ``client.status()`` when None).
        verbose: log the epoch, the swarm's samples/s and the time to the next global step
            at INFO (:mod:`~swarmavg.averaging.training.verbose`; make the library's logs
            visible with ``swarmavg.peer.enable_logging()``).
        alone_after: seconds without another trainer of the run before a warning says
            this process trains alone, with the run ids it can see (``inf``: never;
            :mod:`~swarmavg.averaging.training.company`).
        stalled_after: seconds without a global step before a warning says so, with the
            swarm's progress towards the target (``inf``: never).
        min_peers: daemons (this one included) whose trainers must report in the run
            before the first global step (the start barrier, :meth:`_await_company`).
        start_timeout: seconds the first global step waits for them at most (0: no wait).
        local_group: the hierarchical mode (docs/training.md): this machine's ranks, of
            which only the leader talks to the daemon (None: this process is one peer).
            ``client`` may be None on the other ranks.

    Raises:
        ValueError: a non-positive batch size, a negative ``publish_state_every``, an
            unknown aggregation rule (the message lists the known ones), or no client on
            a process that talks to the daemon.
    """

    KIND: ClassVar[str]
    """Names the wrapper in its checkpoints and published states (a state of another kind
    is refused)."""
    PUBLISH_IN_BACKGROUND: ClassVar[bool] = False
    """Publish the state for late joiners from a snapshot on a thread of its own
    (:class:`~swarmavg.averaging.training.background.LatestWork`) instead of waiting for
    the daemon in ``step()``: for the wrappers whose steps must not wait on the network."""

    def __init__(
        self,
        params: Iterable[Any],
        local_optimizer: torch.optim.Optimizer,
        client: SwarmClient | None,
        run_id: str,
        *,
        progress_key: str,
        target_samples: int,
        batch_size_per_step: int,
        codec: str | None,
        aggregation: str,
        averaging_timeout: float,
        min_group_size: int,
        progress_ttl: float,
        publish_state_every: int,
        state_timeout: float,
        peer_id: str | None,
        verbose: bool = False,
        local_group: LocalGroup | None = None,
        final_round: bool = True,
        final_timeout: float | None = None,
        alone_after: float = DEFAULT_ALONE_AFTER,
        stalled_after: float = DEFAULT_STALLED_AFTER,
        min_peers: int = 1,
        start_timeout: float = DEFAULT_START_TIMEOUT,
    ) -> None:
        if final_timeout is not None and not final_timeout > 0:
            raise ValueError(f"final_timeout must be positive, got {final_timeout}")
        if batch_size_per_step <= 0:
            raise ValueError(f"batch_size_per_step must be positive, got {batch_size_per_step}")
        if publish_state_every < 0:
            raise ValueError("publish_state_every must not be negative")
        # torch's bookkeeping (hooks, the step profiler) over the local optimizer's groups,
        # then the groups and the state themselves: one object each, shared with it.
        super().__init__(local_optimizer.param_groups, local_optimizer.defaults)
        self.param_groups = local_optimizer.param_groups
        self.state = local_optimizer.state
        self._wrapped = True
        self.params = collect_params(params)
        self.batch_size_per_step = batch_size_per_step
        self.publish_state_every = publish_state_every
        self._local_optimizer = local_optimizer
        self.local_group = local_group
        self._follower = local_group is not None and not local_group.is_leader
        self._outcome_timeout = outcome_timeout(averaging_timeout, state_timeout)
        self._state_loaded = False
        """Set when the leader takes a state from the swarm (catch-up, repair): the parts
        each rank otherwise keeps as its own then travel to the other ranks too."""
        if client is None and not self._follower:
            raise ValueError(
                "client is None: this process talks to the daemon (it is not a follower "
                "rank of a local group), so it needs swarmavg.peer.connect()"
            )
        if client is None:
            client = _NoDaemon()
            peer_id = peer_id or f"local-rank-{local_group.rank if local_group else 0}"
        self.link = SwarmLink(
            client,
            run_id,
            codec=codec,
            aggregation=aggregation,
            timeout=averaging_timeout,
            min_group_size=min_group_size,
            state_timeout=state_timeout,
        )
        self.tracker = ProgressTracker(
            client,
            progress_key,
            target_samples,
            ttl=progress_ttl,
            peer_id=peer_id,
            no_shows=self.link.no_shows,
        )
        self.verbose = bool(verbose)
        self._progress_log = ProgressLog() if verbose else None
        self.company = CompanyLink(
            self.link,
            self.tracker,
            self.KIND,
            CompanyWatch(alone_after, stalled_after, time.monotonic()),
            min_peers=min_peers,
            start_timeout=start_timeout,
        )
        """The trainer's ties to the rest of its run: its trainer entry, the warnings when
        it trains alone, the start barrier (:meth:`_await_company`)."""
        self._closed = False
        self._rank_samples = 0
        """Hierarchical mode: samples this rank processed since the last global step (its
        weight in the machine's contribution)."""
        self._provenance: Provenance | None = None
        """The round step that produced the current state (None: a local step, a restored
        checkpoint, ...); published with the state so that repairing members find it."""
        self._publisher = LatestWork("state publish")
        """``PUBLISH_IN_BACKGROUND``: the publishes in flight, newest last."""
        self.final_round = bool(final_round)
        self.final_timeout = averaging_timeout if final_timeout is None else final_timeout
        # the followers of a local group wait for the leader's final agreement too: its
        # wait for the others' final records, then its round (each final_timeout at most)
        self._outcome_timeout = max(self._outcome_timeout, 2 * self.final_timeout + 30.0)
        # ... and for the leader's start barrier (:meth:`_start_together`)
        self._outcome_timeout = max(self._outcome_timeout, start_timeout + 30.0)
        self._joined = False
        """Set once the process joined the swarm: a later catch-up is a rejoin."""
        self._start_checked = False
        """Set at the first local step of a wrapper that waits there (:meth:`_start_together`)."""
        self._exact_for: Provenance | None = None
        """Set to :attr:`_provenance` when the current state is exactly the post-step state
        it names (a complete round's step, or a state loaded from such a holder), so any
        member with the same provenance holds the same bytes (:meth:`_state_id`). A new
        provenance object (or None) is not exact until marked (:meth:`_mark_exact`)."""
        self._exact_holders: frozenset[str] = frozenset()
        """The daemons that held the majority's state in the round whose exact post-step
        state this is: each gets the same state when that round lands on it (a member with
        ``delay_updates`` whose round is still in flight)."""
        self._exact_versions: tuple[int, ...] = ()
        """The parameters' in-place version counters when :attr:`_exact_for` was set: any
        change since (a local step, a checkpoint loaded into the model) voids the id."""
        self.tracker.state_id = self._record_state_id

    def _join_swarm(self, load_state_on_start: bool) -> None:
        """Catch up with a swarm past our epoch (if asked to), report, start the meter.

        Called by the subclass at the end of its ``__init__``, once :meth:`_catch_up` can
        run.
        """

        def join() -> None:
            if load_state_on_start:
                progress = self.tracker.refresh()
                if progress.epoch > self.epoch:
                    if progress.num_peers <= 1:
                        self._announce(progress.epoch)
                    self._catch_up(progress)
            self.tracker.report()
            self.company.joined()

        # Hierarchical mode: every rank starts from the leader's state (like DDP's first
        # broadcast), the one it loaded from the swarm if it caught up.
        self._as_machine(join)
        self._joined = True
        self.tracker.meter.start()

    def _announce(self, epoch: int) -> None:
        """A newcomer that finds one trainer alone reports the epoch it is about to load
        before the download: the trainer alone then counts it as a member of its round
        and waits for it, instead of stepping on alone meanwhile (the newcomer would
        arrive one epoch behind, at a round nobody else joins). A swarm of
        several daemons does not wait for a newcomer: it loads what they publish."""
        joined = self.tracker.epoch
        self.tracker.set_epoch(epoch)
        try:
            self.tracker.report()
        except swarm_errors() as exc:
            log.info("could not announce this process before loading the state: %s", exc)
        finally:
            self.tracker.set_epoch(joined)

    # ------------------------------------------------------------------ public API

    @property
    def epoch(self) -> int:
        """The swarm's global step this process works towards (equal across the swarm;
        DiLoCo counts outer steps)."""
        return self.tracker.epoch

    @property
    def stats(self) -> RoundStats:
        """Counters of this process's rounds and state transfers."""
        return self.link.stats

    def global_progress(self) -> GlobalProgress:
        """The swarm's progress as last read (samples, rates, ETA)."""
        return self.tracker.last

    def report_metrics(self, **metrics: float | torch.Tensor) -> None:
        """Attach user metrics (``loss=0.31, accuracy=0.9``) to this process's progress
        record: they go out with its next report and ``swarmavg peers`` shows them. Each
        call replaces the previous metrics; no arguments clears them.

        Raises:
            ValueError: more than 8 entries, a name outside ``[A-Za-z0-9_./-]{1,32}``, or a
                value that is not a finite number (a one-element tensor is taken).
        """
        # A loss straight from the graph requires grad; converting it to a number would
        # warn (torch's "Converting a tensor with requires_grad=True to a scalar").
        self.tracker.set_metrics(
            {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' ``.grad`` (what the wrapper accumulated is kept)."""
        self._local_optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once wrapped: every member must average the same parameters, fixed when
        the wrapper was built (add groups to the local optimizer before wrapping it).

        Raises:
            ValueError: always, after construction.
        """
        if getattr(self, "_wrapped", False):
            raise ValueError(
                f"{type(self).__name__} averages a fixed set of parameters: add parameter "
                "groups to the local optimizer before wrapping it"
            )
        super().add_param_group(param_group)

    def close(self) -> None:
        """Finish the wrapper's own work (:meth:`_finish`), agree on the parameters with
        the others that stop now (the final round, docs/training.md "Finishing a run";
        ``final_round=False`` skips it), and tell the swarm this process stopped, so that
        no round waits for it; idempotent."""
        self._close(agree=self.final_round)

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # A loop that raised leaves without the final round: its parameters are not a
        # result anyone should average with (and the error is not delayed by a round).
        self._close(agree=self.final_round and exc_type is None)

    def _close(self, *, agree: bool) -> None:
        if self._closed:
            return
        try:
            self._finish()
            if agree:
                self._as_machine(self._final_agreement)
        finally:
            self._closed = True
            # The last state published is the one a late joiner loads: let it land.
            self._publisher.close(timeout=self.link.state_timeout)
        self._leave()

    # ------------------------------------------------------------------ for subclasses

    def _finish(self) -> None:
        """Work to complete before leaving the swarm on :meth:`close` (default: none)."""

    # ------------------------------------------------------------------ finishing a run

    def _final_agreement(self) -> None:
        """``close()``: end with the same parameters as every other process that stops now
        (docs/training.md, "Finishing a run").

        This process reports a final record (its state id), then reads the others at the
        swarm's epoch or one behind until each has either reported a final record too or
        reports this process's state id (identical, whether it stops or trains on), at
        most ``final_timeout``. When every one of them holds this state, or there is none,
        nothing runs. Otherwise the processes that stop average their parameters under
        ``final.{epoch}`` (equal weights, codec none) and take the mean, unless every
        member attached the same parameter digest (identical already). Every process that
        stops reads the same final records, so all of them decide alike. The round has
        ``final_timeout`` of its own; one that gathers nobody leaves the parameters as
        they are. On the hierarchical mode's leader: its ranks take the outcome.
        """
        stats = self.stats
        deadline = time.monotonic() + self.final_timeout
        own = self.tracker.peer_id
        mine = self._state_id()
        self.tracker.final = True
        training = self.tracker.last  # global_progress() keeps the training's last read
        try:
            self._agree(stats, deadline, own, mine)
        finally:
            self.tracker.last = training

    def _agree(self, stats: RoundStats, deadline: float, own: str, mine: bytes) -> None:
        """:meth:`_final_agreement`'s work."""
        try:
            self.tracker.report()
            while True:
                progress = self.tracker.refresh()
                epoch = progress.epoch
                others = [
                    p for p in progress.peers if p.peer_id != own and epoch - 1 <= p.epoch <= epoch
                ]
                undecided = [p for p in others if not p.final and not self._holds(p, mine)]
                if not undecided or time.monotonic() >= deadline:
                    break
                time.sleep(FINAL_POLL)
        except swarm_errors() as exc:
            stats.final_agreement = "failed"
            log.warning("final round skipped: the swarm's progress could not be read: %s", exc)
            return
        differing = [p for p in others if p.final and not self._holds(p, mine)]
        if not others:
            stats.final_agreement = "alone"
            log.debug("final round: no other live process; the parameters are this one's")
            return
        if not differing:
            if undecided:
                stats.final_agreement = "failed"
                log.warning(
                    "final round: %d process(es) at epoch %d hold other parameters and did "
                    "not stop within %.0fs; this process keeps its own",
                    len(undecided),
                    epoch,
                    self.final_timeout,
                )
            else:
                stats.final_agreement = "identical"
                log.debug("final round: the others hold this state; nothing to do")
            return
        daemons = {own} | {p.peer_id for p in others if p.final}
        tensors = self._final_tensors()
        digest = state_digest(tensors, {}, 0)
        result = self.link.agree(
            [t.detach().cpu().float().numpy() for t in tensors],
            key=f"final.{epoch}",
            group_size=len(daemons),
            timeout=self.final_timeout,
            digest=digest,
        )
        if result is None:
            stats.final_agreement = "failed"
            log.warning(
                "final round final.%d gathered no group within %.0fs: this process's "
                "parameters may differ from the others'",
                epoch,
                self.final_timeout,
            )
            return
        stats.final_group_size = int(result.group_size)
        digests = _digests_of(result)
        if set(digests.values()) == {digest} and len(digests) == result.group_size:
            stats.final_agreement = "identical"  # same bytes everywhere: nothing to take
        else:
            self._take_final(result.tensors)
            stats.final_agreement = "partial" if result.partial else "averaged"
            # No round step produced these parameters: publish them without a provenance
            # (no repair may take them for one), as the run's result for whoever loads it.
            self._provenance = None
            if self.publish_state_every:
                self._publish(*pack_state(self._training_state(self.epoch)), self.epoch, False)
        log.info(
            "final round final.%d: %d members, %s",
            epoch,
            result.group_size,
            stats.final_agreement,
        )

    def _holds(self, record: PeerProgress, mine: bytes) -> bool:
        """Whether the process of ``record`` holds this process's state ``mine``: it
        reports the same id. A process whose round is still in flight (``delay_updates``)
        reports none, so it is waited for until it reports a final record or the wait
        ends: that it held the majority's state when its round started says nothing of
        what it changed since (a local step, parameters set in place)."""
        return _same(record.state, mine)

    def _final_tensors(self) -> list[torch.Tensor]:
        """The tensors the final round averages (the parameters)."""
        return list(self.params)

    def _take_final(self, tensors: Sequence[Any]) -> None:
        """Take the final round's mean (default: as the parameters)."""
        copy_into(self.params, [torch.as_tensor(t) for t in tensors])

    def _state_id(self) -> bytes:
        """An id of this process's parameters: equal non-empty ids mean bit-identical
        parameters (default: the provenance of an exact post-step state, while the
        parameters were not changed in place since; see :attr:`_exact_for`). Empty when
        not known."""
        provenance = self._provenance
        if provenance is None or provenance is not self._exact_for:
            return b""
        if provenance.epoch != self.epoch or self._versions() != self._exact_versions:
            return b""
        return provenance_id(provenance)

    def _versions(self) -> tuple[int, ...]:
        """The parameters' in-place version counters (torch bumps them on every in-place
        change but those made through ``.data``)."""
        return tuple(int(getattr(p, "_version", 0)) for p in self.params)

    def _mark_exact(self, holders: Iterable[str] = ()) -> None:
        """The current state is exactly the one :attr:`_provenance` names (``holders``:
        the round's members that held the state it stepped from)."""
        self._exact_for = self._provenance
        self._exact_versions = self._versions()
        self._exact_holders = frozenset(holders)

    def _take_provenance(self, state: TrainingState) -> None:
        """The provenance of a loaded state (a repair, a catch-up), taken after its
        tensors: exact when its holder said its state was (``extra["exact"]``)."""
        self._provenance = Provenance.from_extra(state.extra)
        if state.extra.get("exact") is True:
            self._mark_exact()

    def _record_state_id(self) -> bytes:
        """The id the progress records carry (the tracker calls it at every report)."""
        return self._state_id()

    # ------------------------------------------------------------------ rejoining

    def _note_rejoin(self, old: int, new: int) -> None:
        """Count and log that this process adopted the swarm's epoch ``new`` at ``old``
        (after it joined; the newcomer's first catch-up is not a rejoin)."""
        if not self._joined:
            return
        self.stats.rejoins += 1
        self.tracker.rejoins = self.stats.rejoins
        where = "ahead of" if old > new else "behind"
        level = logging.WARNING if self.stats.rejoins == 1 else logging.INFO
        log.log(
            level,
            "at epoch %d, %s the swarm's epoch %d: adopted the swarm's epoch (rejoin %d)",
            old,
            where,
            new,
            self.stats.rejoins,
        )

    def _leave(self) -> None:
        """Withdraw from the swarm's progress so that nobody waits for this process (a
        follower rank never reported: its leader's record stands for the machine)."""
        if self._follower:
            return
        try:
            self.tracker.leave()
        except swarm_errors() as exc:
            log.warning("could not withdraw the progress record: %s", exc)

    def _log_progress(self) -> None:
        """After each step: write the progress line when it is due (``verbose=True``) and
        say when this process trains alone or the swarm takes no global step."""
        if self._progress_log is not None:
            self._progress_log.update(self.epoch, *self._verbose_figures())
        if not self._follower:
            self.company.after_step(self.epoch)

    def _await_company(self, progress: GlobalProgress) -> GlobalProgress:
        """The start barrier before the first global step (:meth:`CompanyLink.await_start`;
        a follower rank never waits: its leader does)."""
        return progress if self._follower else self.company.await_start(progress)

    def _start_together(self) -> None:
        """The start barrier before this wrapper's first local step, for the wrappers whose
        members each run their own share of the work between two syncs (DiLoCo and its
        streaming form): a trainer that started first would otherwise take the run's first
        outer steps alone, or wait at its first round for members still starting, up to
        the round's timeout. Waiting before the inner steps instead lets every member
        arrive at the first sync together. Once per wrapper; in the hierarchical mode the
        leader waits and every rank waits with it (its outcome is the leader's)."""
        if self._start_checked:
            return
        self._start_checked = True
        if self.local_group is None:
            self._await_start_here()
        else:  # every rank calls this at its first step: one broadcast, as at the join
            self._as_machine(self._await_start_here)

    def _await_start_here(self) -> None:
        if not self._follower and self.company.start_pending:
            self.company.await_start(self.tracker.refresh(), before="inner step")

    def _verbose_figures(self) -> tuple[int, int, float, int, float]:
        """``(samples, target, swarm samples/s, peers, eta)`` towards the next global step.

        The swarm's figures as last read; right after a global step, before the others'
        records of the new epoch are read, the samples are this process's own.
        """
        p = self.tracker.last
        target = self.tracker.target_batch_size
        if p.epoch == self.epoch:
            return p.samples, target, p.samples_per_second, p.num_peers, p.eta
        samples = self.tracker.samples
        rate = max(p.samples_per_second, self.tracker.meter.rate)
        eta = max(target - samples, 0) / rate if rate > 0 else float("inf")
        return samples, target, rate, max(p.num_peers, 1), eta

    def _run_closure(self, closure: Callable[[], Any] | None) -> Any:
        """The closure's loss, computed with gradients enabled (None without a closure)."""
        if closure is None:
            return None
        import torch

        with torch.enable_grad():
            return closure()

    def _samples(self, batch_size: int | None) -> int:
        """Samples behind this step (default ``batch_size_per_step``).

        Raises:
            ValueError: ``batch_size`` is not positive.
        """
        samples = self.batch_size_per_step if batch_size is None else batch_size
        if samples <= 0:
            raise ValueError(f"batch_size must be positive, got {samples}")
        return samples

    def _check_kind(self, state: dict[str, Any], what: str) -> None:
        """Refuse a checkpoint written by another kind of wrapper.

        Raises:
            ValueError: ``state["kind"]`` is not this wrapper's ``KIND``.
        """
        if state.get("kind") != self.KIND:
            raise ValueError(f"not a {self.KIND} {what}: kind={state.get('kind')!r}")

    def _maybe_publish(self, epoch: int, *, serve: bool = False) -> None:
        """Publish the state of ``epoch`` when it is one of every ``publish_state_every``,
        or at once when members of the last round repair from it (``serve``)."""
        scheduled = bool(self.publish_state_every) and epoch % self.publish_state_every == 0
        if not (scheduled or serve):
            return
        state = self._training_state(epoch)
        if self._provenance is not None and self._provenance.epoch == epoch:
            state.extra["provenance"] = self._provenance.to_extra()
            if self._provenance is self._exact_for:
                state.extra["exact"] = True
        metadata, arrays = pack_state(state)  # a snapshot: training goes on meanwhile
        if self.PUBLISH_IN_BACKGROUND and not self._closed:
            self._publisher.submit(self._publish, metadata, arrays, epoch, serve)
        else:
            self._publish(metadata, arrays, epoch, serve)

    def _publish(
        self, metadata: dict[str, Any], arrays: list[Any], epoch: int, serve: bool
    ) -> None:
        """Hand a packed state to the daemon (on the publisher's thread when in the
        background; a newer publish drops this one if it has not started)."""
        if self.link.publish_packed(metadata, arrays) and serve:
            self.stats.served += 1
            log.info("published the state of epoch %d for the members that repair", epoch)

    # ------------------------------------------------------------------ one shared state

    def _judge(self, result: RoundResultLike, mine: bytes, key: str) -> Verdict:
        """This member's verdict on the digests the round's members attached."""
        verdict = judge(_digests_of(result), mine)
        if verdict.role is Role.REPAIR:
            self.stats.diverged += 1
        elif verdict.role is Role.SERVE:
            log.info(
                "round %s: %d member(s) hold another state than the majority's (%s)",
                key,
                len(verdict.differing),
                ", ".join(p[:12] for p in verdict.differing),
            )
        return verdict

    def _step_provenance(
        self,
        epoch: int,
        verdict: Verdict | None,
        mine: bytes,
        group: str,
        *,
        partial: bool = False,
    ) -> None:
        """Record that the state of ``epoch`` is the round step from the majority's state
        (``verdict`` None or REPAIR: a state no repairing member may take). Exact unless
        the round was ``partial`` (its members kept some values of their own)."""
        if verdict is None or verdict.role is Role.REPAIR:
            self._provenance = None
        else:
            self._provenance = Provenance(epoch, verdict.majority or mine, group)
            if not partial:
                self._mark_exact(verdict.holders)

    def _repair(
        self,
        verdict: Verdict,
        result: RoundResultLike,
        epoch: int,
        key: str,
        like: Sequence[torch.Tensor],
    ) -> TrainingState | None:
        """Load the holders' post-step state of this round (it becomes ``epoch``); None,
        logged and counted, when none could be loaded within ``state_timeout``."""
        expected = Provenance(epoch, verdict.majority, _group_of(result))
        log.warning(
            "round %s: this process's state differs from the majority's (%s, held by %s); "
            "skipping its step and loading their state of epoch %d",
            key,
            verdict.majority.hex()[:16],
            ", ".join(p[:12] for p in verdict.holders),
            epoch,
        )
        started = time.monotonic()
        state, why = self.link.load_round_state(self.KIND, like, expected)
        elapsed = time.monotonic() - started
        self.stats.repair_seconds += elapsed
        if state is None:
            self.stats.repair_failures += 1
            self.stats.last_repair_error = why
            log.warning(
                "round %s: repair failed after %.2fs (%s); stepping with the round's result, "
                "the next round tries again",
                key,
                elapsed,
                why,
            )
            return None
        self.stats.repairs += 1
        log.warning("round %s: repaired from the majority's state in %.2fs", key, elapsed)
        return state

    def _adopt_swarm_epoch(
        self, progress: GlobalProgress, like: list[torch.Tensor]
    ) -> tuple[TrainingState | None, int]:
        """Not at the swarm's epoch (behind it, or ahead of its majority): the state to
        take and the epoch to continue at (docs/training.md, "Staying in one swarm").

        The state is the swarm's newest one (None, with a warning, when none loads or
        the newest is far ahead of the swarm's epoch: a process that ran ahead published
        it). The epoch is the swarm's, read again after the download (the swarm may have
        stepped on meanwhile: continuing at its epoch with a slightly older state lets the
        next round's shared-state repair finish the job instead of chasing it with
        downloads), or the state's when that is newer. Counts and logs a rejoin.
        """
        old = self.epoch
        if progress.epoch > old:
            where = f"epoch {old} < {progress.epoch}"
        elif progress.epoch < old:
            where = f"epoch {old}, ahead of the swarm's epoch {progress.epoch}"
        else:
            where = f"epoch {old}, missed by the swarm's round"
        # Behind a swarm at an epoch whose state its members publish, that state is due:
        # its publisher advertised the epoch first (StreamingDiLoCo publishes in the
        # background after it reports), so "nobody published" may only mean "not yet".
        due = (
            progress.epoch > old
            and self.publish_state_every > 0
            and progress.epoch % self.publish_state_every == 0
        )
        state = self._load_swarm_state(
            like, where, expect_published=due, at_least=progress.epoch if due else None
        )
        if state is not None and state.epoch > progress.epoch + 1:
            warnings.warn(
                f"{where}: the swarm's newest state is of epoch {state.epoch}, ahead of the "
                "swarm's majority (a process that ran ahead published it); continuing "
                "with local parameters at the swarm's epoch",
                SwarmRoundWarning,
                stacklevel=3,
            )
            state = None
        epoch = progress.epoch if state is None else max(state.epoch, progress.epoch)
        self.tracker.set_epoch(epoch)
        try:
            epoch = max(epoch, self.tracker.refresh().epoch)
        except swarm_errors() as exc:
            log.info("could not read the swarm's progress after loading its state: %s", exc)
        self._note_rejoin(old, epoch)
        return state, epoch

    def _load_swarm_state(
        self,
        params: list[torch.Tensor],
        behind: str,
        *,
        expect_published: bool = False,
        at_least: int | None = None,
    ) -> TrainingState | None:
        """The swarm's newest state of this wrapper's kind, shaped like ``params``; None,
        with a :class:`SwarmRoundWarning`, when none could be loaded.

        Args:
            params: the tensors the state's parameters must match.
            behind: how far behind this process is, for the warning (e.g.
                ``"epoch 3 < 5"``).
            expect_published: a state is due: wait for one within ``state_timeout``
                (:meth:`SwarmLink.load`).
            at_least: the epoch whose state is due; an older one found first is retried
                for a moment (:meth:`SwarmLink.load`).
        """
        state = self.link.load(
            self.KIND, params, expect_published=expect_published, at_least=at_least
        )
        if state is None:
            warnings.warn(
                f"off the swarm's epoch ({behind}) and no state could be loaded; "
                "continuing with local parameters",
                SwarmRoundWarning,
                stacklevel=4,  # two frames above _catch_up: usually the user's step()
            )
        return state

    # ------------------------------------------------------------------ hierarchical mode

    @property
    def _machine_batch(self) -> int:
        """Samples behind one ``step()`` of the whole machine (every rank steps once)."""
        size = self.local_group.size if self.local_group is not None else 1
        return self.batch_size_per_step * size

    def _report_unless_follower(self) -> None:
        """Report progress, except on a follower rank (a checkpoint restored on every rank:
        the leader's record stands for the machine, and a follower has no daemon)."""
        if not self._follower:
            self.tracker.report()

    def _machine_samples(self, samples: int) -> int:
        """Hierarchical mode: count this step's samples of every rank, once, on the leader's
        progress record (a collective: every rank calls it at every step). Otherwise:
        ``samples``, counted."""
        group = self.local_group
        if group is None:
            self.tracker.add_samples(samples)
            return samples
        self._rank_samples += samples
        total = group.sum_int(samples)
        if group.is_leader:
            self.tracker.add_samples(total)
        return total

    def _weighted_mean_onto_leader(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace the leader's ``tensors`` with the mean of every rank's, weighted by the
        samples each rank processed since the last global step (a collective)."""
        group = self.local_group
        assert group is not None
        weight = float(self._rank_samples)
        summed = group.reduce_sum([t.detach().float() * weight for t in tensors])
        if summed is None:
            return
        total = float(self.tracker.samples)
        if total <= 0:
            return  # nothing was processed: the leader's own values stand
        copy_into(tensors, [s / total for s in summed])

    def _sum_onto_leader(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace the leader's ``tensors`` with the sum of every rank's (a collective)."""
        group = self.local_group
        assert group is not None
        summed = group.reduce_sum(tensors)
        if summed is not None:
            copy_into(tensors, summed)

    def _as_machine(self, work: Callable[[], None]) -> None:
        """Run ``work`` (what talks to the swarm) on this process, or in the hierarchical
        mode on the leader only, and give every other rank the leader's outcome.

        The leader broadcasts one envelope: its failure (if ``work`` raised), the
        :class:`SwarmRoundWarning` messages it gave, and its state after ``work``
        (:meth:`_machine_state`). A follower re-issues the warnings, raises
        :class:`~swarmavg.averaging.training.local_group.LocalGroupError` when the leader
        failed (the leader re-raises its own error), or takes the state: every rank ends
        the same way, with the same parameters.
        """
        group = self.local_group
        if group is None:
            work()
            return
        if group.is_leader:
            self._state_loaded = False
            error: Exception | None = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    work()
                except Exception as exc:  # re-raised below, after the followers know
                    error = exc
            notes: list[str] = []
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
                if issubclass(w.category, SwarmRoundWarning):
                    notes.append(str(w.message))
            envelope: dict[str, Any] = {
                "error": None if error is None else f"{type(error).__name__}: {error}",
                "warnings": notes,
                "state": None if error is not None else self._envelope_state(),
            }
            group.broadcast_object(envelope, timeout=self._outcome_timeout)
            if error is not None:
                raise error
            return
        received = group.broadcast_object(None, timeout=self._outcome_timeout)
        if not isinstance(received, dict):
            raise LocalGroupError(f"the local leader sent {type(received).__name__}, not a dict")
        for note in received.get("warnings", []):
            warnings.warn(f"{note} (local leader)", SwarmRoundWarning, stacklevel=4)
        if received.get("error"):
            raise LocalGroupError(
                f"the local leader (rank {group.leader}) failed: {received['error']}"
            )
        state = received["state"]
        self.tracker.set_epoch(int(state["epoch"]), int(state["samples"]))
        self._rank_samples = 0
        self._take_machine_state(state)

    def _envelope_state(self) -> dict[str, Any]:
        state = self._machine_state()
        state["epoch"] = self.epoch
        state["samples"] = self.tracker.samples
        self._rank_samples = 0
        return state

    def _machine_state(self) -> dict[str, Any]:
        """Hierarchical mode: what the leader sends its followers after talking to the
        swarm: here the parameters and the local optimizer's state (a subclass with more
        shared state, or state each rank keeps as its own, overrides both methods;
        ``self._state_loaded`` says whether the leader took a state from the swarm)."""
        return {
            "params": [p.detach().cpu() for p in self.params],
            "optimizer": self._local_optimizer.state_dict(),
        }

    def _take_machine_state(self, state: Mapping[str, Any]) -> None:
        """A follower takes what :meth:`_machine_state` sent."""
        copy_into(self.params, state["params"])
        if state.get("optimizer") is not None:
            self._local_optimizer.load_state_dict(state["optimizer"])

    @abstractmethod
    def _training_state(self, epoch: int) -> TrainingState:
        """What this wrapper publishes for ``epoch``."""

    @abstractmethod
    def _shared_digest(self) -> bytes:
        """The digest of the state every member must hold identically, attached to the
        round (:func:`~swarmavg.averaging.training.digest.state_digest`)."""

    @abstractmethod
    def _catch_up(self, progress: GlobalProgress) -> None:
        """Behind the swarm: take its newest state and continue at its epoch."""


class _NoDaemon:
    """The client of a follower rank, which never talks to the daemon: any use is a bug
    in the wrapper, and says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"a follower rank of a local group used the daemon ({name}); only the leader may"
        )


def _digests_of(result: RoundResultLike) -> dict[str, bytes]:
    """The round's state digests, defensively: the map comes from the daemon (and, before
    it, from the group's leader)."""
    raw = getattr(result, "state_digests", None)
    if not isinstance(raw, Mapping):
        return {}
    return {p: d for p, d in raw.items() if isinstance(p, str) and isinstance(d, bytes)}


def _same(state: bytes, mine: bytes) -> bool:
    """Whether a record's state id says it holds this process's state (ids are known)."""
    return bool(mine) and state == mine[:STATE_ID_BYTES]


def _group_of(result: RoundResultLike) -> str:
    group = getattr(result, "group_id", "")
    return group if isinstance(group, str) else ""


__all__ = ["SwarmOptimizer"]
