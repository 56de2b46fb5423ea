"""DiLoCo: local inner steps, then one averaged outer step (Douillard et al. 2023).

Every process trains its replica with its own ("inner") optimizer for H steps. Then the
swarm averages the *pseudo-gradient* ``theta_sync - theta_local`` (parameters at the last
synchronisation minus the current ones, Algorithm 1 of the paper), and every process
resets its parameters to ``theta_sync`` and applies an outer optimizer to that averaged
pseudo-gradient. The paper's outer optimizer is SGD with Nesterov momentum, lr 0.7,
momentum 0.9 (section 3), the default here. Communication happens once per H steps, which
is why it needs orders of magnitude fewer bytes than averaging gradients every step.

:func:`pseudo_gradient` and :func:`outer_step` are the pure math (tested by hand
computation); :class:`DiLoCo` adds the swarm: progress records, the round, state sharing.
torch is imported inside functions only.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from swarmavg.averaging.run_records.progress import GlobalProgress
from swarmavg.averaging.training.base import SwarmOptimizer, resolve_run
from swarmavg.averaging.training.company_link import DEFAULT_START_TIMEOUT
from swarmavg.averaging.training.consensus import Role, Verdict
from swarmavg.averaging.training.digest import state_digest
from swarmavg.averaging.training.late_work import LateWork, late_work_fate, rebased
from swarmavg.averaging.training.left_out import await_swarm_step
from swarmavg.averaging.training.local_group import LocalGroup, resolve_local_group
from swarmavg.averaging.training.pace import SwarmPace, planned_steps, swarm_rate
from swarmavg.averaging.training.schedule import (
    DEFAULT_BOUNDS,
    DEFAULT_OVERHEAD,
    RoundTimer,
    check_bounds,
    diloco_local_steps,
    swarm_ratio,
)
from swarmavg.averaging.training.state import TrainingState
from swarmavg.averaging.training.swarm import SwarmClient, SwarmRoundWarning, swarm_errors
from swarmavg.averaging.training.tensors import copy_into, to_arrays

if TYPE_CHECKING:
    import torch
    import torch.distributed

log = logging.getLogger(__name__)

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


def pseudo_gradient(
    anchor: Sequence[torch.Tensor], current: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``anchor - current`` per tensor: how far the inner steps moved (paper, Algorithm 1)."""
    if len(anchor) != len(current):
        raise ValueError(f"{len(anchor)} anchor tensors but {len(current)} current ones")
    return [
        (a.detach() - c.detach().to(a.dtype)).float() for a, c in zip(anchor, current, strict=True)
    ]


def outer_step(
    params: Sequence[torch.Tensor],
    anchor: Sequence[torch.Tensor],
    delta: Sequence[Any],
    outer_optimizer: torch.optim.Optimizer,
) -> None:
    """Apply the outer optimizer to an (averaged) pseudo-gradient.

    The parameters are reset to ``anchor`` (the last synchronised values), ``delta`` is
    used as their gradient for one ``outer_optimizer.step()``, and ``anchor`` takes the
    result. ``.grad`` of every parameter is None afterwards.

    Args:
        params: the tensors ``outer_optimizer`` updates (the model's parameters).
        anchor: the parameters at the last synchronisation; updated in place.
        delta: the averaged pseudo-gradient (torch tensors or numpy arrays).
        outer_optimizer: an optimizer over ``params``.
    """
    import torch

    if not len(params) == len(anchor) == len(delta):
        raise ValueError("params, anchor and delta must have the same length")
    with torch.no_grad():
        for p, a, d in zip(params, anchor, delta, strict=True):
            p.copy_(a)
            source = d if isinstance(d, torch.Tensor) else torch.from_numpy(np.asarray(d))
            p.grad = source.to(device=p.device, dtype=p.dtype).reshape(p.shape).clone()
    outer_optimizer.step()
    with torch.no_grad():
        for p, a in zip(params, anchor, strict=True):
            p.grad = None
            a.copy_(p)


def default_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum, lr 0.7, momentum 0.9 (the paper's outer optimizer)."""
    import torch

    return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)


def sgd_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """Plain SGD, lr 1, no momentum: the outer step to pair with codec ``sparseloco``.

    SparseLoCo's error-feedback accumulator stands in for the outer momentum (it carries
    what earlier rounds did not send), so the outer step just applies the averaged,
    compressed pseudo-gradient: ``theta = theta_sync - mean(sent)``.
    """
    import torch

    return torch.optim.SGD(params, lr=1.0)


class DiLoCo(SwarmOptimizer):
    """Train with H local steps between averaged outer steps (DiLoCo).

    Args:
        params: the model's parameters (the same the inner optimizer trains).
        inner_optimizer: any ``torch.optim.Optimizer`` over them (the paper uses AdamW);
            its state stays local.
        client: a connected swarmavg client.
        run_id: the training run (None: the daemon's run id).
        local_steps: H, inner steps between two outer steps, or ``"auto"``: H chosen
            from the measured inner step and round times so that a round costs at most
            ``auto_overhead`` of the compute between two (module
            :mod:`~swarmavg.averaging.training.schedule`; every member must use
            ``"auto"`` then, and all of them pick the same H).
        batch_size_per_step: samples behind one ``step()`` (the round's weight is the
            samples since the last outer step).
        outer_optimizer: builds the outer optimizer from the parameter list (default:
            Nesterov SGD, lr 0.7, momentum 0.9).
        codec: codec for the pseudo-gradient rounds (None: the daemon's default).
        aggregation: how each round combines the members' tensors: ``"mean"``,
            ``"centered-clip"`` or ``"trimmed-mean"``, parameters in the name
            (docs/averaging.md, "Aggregation"); robust rules for runs that admit
            strangers. A wrong name raises ``ValueError`` here.
        local_steps_bounds: (lowest, highest) H for ``"auto"`` (the first outer step uses
            the lowest: nothing is measured yet).
        auto_overhead: for ``"auto"``, the share of compute a blocking round may cost.
        averaging_timeout, min_group_size, progress_ttl, publish_state_every,
        load_state_on_start, state_timeout, peer_id, verbose: as for
            ``CollaborativeOptimizer`` (``verbose``: the samples and the time to the outer
            step are this process's own inner steps).
        load_state_on_start, state_timeout, peer_id: as for ``CollaborativeOptimizer``.
        process_group, local_leader: the hierarchical mode, as for
            ``CollaborativeOptimizer``: at every outer step the ranks' parameters are
            averaged locally (weighted by their samples), the leader averages the
            machine's pseudo-gradient through the daemon, and every rank takes the
            leader's synchronised parameters and outer optimizer state (each rank keeps
            its own inner optimizer state, unless the leader loaded one from the swarm).
            ``batch_size_per_step`` stays per rank.
        final_round, final_timeout: as for ``CollaborativeOptimizer``: on ``close()``
            the processes that stop together average their current parameters (inner
            progress included), which become the parameters and the anchor of each.
        pace: the volunteer mode (docs/training.md, "Members of unequal speed"): an outer
            step comes when the swarm has processed ``pace.target_samples`` (or after
            ``pace.target_seconds`` of compute), each member running as many inner
            steps as its speed allows (:mod:`~swarmavg.averaging.training.pace`);
            ``local_steps`` is then only the first round's H, before any rate is
            measured. A member that missed outer steps merges or discards its work by
            :mod:`~swarmavg.averaging.training.late_work`. Not with ``"auto"`` nor a
            ``process_group``.
        min_peers, start_timeout: the start barrier, as for ``CollaborativeOptimizer``,
            but before the first *inner* step (docs/training.md, "Starting together"):
            members started apart then run their first inner steps together and take
            the first outer step as one group, from one anchor.

    ``epoch`` counts outer steps. A late joiner loads the last synchronised parameters, the
    outer optimizer's state and the epoch, then runs only the inner steps the swarm has left
    in the current outer step, so it reaches the round together with the others.
    """

    KIND = "diloco"

    def __init__(
        self,
        params: Iterable[Any],
        inner_optimizer: torch.optim.Optimizer,
        client: SwarmClient | None,
        run_id: str | None,
        local_steps: int | Literal["auto"],
        batch_size_per_step: int = 1,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        codec: str | None = None,
        *,
        local_steps_bounds: tuple[int, int] = DEFAULT_BOUNDS,
        auto_overhead: float = DEFAULT_OVERHEAD,
        aggregation: str = "mean",
        averaging_timeout: float = 60.0,
        min_group_size: int = 2,
        progress_ttl: float = 60.0,
        publish_state_every: int = 1,
        load_state_on_start: bool = True,
        state_timeout: float = 60.0,
        peer_id: str | None = None,
        verbose: bool = False,
        process_group: LocalGroup | torch.distributed.ProcessGroup | str | None = None,
        local_leader: int = 0,
        final_round: bool = True,
        final_timeout: float | None = None,
        pace: SwarmPace | None = None,
        min_peers: int = 1,
        start_timeout: float = DEFAULT_START_TIMEOUT,
    ) -> None:
        self.auto = local_steps == "auto"
        if pace is not None and (self.auto or process_group is not None):
            raise ValueError(
                "pace sets each member's inner steps itself: it takes neither "
                "local_steps='auto' nor a process_group"
            )
        self.pace = pace
        self._paced = False
        """Whether this round's inner steps were planned from measured rates (``pace``)."""
        self.local_steps_bounds = check_bounds(local_steps_bounds)
        if not auto_overhead > 0:
            raise ValueError(f"auto_overhead must be positive, got {auto_overhead}")
        self.auto_overhead = float(auto_overhead)
        if isinstance(local_steps, str):
            if not self.auto:
                raise ValueError(
                    f"local_steps must be a positive int or 'auto', got {local_steps!r}"
                )
            local_steps = self._initial_local_steps()
        if local_steps <= 0:
            raise ValueError(f"local_steps must be positive, got {local_steps}")
        self.timer = RoundTimer()
        self.agreed_ratio: float | None = None
        """The swarm's last agreed round-to-step time ratio (``"auto"``; None before)."""
        self._last_step_end: float | None = None
        local_group = resolve_local_group(process_group, local_leader)
        ranks = local_group.size if local_group is not None else 1
        run_id = resolve_run(client, run_id)
        super().__init__(
            params,
            inner_optimizer,
            client,
            run_id,
            progress_key=f"{run_id}.diloco",
            target_samples=local_steps * batch_size_per_step * ranks,
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
            min_peers=min_peers,
            start_timeout=start_timeout,
        )
        self.inner_optimizer = inner_optimizer
        self.local_steps = local_steps
        self.outer_optimizer = (outer_optimizer or default_outer_optimizer)(self.params)
        self.anchor = [p.detach().clone() for p in self.params]
        self.inner_steps = 0
        self.steps_this_round = local_steps
        self._join_swarm(load_state_on_start)
        if self.pace is not None:
            # The first interval would run from here to the end of the first step: the
            # user's set-up, data loading, a wait for others to start. A rate that small
            # makes every member plan the first round from a wrong speed; the first
            # rate is measured over the second step instead.
            self.tracker.meter.pause()

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        """One inner step; every H of them, the averaged outer step.

        Returns:
            The closure's loss, or None.
        """
        self._start_together()
        loss = self._run_closure(closure)
        samples = self._samples(batch_size)
        self.inner_optimizer.step()
        self._time_step()
        self.inner_steps += 1
        self._machine_samples(samples)
        if self.pace is not None and not self._paced:
            self._plan_first_round()
        if self.inner_steps >= self.steps_this_round:
            if self.local_group is not None:
                # Every rank reaches this together (the same inner_steps and
                # steps_this_round, from the leader's last broadcast): the machine's
                # replicas become their weighted mean on the leader, whose pseudo-gradient
                # is then the machine's.
                self._weighted_mean_onto_leader(self.params)
            self._as_machine(self._outer_sync)
        elif not self._follower:
            # Between syncs the record only feeds a late joiner's catch-up and the
            # throughput: stored in the background, the inner step never waits for the DHT.
            self.tracker.report_soon()
        self._log_progress()
        self.tracker.meter.start()
        self._last_step_end = time.monotonic()
        return loss

    def _verbose_figures(self) -> tuple[int, int, float, int, float]:
        """Each process runs its own inner steps: the samples are this process's towards
        its ``local_steps``, the time to the outer step its remaining steps at its own rate;
        the swarm's throughput is the one read at the last outer step."""
        samples = self.tracker.samples
        target = self.steps_this_round * self.batch_size_per_step
        own = self.tracker.meter.rate
        eta = max(target - samples, 0) / own if own > 0 else float("inf")
        p = self.tracker.last
        return samples, target, max(p.samples_per_second, own), max(p.num_peers, 1), eta

    # ------------------------------------------------------------ local_steps="auto"

    def _initial_local_steps(self) -> int:
        """H before anything is measured (``"auto"``): the lowest bound."""
        return self.local_steps_bounds[0]

    def _time_step(self) -> None:
        """One inner step's seconds: from the end of the last ``step()`` (after any sync)
        to the end of this one's inner update, so forward, backward and the update."""
        if self._last_step_end is not None:
            self.timer.add_step(time.monotonic() - self._last_step_end)

    def _with_schedule(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """``arrays`` plus the two one-element tensors that carry this member's measured
        ratio (``"auto"`` only; module :mod:`~swarmavg.averaging.training.schedule`)."""
        if not self.auto:
            return arrays
        weighted, known = self.timer.ratio_pair()
        return [*arrays, np.array([weighted], np.float32), np.array([known], np.float32)]

    def _split_schedule(self, tensors: Sequence[Any]) -> tuple[list[Any], float | None]:
        """A round's tensors without the schedule pair, and the swarm's ratio (None: not
        ``"auto"``, or no member had measured one)."""
        if not self.auto:
            return list(tensors), None
        *rest, weighted, known = tensors
        ratio = swarm_ratio(
            float(np.asarray(weighted).reshape(-1)[0]), float(np.asarray(known).reshape(-1)[0])
        )
        return rest, ratio

    def _plan(self, ratio: float | None) -> None:
        """Take the H the swarm's ratio asks for (the same on every member)."""
        if ratio is not None:
            self.agreed_ratio = ratio
            self.local_steps = diloco_local_steps(
                ratio, overhead=self.auto_overhead, bounds=self.local_steps_bounds
            )
            self.tracker.target_batch_size = self.local_steps * self.batch_size_per_step

    def _schedule_extra(self) -> dict[str, Any]:
        """The schedule a published state or checkpoint carries (``"auto"`` only)."""
        return {"local_steps": self.local_steps} if self.auto else {}

    def _adopt_schedule(self, extra: dict[str, Any]) -> None:
        """Continue with the schedule of a loaded state (the swarm's H)."""
        h = extra.get("local_steps")
        if self.auto and isinstance(h, int) and not isinstance(h, bool):
            low, high = self.local_steps_bounds
            self.local_steps = max(low, min(high, h))
            self.tracker.target_batch_size = self.local_steps * self.batch_size_per_step

    def state_dict(self) -> dict[str, Any]:
        """Epoch, inner progress, anchor, and both optimizers' states (a checkpoint)."""
        return {
            "kind": self.KIND,
            "epoch": self.epoch,
            "inner_steps": self.inner_steps,
            "samples": self.tracker.samples,
            "anchor": [a.clone() for a in self.anchor],
            "outer": self.outer_optimizer.state_dict(),
            "inner": self.inner_optimizer.state_dict(),
            **self._schedule_extra(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._check_kind(state, "state")
        copy_into(self.anchor, state["anchor"])
        self.outer_optimizer.load_state_dict(state["outer"])
        self.inner_optimizer.load_state_dict(state["inner"])
        self.inner_steps = int(state["inner_steps"])
        self._adopt_schedule(state)
        self.steps_this_round = self.local_steps
        self.tracker.set_epoch(int(state["epoch"]), int(state.get("samples", 0)))
        self._provenance = None
        self._report_unless_follower()

    def _outer_sync(self) -> None:
        progress = self.tracker.report_and_refresh()
        if progress.epoch != self.epoch:
            # Behind the swarm, or ahead of its majority (outer steps taken alone).
            self._catch_up(progress)
            return
        self.tracker.meter.pause()
        epoch = self.epoch
        key = f"diloco.{epoch}"
        delta = to_arrays(pseudo_gradient(self.anchor, self.params))
        digest = self._shared_digest()
        result = None
        averaged: list[Any] = []
        verdict: Verdict | None = None
        expected = progress.round_members(self.tracker.peer_id)
        if len(expected) > 1:
            left_out = self.link.stats.left_out
            started = time.monotonic()
            result = self.link.average(
                self._with_schedule(delta),
                key=key,
                weight=float(self.tracker.samples),
                group_size=len(expected),
                warn=False,
                state_digest=digest,
                expected=expected,
            )
            if result is None and len(expected) > progress.num_peers:
                # it waited for processes catching up that did not come (round_members)
                self.link.no_shows.note(expected, [self.tracker.peer_id])
            if result is None:
                after = self.tracker.refresh()
                if after.epoch == epoch and self.link.stats.left_out > left_out:
                    # their round closed without us and is still running (left_out)
                    after = await_swarm_step(self.tracker, epoch, self.link.timeout)
                if after.epoch != epoch:  # they stepped without us: take their state
                    self._catch_up(after)
                    return
                warnings.warn(
                    f"outer step {epoch} failed ({self.link.stats.last_error}); "
                    "stepping with the local pseudo-gradient",
                    SwarmRoundWarning,
                    stacklevel=3,
                )
            else:
                self.timer.add_round(time.monotonic() - started)
                averaged, ratio = self._split_schedule(result.tensors)
                if not result.partial:  # a partial round's pair may be this member's own
                    self._plan(ratio)
                verdict = self._judge(result, digest, key)
        if result is not None and verdict is not None and verdict.role is Role.REPAIR:
            state = self._repair(verdict, result, epoch + 1, key, self.params)
            if state is not None:
                self._take_synced(state)
                self._take_provenance(state)
                self._next_outer_step(epoch + 1, serve=False)
                return
        outer_step(
            self.params,
            self.anchor,
            delta if result is None else averaged,
            self.outer_optimizer,
        )
        if result is None:
            self._provenance = None
        else:
            self._step_provenance(
                epoch + 1, verdict, digest, str(result.group_id), partial=bool(result.partial)
            )
        serve = verdict is not None and verdict.role is Role.SERVE
        self._next_outer_step(epoch + 1, serve=serve)

    def _next_outer_step(self, epoch: int, *, serve: bool) -> None:
        self.timer.reset_steps()
        self.inner_steps = 0
        self.tracker.set_epoch(epoch)
        self.steps_this_round = self._round_steps(self.tracker.last)
        self._maybe_publish(epoch, serve=serve)
        self.tracker.report()

    # ------------------------------------------------------------ pace (unequal speeds)

    def _round_steps(self, progress: GlobalProgress, done: int = 0) -> int:
        """Inner steps of the round starting now: ``local_steps``, or with a ``pace``
        this member's share of the swarm's target at the rates ``progress`` read (``done``:
        samples the swarm already has in this round)."""
        if self.pace is None:
            return self.local_steps
        own = self.tracker.meter.rate
        others = [
            p.samples_per_second
            for p in progress.peers
            if p.peer_id != self.tracker.peer_id and p.epoch >= self.epoch - 1 and not p.left
        ]
        self._paced = own > 0
        return planned_steps(
            self.pace,
            own,
            swarm_rate(own, others),
            self._machine_batch,
            fallback=self.local_steps,
            done=done,
        )

    def _plan_first_round(self) -> None:
        """The first round (or one after a catch-up with no rate yet) starts on
        ``local_steps``: once this member's rate is measured, read the others' once and
        plan what is left of the round, so no member's first sync waits for the slowest."""
        if self.tracker.meter.rate <= 0:
            return
        try:
            progress = self.tracker.refresh()
        except swarm_errors() as exc:  # planning is an optimisation: keep local_steps
            log.info("could not read the swarm's progress to plan the round: %s", exc)
            self._paced = True
            return
        elapsed = self.inner_steps * self._machine_batch
        others = sum(
            p.samples
            for p in progress.peers
            if p.epoch == self.epoch and p.peer_id != self.tracker.peer_id
        )
        left = self._round_steps(progress, done=elapsed + others)
        self._paced = True
        self.steps_this_round = self.inner_steps + left

    def _machine_state(self) -> dict[str, Any]:
        """The synchronised parameters, the outer optimizer's state and where the next
        outer step is; the inner optimizer's state when the leader loaded one."""
        return {
            "params": [p.detach().cpu() for p in self.params],
            "anchor": [a.detach().cpu() for a in self.anchor],
            "outer": self.outer_optimizer.state_dict(),
            "optimizer": self.inner_optimizer.state_dict() if self._state_loaded else None,
            "inner_steps": self.inner_steps,
            "steps_this_round": self.steps_this_round,
        }

    def _take_machine_state(self, state: Mapping[str, Any]) -> None:
        super()._take_machine_state(state)
        copy_into(self.anchor, state["anchor"])
        self.outer_optimizer.load_state_dict(state["outer"])
        self.inner_steps = int(state["inner_steps"])
        self.steps_this_round = int(state["steps_this_round"])

    def _take_synced(self, state: TrainingState) -> None:
        """A repair: the majority's synchronised parameters and outer optimizer state.

        The inner optimizer's state is each member's own (it follows its own batches), so
        it is kept.
        """
        self._state_loaded = True
        copy_into(self.anchor, state.params)
        copy_into(self.params, state.params)
        if "outer" in state.optimizers:
            self.outer_optimizer.load_state_dict(state.optimizers["outer"])
        self._adopt_schedule(state.extra)

    def _state_id(self) -> bytes:
        """The parameters are the synchronised ones only until the next inner step."""
        return b"" if self.inner_steps else super()._state_id()

    def _take_final(self, tensors: Any) -> None:
        """The final round's mean becomes the parameters and the anchor."""
        super()._take_final(tensors)
        copy_into(self.anchor, [p.detach() for p in self.params])

    def _shared_digest(self) -> bytes:
        """The synchronised parameters (the anchor), the outer optimizer's state and the
        epoch: what every member holds identically between two outer steps."""
        return state_digest(self.anchor, {"outer": self.outer_optimizer.state_dict()}, self.epoch)

    def _training_state(self, epoch: int) -> TrainingState:
        return TrainingState(
            kind=self.KIND,
            epoch=epoch,
            params=self.anchor,
            optimizers={
                "outer": self.outer_optimizer.state_dict(),
                "inner": self.inner_optimizer.state_dict(),
            },
            extra=self._schedule_extra(),
        )

    def _catch_up(self, progress: GlobalProgress) -> None:
        """Load the swarm's last synchronised state and run only the inner steps left
        (behind the swarm, or ahead of its majority). With a ``pace``, work that missed
        few enough outer steps is carried onto the loaded anchor and counted in the next
        sync (:mod:`~swarmavg.averaging.training.late_work`)."""
        self.tracker.meter.pause()
        late_epoch = self.epoch
        # kept only where the work may be merged (two copies of the model otherwise spent)
        old_anchor = [a.detach().clone() for a in self.anchor] if self.pace else []
        late_params = [p.detach().clone() for p in self.params] if self.pace else []
        late_samples = self.tracker.samples
        state, epoch = self._adopt_swarm_epoch(progress, self.params)
        self._provenance = None
        fate = LateWork.DISCARD
        if self.pace is not None:
            fate = late_work_fate(late_epoch, epoch, late_samples, self.pace.max_staleness)
        merged = 0
        if state is not None:
            self._state_loaded = True
            copy_into(self.anchor, state.params)
            copy_into(self.params, state.params)
            if "outer" in state.optimizers:
                self.outer_optimizer.load_state_dict(state.optimizers["outer"])
            if fate is LateWork.MERGE:
                # its own inner optimizer state follows its own batches: kept, as the work
                copy_into(self.params, rebased(late_params, old_anchor, self.anchor))
                merged = late_samples
                self.stats.late_merges += 1
            elif "inner" in state.optimizers:
                self.inner_optimizer.load_state_dict(state.optimizers["inner"])
            self._adopt_schedule(state.extra)
            self._take_provenance(state)
        else:
            copy_into(self.anchor, [p.detach() for p in self.params])
        if fate is LateWork.DISCARD and self.pace is not None and late_samples:
            self.stats.late_discards += 1
        # Arrive at the round with the others: skip the inner steps they have already done.
        done = max(
            (
                p.samples
                for p in progress.peers
                if p.epoch == epoch and p.peer_id != self.tracker.peer_id
            ),
            default=0,
        )
        self.inner_steps = 0
        self.tracker.set_epoch(epoch, merged)
        if self.pace is None:
            self.steps_this_round = max(1, self.local_steps - done // self._machine_batch)
        else:
            swarm_done = merged + sum(
                p.samples
                for p in progress.peers
                if p.epoch == epoch and p.peer_id != self.tracker.peer_id
            )
            self.steps_this_round = self._round_steps(progress, done=swarm_done)
        self.tracker.report()
        self._last_step_end = None  # the download is not an inner step


__all__ = [
    "OUTER_LR",
    "OUTER_MOMENTUM",
    "DiLoCo",
    "default_outer_optimizer",
    "outer_step",
    "pseudo_gradient",
    "sgd_outer_optimizer",
]
