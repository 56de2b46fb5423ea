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

from swarmavg.averaging.training.background import LatestWork
from swarmavg.averaging.training.consensus import Provenance, Role, Verdict, judge
from swarmavg.averaging.training.local_group import LocalGroup, LocalGroupError, outcome_timeout
from swarmavg.averaging.training.progress import GlobalProgress, ProgressTracker
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
    ) -> None:
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
        self._closed = False
        self._rank_samples = 0
        """Hierarchical mode: samples this rank processed since the last global step (its
        weight in the machine's contribution)."""
        self._provenance: Provenance | None = None
        """The round step that produced the current state (None: a local step, a restored
        checkpoint, ...); published with the state so that repairing members find it."""
        self._publisher = LatestWork("state publish")
        """``PUBLISH_IN_BACKGROUND``: the publishes in flight, newest last."""

    def _join_swarm(self, load_state_on_start: bool) -> None:
        """Catch up with a swarm past our epoch (if asked to), report, start the meter.

        Called by the subclass at the end of its ``__init__``, once :meth:`_catch_up` can
        run.
        """

        def join() -> None:
            if load_state_on_start:
                progress = self.tracker.refresh()
                if progress.epoch > self.epoch:
                    self._catch_up(progress)
            self.tracker.report()

        # Hierarchical mode: every rank starts from the leader's state (like DDP's first
        # broadcast), the one it loaded from the swarm if it caught up.
        self._as_machine(join)
        self.tracker.meter.start()

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

    def report_metrics(self, **metrics: float) -> None:
        """Attach user metrics (``loss=0.31, accuracy=0.9``) to this process's progress
        record: they go out with its next report and ``swarmavg peers`` shows them. Each
        call replaces the previous metrics; no arguments clears them.

        Raises:
            ValueError: more than 8 entries, a name outside ``[A-Za-z0-9_./-]{1,32}``, or a
                value that is not a finite number (a one-element tensor is taken).
        """
        self.tracker.set_metrics(metrics)

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
        """Finish the wrapper's own work (:meth:`_finish`) and tell the swarm this process
        stopped, so that no round waits for it; idempotent."""
        if self._closed:
            return
        try:
            self._finish()
        finally:
            self._closed = True
            # The last state published is the one a late joiner loads: let it land.
            self._publisher.close(timeout=self.link.state_timeout)
        self._leave()

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ for subclasses

    def _finish(self) -> None:
        """Work to complete before leaving the swarm on :meth:`close` (default: none)."""

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
        """``verbose=True``: write the progress line when it is due (after each step)."""
        if self._progress_log is not None:
            self._progress_log.update(self.epoch, *self._verbose_figures())

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
        self, epoch: int, verdict: Verdict | None, mine: bytes, group: str
    ) -> None:
        """Record that the state of ``epoch`` is the round step from the majority's state
        (``verdict`` None or REPAIR: a state no repairing member may take)."""
        if verdict is None or verdict.role is Role.REPAIR:
            self._provenance = None
        else:
            self._provenance = Provenance(epoch, verdict.majority or mine, group)

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

    def _load_swarm_state(self, params: list[torch.Tensor], behind: str) -> TrainingState | None:
        """The swarm's newest state of this wrapper's kind, shaped like ``params``; None,
        with a :class:`SwarmRoundWarning`, when none could be loaded.

        Args:
            params: the tensors the state's parameters must match.
            behind: how far behind this process is, for the warning (e.g.
                ``"epoch 3 < 5"``).
        """
        state = self.link.load(self.KIND, params)
        if state is None:
            warnings.warn(
                f"behind the swarm ({behind}) and no state could be loaded; continuing "
                "with local parameters",
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


def _group_of(result: RoundResultLike) -> str:
    group = getattr(result, "group_id", "")
    return group if isinstance(group, str) else ""


__all__ = ["SwarmOptimizer"]
