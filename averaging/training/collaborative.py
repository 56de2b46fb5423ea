"""Training wrappers (docs/training.md): collaborative large-batch training over a swarm.

:class:`CollaborativeOptimizer` wraps any ``torch.optim.Optimizer``. Every process trains
on its own data and calls ``step()`` after each backward pass, as usual. The wrapper
accumulates the local gradients and reports the samples it has processed to the DHT
(:mod:`swarmavg.averaging.training.progress`). When the swarm as a whole has processed
``target_batch_size`` samples for the current global step ("epoch"), every process joins one
averaging round under a key derived from the run and the epoch, weighted by its sample
count, and applies the wrapped optimizer to the averaged gradient: one large-batch step,
taken together (the scheme of hivemind's Optimizer and of "Distributed Deep Learning in
Open Collaborations", Diskin et al. 2021). With ``average="parameters"`` each process
steps locally on every batch and the swarm averages parameters at every epoch instead.

:class:`DiLoCo` (:mod:`swarmavg.averaging.training.diloco`) averages pseudo-gradients every H
local steps and applies an outer optimizer (Douillard et al. 2023).

torch is imported inside functions only: ``swarmavg.averaging`` is imported by the daemon,
which never loads torch.

Synchronisation rules (one place, so they can be checked):

* The swarm's epoch is the one most daemons report (``progress.swarm_epoch``), not the
  newest. A process at epoch ``e`` behind it, or ahead of it (it took global steps alone),
  drops its accumulated gradients, loads the newest published state (parameters,
  optimizer state, epoch) through ``client.load_state`` and continues at the swarm's
  epoch (a rejoin, counted in ``stats.rejoins``). One epoch behind, it joins the round it
  missed only when the others say they still run it in the background
  (``delay_updates``).
* The round of epoch ``e`` is expected to gather every daemon that reported epoch ``e``
  (``group_size``), so it closes as soon as they are all in. A process alone at its epoch
  while others are live (catching up) expects them too, rather than run away from them.
* ``close()`` ends with a final agreement: the processes that stop together end with
  bit-identical parameters (``base.SwarmOptimizer._final_agreement``).
* A round that fails (``NoGroupError`` or any other ``SwarmError``) becomes a local step
  with a :class:`SwarmRoundWarning`; the epoch still advances, so the process stays in
  step with the others.
* Every round attaches the digest of this process's shared state (gradients: parameters,
  optimizer state and epoch before the step; parameters mode: the parameters of the last
  synchronisation and the epoch). A process whose digest is not the group's majority
  skips its step and loads the majority holders' post-step state (gradients mode), or
  takes the round's average, which replaces its parameters (parameters mode); the
  holders publish that state right after their step (docs/training.md).
"""

from __future__ import annotations

import enum
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from swarmavg.averaging.run_records.progress import GlobalProgress
from swarmavg.averaging.signal_mask import leave_signals_to_main_thread
from swarmavg.averaging.training.base import SwarmOptimizer, resolve_run
from swarmavg.averaging.training.company import DEFAULT_ALONE_AFTER, DEFAULT_STALLED_AFTER
from swarmavg.averaging.training.company_link import DEFAULT_START_TIMEOUT
from swarmavg.averaging.training.consensus import Role
from swarmavg.averaging.training.digest import state_digest
from swarmavg.averaging.training.local_group import (
    LocalGroup,
    LocalGroupError,
    resolve_local_group,
)
from swarmavg.averaging.training.state import TrainingState
from swarmavg.averaging.training.swarm import RoundResultLike, SwarmClient, SwarmRoundWarning
from swarmavg.averaging.training.tensors import copy_into, to_arrays

if TYPE_CHECKING:
    import torch
    import torch.distributed

log = logging.getLogger(__name__)

ZERO_WEIGHT = 1e-3
"""Weight of a process that has no samples in a round (the daemon requires weight > 0)."""


class _Action(enum.Enum):
    """What one ``step()`` leads to (the leader's decision in the hierarchical mode)."""

    NONE = 0
    GLOBAL = 1
    LATE = 2
    CATCH_UP = 3


_FAILED = -1
"""Broadcast instead of an action when the leader could not decide."""


@dataclass
class _PendingRound:
    """A round running in the background (``delay_updates=True``)."""

    epoch: int
    local: list[np.ndarray]
    digest: bytes
    future: Future[tuple[RoundResultLike | None, str]]
    versions: tuple[int, ...] = ()
    """The parameters' version counters when ``digest`` was taken: a change before the
    round lands (outside the wrapper) means the step is not from the digested state."""


class CollaborativeOptimizer(SwarmOptimizer):
    """Wraps a torch optimizer so that a swarm of processes takes large-batch steps together.

    Args:
        params: the parameters the wrapped optimizer trains (``model.parameters()``).
        optimizer: any ``torch.optim.Optimizer`` over those parameters.
        client: a connected swarmavg client (``swarmavg.peer.connect()``).
        run_id: the training run. Processes with the same ``run_id`` train together.
            None (the default): the daemon's run id (``swarmavg peer --run-id``).
        target_batch_size: samples the swarm processes per global step.
        batch_size_per_step: samples behind one ``step()`` call (override per call with
            ``step(batch_size=...)``).
        average: ``"gradients"`` (accumulate, average gradients, step together) or
            ``"parameters"`` (step locally on every batch, average parameters every epoch).
        codec: codec for the rounds (None: the daemon's default).
        aggregation: how each round combines the members' tensors: ``"mean"``,
            ``"centered-clip"`` or ``"trimmed-mean"``, parameters in the name
            (docs/averaging.md, "Aggregation"); robust rules for runs that admit
            strangers. A wrong name raises ``ValueError`` here.
        delay_updates: overlap communication with compute: the round of epoch ``e`` runs in
            a background thread while training continues, and its result is applied one
            step late (delayed update), at the first ``step()`` after it finished.
            Gradients mode only.
        averaging_timeout: seconds one round may take, matchmaking included.
        min_group_size: a round with fewer peers fails (and becomes a local step).
        progress_ttl: seconds a progress record lives in the DHT; keep it above the
            longest pause between two ``step()`` calls plus a round.
        publish_state_every: publish the state for late joiners every this many epochs
            (0: never).
        load_state_on_start: a process that finds the swarm past epoch 0 loads the newest
            state before its first step.
        state_timeout: seconds ``load_state`` may take.
        max_wait: at most this many seconds per ``step()`` spent waiting for the others to
            finish the epoch when they are about to (instead of computing one more batch,
            which would make the global batch larger than ``target_batch_size``).
        peer_id: the daemon's peer id (read from ``client.status()`` when None).
        verbose: log the epoch, the swarm's samples/s and the time to the next global step
            at INFO after a step (on a new epoch, else at most every 10 s); make the
            library's logs visible with ``swarmavg.peer.enable_logging()``.
        process_group: the hierarchical mode (docs/training.md, "Hierarchical mode"):
            this machine's ``torch.distributed`` group (or ``"world"`` for the default
            group, or a :class:`~swarmavg.averaging.training.local_group.LocalGroup`).
            The ranks reduce their gradients (or parameters) and sample counts locally;
            only the leader averages through the daemon, with the machine's weight, and
            every rank takes its result. Every rank must build the wrapper and call
            ``step()`` the same number of times (and ``close()``); ``client`` may be None
            on the others. With ``delay_updates`` the leader's round runs in the
            background and every rank takes its result at the same later step (the
            leader says when; one more small collective per step).
        local_leader: the group rank that talks to the daemon (default 0).
        final_round: on ``close()`` (and when a ``with`` block ends without an error),
            agree on the parameters with the processes that stop at the same time, so
            that all of them end with bit-identical parameters (docs/training.md,
            "Finishing a run"). In gradients mode a delayed update is applied first.
        final_timeout: seconds the final round may take (default ``averaging_timeout``).
        alone_after: seconds without another trainer of the run before a warning says
            this process trains alone, naming the run ids it can see (``inf``: never).
        stalled_after: seconds without a global step before a warning says so, with the
            swarm's progress towards ``target_batch_size`` (``inf``: never).
        min_peers: the start barrier: daemons (this one included) whose trainers must
            report in the run before the first global step. Whatever it says, the first
            global step also waits while the run's other daemons are up but none of their
            trainers reports yet (docs/training.md, "Starting together").
        start_timeout: seconds the first global step waits for them at most (0: never
            wait); the batches accumulated meanwhile are kept.

    Call ``zero_grad()`` after ``step()`` as usual. ``step()`` returns the closure's loss
    (or None). Not thread-safe: use it from the training thread. Close it (or use it as a
    context manager) to finish a background round.
    """

    KIND = "collaborative"

    def __init__(
        self,
        params: Iterable[Any],
        optimizer: torch.optim.Optimizer,
        client: SwarmClient | None,
        run_id: str | None = None,
        target_batch_size: int | None = None,
        batch_size_per_step: int | None = None,
        average: Literal["gradients", "parameters"] = "gradients",
        codec: str | None = None,
        *,
        aggregation: str = "mean",
        delay_updates: bool = False,
        averaging_timeout: float = 30.0,
        min_group_size: int = 2,
        progress_ttl: float = 30.0,
        publish_state_every: int = 1,
        load_state_on_start: bool = True,
        state_timeout: float = 60.0,
        max_wait: float = 1.0,
        peer_id: str | None = None,
        verbose: bool = False,
        process_group: LocalGroup | torch.distributed.ProcessGroup | str | None = None,
        local_leader: int = 0,
        final_round: bool = True,
        final_timeout: float | None = None,
        alone_after: float = DEFAULT_ALONE_AFTER,
        stalled_after: float = DEFAULT_STALLED_AFTER,
        min_peers: int = 1,
        start_timeout: float = DEFAULT_START_TIMEOUT,
    ) -> None:
        if target_batch_size is None or batch_size_per_step is None:
            raise ValueError("target_batch_size and batch_size_per_step are required")
        if average not in ("gradients", "parameters"):
            raise ValueError(f"average must be 'gradients' or 'parameters', got {average!r}")
        if delay_updates and average != "gradients":
            raise ValueError("delay_updates needs average='gradients'")
        if max_wait < 0:
            raise ValueError("max_wait must not be negative")
        local_group = resolve_local_group(process_group, local_leader)
        run_id = resolve_run(client, run_id)
        super().__init__(
            params,
            optimizer,
            client,
            run_id,
            progress_key=run_id,
            target_samples=target_batch_size,
            batch_size_per_step=batch_size_per_step,
            codec=codec,
            aggregation=aggregation,
            averaging_timeout=averaging_timeout,
            min_group_size=min_group_size,
            progress_ttl=progress_ttl,
            publish_state_every=publish_state_every,
            state_timeout=state_timeout,
            peer_id=peer_id,
            verbose=verbose,
            local_group=local_group,
            final_round=final_round,
            final_timeout=final_timeout,
            alone_after=alone_after,
            stalled_after=stalled_after,
            min_peers=min_peers,
            start_timeout=start_timeout,
        )
        self.optimizer = optimizer
        self.average = average
        self.max_wait = max_wait
        self._grads: list[torch.Tensor] | None = None
        if average == "gradients":
            import torch

            self._grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self._executor = (
            ThreadPoolExecutor(1, "swarmavg-round", initializer=leave_signals_to_main_thread)
            if delay_updates
            else None
        )
        self._pending: _PendingRound | None = None
        self._landed_alone = False
        """Hierarchical mode: the leader applied a background round outside the ranks'
        common landing (``state_dict``): its followers take its state at the next step."""
        self._landing = False
        """Hierarchical mode: a background round's result is being shared with the ranks,
        whose accumulators of the current epoch must be kept."""
        self._synced = b""  # parameters mode: digest of the last synchronised parameters
        self._join_swarm(load_state_on_start)
        self._mark_synced()

    # ------------------------------------------------------------------ public API

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        """Take one local step; when the swarm completes an epoch, take the global step.

        Args:
            closure: recomputes the loss (as for torch optimizers); its value is returned.
            batch_size: samples behind this step (default ``batch_size_per_step``).

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a bad batch size, or gradients the daemon rejects (NaN/Inf).
            RuntimeError: the optimizer was closed.
        """
        import torch

        if self._closed:
            raise RuntimeError("step() on a closed CollaborativeOptimizer")
        loss = self._run_closure(closure)
        samples = self._samples(batch_size)
        self._land_pending()
        if self._grads is not None:
            with torch.no_grad():
                for acc, p in zip(self._grads, self.params, strict=True):
                    if p.grad is not None:
                        acc.add_(p.grad.to(acc.dtype), alpha=float(samples))
        else:
            self.optimizer.step()
        if self.local_group is not None:
            self._machine_step(samples)
        else:
            self.tracker.add_samples(samples)
            self._act(*self._decide(self.tracker.report_and_refresh()))
        self._log_progress()
        self.tracker.meter.start()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Epoch, samples, wrapped optimizer state and accumulated gradients (a checkpoint).

        A round still running in the background is finished and applied first.
        """
        self._apply_pending(block=True)
        return {
            "kind": self.KIND,
            "epoch": self.epoch,
            "samples": self.tracker.samples,
            "optimizer": self.optimizer.state_dict(),
            "accumulators": None if self._grads is None else [g.clone() for g in self._grads],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (parameters are the model's business).

        Raises:
            ValueError: a state of another kind or with mismatched accumulators.
        """
        self._check_kind(state, "optimizer state")
        self._apply_pending(block=True)
        self.optimizer.load_state_dict(state["optimizer"])
        accumulators = state.get("accumulators")
        if self._grads is not None and accumulators is not None:
            copy_into(self._grads, accumulators)
        elif self._grads is not None:
            for g in self._grads:
                g.zero_()
        self.tracker.set_epoch(int(state["epoch"]), int(state.get("samples", 0)))
        self._provenance = None
        self._mark_synced()
        self._report_unless_follower()

    def close(self) -> None:
        """Finish and apply a round still running in the background, agree on the
        parameters with the processes that stop now (``final_round``), and tell the swarm
        this process stopped (its progress record no longer counts); idempotent."""
        super().close()

    def _finish(self) -> None:
        try:
            if self.local_group is not None and self._executor is not None:
                self._land_on_every_rank()
            else:
                self._apply_pending(block=True)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ the state machine

    def _decide(self, progress: GlobalProgress | None = None) -> tuple[_Action, GlobalProgress]:
        """What this step leads to, from the swarm's progress after this step's report
        (``progress``: read with the report; None: read now)."""
        if progress is None:
            progress = self.tracker.refresh()
        if progress.epoch == self.epoch and not progress.ready:
            progress = self._wait_for_swarm(progress)
        if progress.epoch > self.epoch + 1:
            return _Action.CATCH_UP, progress
        if progress.epoch == self.epoch + 1:
            if progress.round_in_flight(self.epoch):
                # The others have just started the round of our epoch in the background
                # (delay_updates): join it late.
                return _Action.LATE, progress
            if progress.daemons_at(self.epoch) - {self.tracker.peer_id}:
                # Others were left at our epoch too (those ahead stepped without us, or
                # one of them alone): the round of our epoch is still ours to take.
                return _Action.LATE, progress.at_epoch(self.epoch)
            # Their round of our epoch is over and nobody else is left at it: a late round
            # would wait for nobody.
            return _Action.CATCH_UP, progress
        if progress.epoch < self.epoch:
            # Ahead of the swarm's majority (global steps taken alone; the tracker allows
            # for the others' reports' lag): back to its epoch.
            return _Action.CATCH_UP, progress
        if progress.ready:
            awaited = self._await_company(progress)
            if awaited is not progress:  # others came meanwhile: decide on what they say
                return self._decide()
            return _Action.GLOBAL, progress
        return _Action.NONE, progress

    def _act(self, action: _Action, progress: GlobalProgress) -> None:
        if action is _Action.CATCH_UP:
            self._catch_up(progress)
        elif action is _Action.LATE:
            self._global_step(progress, late=True)
        elif action is _Action.GLOBAL:
            self._global_step(progress)

    def _machine_step(self, samples: int) -> None:
        """Hierarchical mode, after this rank's local work: sum the machine's samples onto
        the leader's record, let the leader decide, and when the epoch ends, reduce the
        ranks' contributions onto the leader, which takes the global step; every rank then
        holds the leader's result (:meth:`_as_machine`)."""
        group = self.local_group
        assert group is not None
        self._machine_samples(samples)
        action, progress = _Action.NONE, self.tracker.last
        failure: Exception | None = None
        if group.is_leader:
            try:
                action, progress = self._decide(self.tracker.report_and_refresh())
            except Exception as exc:  # the followers learn of it through the broadcast
                failure = exc
        code = group.broadcast_int(
            _FAILED if failure is not None else action.value,
            timeout=group.timeout + self.max_wait,
        )
        if failure is not None:
            raise failure
        if code == _FAILED:
            raise LocalGroupError(
                f"the local leader (rank {group.leader}) failed reading the swarm's progress"
            )
        action = _Action(code)
        if action is _Action.NONE:
            return
        if action is not _Action.CATCH_UP:
            if self._grads is not None:
                self._sum_onto_leader(self._grads)
            else:
                self._weighted_mean_onto_leader(self.params)
        self._as_machine(lambda: self._act(action, progress))

    def _machine_state(self) -> dict[str, Any]:
        """The parameters; the optimizer's state in gradients mode (shared by the swarm)
        or when the leader loaded a state (parameters mode: each rank's own otherwise)."""
        share_optimizer = self._grads is not None or self._state_loaded
        self._landed_alone = False  # this envelope carries whatever the leader applied
        return {
            "params": [p.detach().cpu() for p in self.params],
            "optimizer": self.optimizer.state_dict() if share_optimizer else None,
        }

    def _take_machine_state(self, state: Mapping[str, Any]) -> None:
        super()._take_machine_state(state)
        if self._grads is not None and not self._landing:
            for g in self._grads:
                g.zero_()
        self._mark_synced()

    def _land_pending(self) -> None:
        """Apply a background round that finished (``delay_updates``), before this step's
        gradients are accumulated. In the hierarchical mode only the leader has the round:
        it tells its ranks whether one landed (a collective at every step), and then all
        of them take its result together, keeping the accumulators of the current epoch.
        """
        if self.local_group is None:
            self._apply_pending(block=False)
            return
        if self._executor is None:
            return  # nothing ever runs in the background: no collective needed
        group = self.local_group
        pending = self._pending
        landed = self._landed_alone or (pending is not None and pending.future.done())
        if group.broadcast_int(int(group.is_leader and landed)):
            self._land_on_every_rank()

    def _land_on_every_rank(self) -> None:
        """Hierarchical mode with ``delay_updates``: the leader applies its background
        round (if any) and every rank takes the leader's parameters and optimizer state."""
        self._landing = True
        try:
            self._as_machine(lambda: self._apply_pending(block=True))
        finally:
            self._landing = False
            self._landed_alone = False

    def _wait_for_swarm(self, progress: GlobalProgress) -> GlobalProgress:
        """Wait (briefly) for the others when they are about to complete the epoch.

        Without this, a process that checks just before the last report of an epoch arrives
        computes one more batch, and the global batch grows beyond ``target_batch_size``.
        It waits only after delivering its fair share (``target / processes``); it stops
        waiting when the epoch completes, when the others' throughput says they need longer
        than its own next batch (a fast peer then contributes more, as it should), or
        after ``max_wait`` seconds (a straggler or a dead peer whose record lingers).
        """
        if progress.num_processes <= 1 or self.max_wait == 0:
            return progress
        own_rate = self.tracker.meter.rate
        own_step = self._machine_batch / own_rate if own_rate > 0 else None
        poll = 0.01 if own_step is None else min(max(own_step / 4, 0.002), 0.05)
        deadline = time.monotonic() + self.max_wait
        while not progress.ready and progress.epoch == self.epoch:
            if self.tracker.samples < progress.target / progress.num_processes:
                break
            others = progress.samples_per_second - own_rate
            remaining = progress.target - progress.samples
            if own_step is not None and others > 0 and remaining / others > own_step:
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(poll)
            progress = self.tracker.refresh()
        return progress

    def _global_step(self, progress: GlobalProgress, *, late: bool = False) -> None:
        """Average and step for the current epoch.

        ``late``: the others have moved on already. The round runs in the foreground even
        with ``delay_updates``, and when it fails this process loads the swarm's state
        instead of stepping alone (a local step would leave it off the others' parameters).
        """
        epoch = self.epoch
        if len(progress.round_members(self.tracker.peer_id)) <= 1:
            # About to step alone: read once more, right before it. A newcomer may have
            # announced itself since (it loads this epoch's state and joins this round);
            # stepping past it now would leave it a step behind, waiting in a round that
            # this process never joins.
            fresh = self.tracker.refresh()
            if fresh.epoch == epoch:
                progress = fresh
        weight = float(self.tracker.samples) or ZERO_WEIGHT
        self.tracker.meter.pause()
        if self._grads is not None:
            key = f"grads.{epoch}"
            local = [(g / weight).cpu().numpy() for g in self._grads]
        else:
            key = f"params.{epoch}"
            local = to_arrays(self.params)
        if self._executor is not None and not late:
            self._apply_pending(block=True)
            digest = self._shared_digest()  # after the previous round was applied
            future = self._executor.submit(self._round, local, key, weight, progress, digest)
            self._pending = _PendingRound(epoch, local, digest, future, self._versions())
            self.tracker.inflight = epoch  # a member one epoch behind may still join it
            self._advance(epoch + 1, publish=False)
            return
        self._apply_pending(block=True)
        digest = self._shared_digest()
        result, error = self._round(local, key, weight, progress, digest)
        if result is None and (late or (error and self._others_moved_on())):
            self._catch_up(self.tracker.last)  # the swarm's progress, not a late view
            return
        if error:
            _warn_local_step(key, error)
        serve = self._finish_round(epoch, local, result, digest, key)
        self._advance(epoch + 1, publish=True, serve=serve)

    def _finish_round(
        self,
        epoch: int,
        local: list[np.ndarray],
        result: RoundResultLike | None,
        digest: bytes,
        key: str,
    ) -> bool:
        """Take the round of ``epoch`` into the state (which becomes that of ``epoch + 1``):
        the averaged update, the local one when the round failed, or, for a process whose
        state differs from the group's majority, the holders' post-step state.

        Returns:
            Whether members of the round repair from this process's post-step state (it
            then publishes that state at once).
        """
        if result is None:
            self._apply_update(local, epoch + 1)
            self._provenance = None
            return False
        verdict = self._judge(result, digest, key)
        if verdict.role is Role.REPAIR and self._grads is None:
            # Parameters mode: the round's average *is* the new shared state, the same on
            # every member of a complete round; taking it is the repair.
            self._apply_update(result.tensors, epoch + 1)
            self._provenance = None
            if result.partial:
                self.stats.repair_failures += 1
                self.stats.last_repair_error = "the round was partial"
            else:
                self.stats.repairs += 1
            log.warning(
                "round %s: this process's parameters differed from the majority's; the "
                "round's average replaces them%s",
                key,
                " (partial round: the next round tries again)" if result.partial else "",
            )
            return False
        if verdict.role is Role.REPAIR:
            state = self._repair(verdict, result, epoch + 1, key, self.params)
            if state is not None:
                self._take_state(state)
                self._take_provenance(state)
                return False
        self._apply_update(result.tensors, epoch + 1)
        self._step_provenance(
            epoch + 1, verdict, digest, str(result.group_id), partial=bool(result.partial)
        )
        return verdict.role is Role.SERVE and self._grads is not None

    def _apply_update(self, values: list[Any], epoch: int) -> None:
        """Gradients mode: step on ``values``; parameters mode: they are the parameters."""
        if self._grads is not None:
            self._apply_gradients(values)
        else:
            copy_into(self.params, values)
            self._mark_synced(epoch)

    def _take_state(self, state: TrainingState) -> None:
        """Parameters and optimizer state of a loaded state (the epoch is the caller's)."""
        self._state_loaded = True
        copy_into(self.params, state.params)
        if "optimizer" in state.optimizers:
            self.optimizer.load_state_dict(state.optimizers["optimizer"])

    def _mark_synced(self, epoch: int | None = None) -> None:
        """Parameters mode: remember the digest of the parameters as synchronised now."""
        if self._grads is None:
            self._synced = state_digest(self.params, {}, self.epoch if epoch is None else epoch)

    def _shared_digest(self) -> bytes:
        """Gradients mode: parameters, optimizer state and epoch, as they are before the
        step (identical on every member in step). Parameters mode: the parameters of the
        last synchronisation and the epoch (each member's local steps since then, and its
        optimizer state, are its own by design)."""
        if self._grads is None:
            return self._synced
        return state_digest(self.params, {"optimizer": self.optimizer.state_dict()}, self.epoch)

    def _state_id(self) -> bytes:
        """Parameters mode: the parameters are the round's only until the next local step."""
        if self._grads is None and self.tracker.samples:
            return b""
        return super()._state_id()

    def _take_final(self, tensors: Any) -> None:
        super()._take_final(tensors)
        self._mark_synced()

    def _others_moved_on(self) -> bool:
        """After a failed round: did the others step without us?

        Then this process takes their state (published right after their step) instead of
        stepping alone, which would leave it off the others' parameters for good.
        """
        return self.tracker.refresh().epoch > self.epoch

    def _round(
        self,
        arrays: list[np.ndarray],
        key: str,
        weight: float,
        progress: GlobalProgress,
        digest: bytes,
    ) -> tuple[RoundResultLike | None, str]:
        """One round: the result, or None and why it failed ("" when alone in the swarm).

        Runs in the background thread with ``delay_updates``: it only reads its arguments
        and the link (whose counters no other thread writes meanwhile).
        """
        expected, group_size = progress.members(), progress.num_peers
        if group_size <= 1:
            expected = progress.round_members(self.tracker.peer_id)
            group_size = len(expected)
        if group_size <= 1:
            log.debug("alone in the swarm at %s: stepping locally", key)
            return None, ""
        failed = self.link.stats.failed
        result = self.link.average(
            arrays,
            key=key,
            weight=weight,
            group_size=group_size,
            warn=False,
            state_digest=digest,
            expected=expected,
        )
        error = self.link.stats.last_error if self.link.stats.failed > failed else ""
        if result is None and progress.num_peers <= 1:
            # It waited for processes catching up (round_members) that did not come: do
            # not wait for them again until they report anew.
            self.link.no_shows.note(expected, [self.tracker.peer_id])
        return result, error

    def _apply_gradients(self, grads: list[Any]) -> None:
        """Step the wrapped optimizer on ``grads``. The caller's own ``.grad`` is put back
        afterwards: a delayed round lands at the start of a ``step()``, after the caller's
        backward, and that step's gradient is still to be accumulated."""
        import torch

        own = [p.grad for p in self.params]
        with torch.no_grad():
            for p, g in zip(self.params, grads, strict=True):
                source = g if isinstance(g, torch.Tensor) else torch.from_numpy(np.asarray(g))
                p.grad = source.to(device=p.device, dtype=p.dtype).reshape(p.shape).clone()
        try:
            self.optimizer.step()
        finally:
            for p, g in zip(self.params, own, strict=True):
                p.grad = g

    def _apply_pending(self, *, block: bool) -> None:
        pending = self._pending
        if pending is None or (not block and not pending.future.done()):
            return
        self._pending = None
        self.tracker.inflight = None
        if self.local_group is not None and not self._landing:
            self._landed_alone = True  # e.g. state_dict() on the leader alone
        result, error = pending.future.result()
        key = f"grads.{pending.epoch}"
        if error:
            _warn_local_step(key, error)
        moved = pending.versions != self._versions()
        serve = self._finish_round(pending.epoch, pending.local, result, pending.digest, key)
        if moved:
            self._exact_for = None  # stepped from parameters changed since the digest
        self._maybe_publish(pending.epoch + 1, serve=serve)

    def _advance(self, epoch: int, *, publish: bool, serve: bool = False) -> None:
        self.tracker.set_epoch(epoch)
        if self._grads is not None:
            for g in self._grads:
                g.zero_()
        if publish:
            self._maybe_publish(epoch, serve=serve)
        self.tracker.report()

    def _training_state(self, epoch: int) -> TrainingState:
        return TrainingState(
            kind=self.KIND,
            epoch=epoch,
            params=self.params,
            optimizers={"optimizer": self.optimizer.state_dict()},
        )

    def _catch_up(self, progress: GlobalProgress) -> None:
        """Off the swarm's epoch (behind it, or ahead of its majority): drop local work,
        load the newest state, continue at the swarm's epoch."""
        self.tracker.meter.pause()
        if self._pending is not None:
            self._pending.future.result()  # bounded by the round's timeout; superseded below
            self._pending = None
            self.tracker.inflight = None
        log.info("at epoch %d, the swarm is at %d: loading its state", self.epoch, progress.epoch)
        # A state older than the swarm's epoch (published a moment ago) is still the best
        # there is; continuing at the swarm's epoch avoids loading again at once.
        state, epoch = self._adopt_swarm_epoch(progress, self.params)
        self._provenance = None
        if state is not None:
            self._take_state(state)
            self._take_provenance(state)
        self._advance(epoch, publish=False)
        self._mark_synced()


def _warn_local_step(key: str, error: str) -> None:
    warnings.warn(
        f"averaging round {key!r} failed ({error}); stepping with local values",
        SwarmRoundWarning,
        stacklevel=4,
    )
