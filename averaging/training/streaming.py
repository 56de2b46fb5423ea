"""Streaming DiLoCo: one fragment of the model at a time, overlapped with compute.

Douillard et al. 2025 ("Streaming DiLoCo with overlapping communication") split the model
into F fragments and sync fragment ``f`` at the inner steps ``t`` where
``(t + f * H / F) % H == 0``: every fragment still syncs once per H inner steps, but the
syncs are spread evenly over the H steps, so the peak bandwidth is 1/F of DiLoCo's, and
each sync runs while training goes on.

Here, sync ``e`` (the ``e``-th fragment sync of the run, which is what ``epoch`` counts)
covers fragment :func:`fragment_of_sync` ``(e, F)`` and starts after inner step
``(e + 1) * H / F``. Its round runs in a background thread (as
``CollaborativeOptimizer(delay_updates=True)`` runs its rounds) and its result is applied
``overlap_steps`` inner steps later, blocking then if the round is not done yet.

**Delayed update, local progress kept.** When sync ``e`` is applied, the fragment's
anchor takes the outer step on the averaged pseudo-gradient (exactly as in DiLoCo; every
member computes the same anchor), and the fragment's parameters become that anchor plus
the progress this member made during the ``overlap_steps`` steps of overlap. Nothing is
thrown away: that progress is part of the fragment's next pseudo-gradient. The paper's
alternative mixes the local and the global parameters (alpha = 0.5); the eager variant
(Kale et al. 2025) applies the member's own pseudo-gradient as a stand-in before the
average arrives. Both make the state a member carries depend on its own data in a way the
others cannot check, while the delayed update leaves the shared state (the anchor, the
outer optimizer state and the epoch: what the round digests compare) identical on every
member, so the shared-state repair, the late joiner's catch-up and the published states
work as for DiLoCo. Its cost is staleness of ``overlap_steps`` steps, small against H.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from swarmavg.averaging.run_records.progress import GlobalProgress
from swarmavg.averaging.signal_mask import leave_signals_to_main_thread
from swarmavg.averaging.training.consensus import Role, Verdict
from swarmavg.averaging.training.diloco import DiLoCo, pseudo_gradient
from swarmavg.averaging.training.fragments import (
    fragment_of_sync,
    fragment_outer_step,
    split_fragments,
)
from swarmavg.averaging.training.schedule import (
    DEFAULT_BOUNDS,
    DEFAULT_MARGIN,
    StreamingSchedule,
    check_bounds,
    streaming_schedule,
)
from swarmavg.averaging.training.state import TrainingState
from swarmavg.averaging.training.streaming_sync import PendingSync, RankSync, run_sync
from swarmavg.averaging.training.swarm import SwarmClient, SwarmRoundWarning
from swarmavg.averaging.training.tensors import collect_params, copy_into, to_arrays

if TYPE_CHECKING:
    import torch


class StreamingDiLoCo(DiLoCo):
    """DiLoCo that syncs one of ``fragments`` fragments every ``H / fragments`` inner
    steps, overlapped with the next ``overlap_steps`` inner steps (module docstring).

    Args:
        params, inner_optimizer, client, run_id, batch_size_per_step, outer_optimizer,
            codec, and the keyword options: as for :class:`DiLoCo` (any codec, 4-bit
            ``uint4-blockwise`` included; the outer optimizer steps only the synced
            fragment's tensors). With ``pace`` its target is the swarm's samples per
            fragment sync, and each member's inner steps between two syncs follow its
            speed; ``local_steps / fragments`` is then the first period only.
        local_steps: H, inner steps between two syncs of the same fragment; a multiple of
            ``fragments``. Or ``"auto"``: H and ``overlap_steps`` chosen from the measured
            inner step and round times so that each round ends within the steps it
            overlaps (:func:`~swarmavg.averaging.training.schedule.streaming_schedule`;
            every member must use ``"auto"`` then, and all of them pick the same).
        fragments: F, the number of fragments (contiguous groups of parameter tensors of
            about equal size).
        overlap_steps: inner steps a sync's round overlaps before its result is applied;
            at least 1 and less than ``H / F`` (ignored with ``"auto"``).
        local_steps_bounds: (lowest, highest) H for ``"auto"``.
        auto_margin: for ``"auto"``, overlap this many times the measured round.

    ``epoch`` counts fragment syncs (F per H inner steps). ``anchor`` holds the swarm's
    synchronised parameters; the model's own parameters are the anchor plus this
    member's progress since each fragment's last sync, so at any moment the members'
    anchors are identical and their parameters are not (evaluate ``anchor`` for the
    swarm's model).

    **Hierarchical mode** (``process_group=``, ``local_leader=``: docs/training.md): when
    a sync starts, the ranks average the fragment's parameters onto the leader (weighted by
    the samples each processed since the previous sync) and every rank continues from that
    mean; the leader's round runs in its background thread while all ranks train on, and
    ``overlap_steps`` steps later every rank takes the leader's new anchor and outer
    optimizer state and keeps its own progress of the overlap on top, as a single member
    does. Each rank's other fragments are its own between their syncs. ``state_dict()``
    there leaves a sync in flight out (applying it is a step of every rank together).

    Raises:
        ValueError: H not a multiple of F, too few tensors for F fragments, or
            ``overlap_steps`` out of range.
    """

    KIND = "streaming-diloco"
    PUBLISH_IN_BACKGROUND = True

    def __init__(
        self,
        params: Iterable[Any],
        inner_optimizer: torch.optim.Optimizer,
        client: SwarmClient | None,
        run_id: str,
        local_steps: int | Literal["auto"],
        batch_size_per_step: int = 1,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        codec: str | None = None,
        *,
        fragments: int = 4,
        overlap_steps: int = 1,
        local_steps_bounds: tuple[int, int] = DEFAULT_BOUNDS,
        auto_margin: float = DEFAULT_MARGIN,
        **options: Any,
    ) -> None:
        if not auto_margin > 0:
            raise ValueError(f"auto_margin must be positive, got {auto_margin}")
        self.auto_margin = float(auto_margin)
        auto = local_steps == "auto"
        if auto:
            # Nothing measured yet: the shortest schedule the bounds allow.
            first = streaming_schedule(
                0.0, fragments, margin=auto_margin, bounds=check_bounds(local_steps_bounds)
            )
            local_steps, overlap_steps = first.local_steps, first.overlap_steps
        elif isinstance(local_steps, str):
            raise ValueError(f"local_steps must be a positive int or 'auto', got {local_steps!r}")
        if fragments < 1 or local_steps <= 0 or local_steps % fragments:
            raise ValueError(
                f"local_steps ({local_steps}) must be a positive multiple of fragments "
                f"({fragments})"
            )
        period = local_steps // fragments
        if not 1 <= overlap_steps < period:
            raise ValueError(
                f"overlap_steps must be in [1, {period - 1}] (less than H / F = {period})"
            )
        tensors = collect_params(params)
        self.cycle_steps = local_steps
        self.overlap_steps = overlap_steps
        self.fragments = split_fragments([p.numel() for p in tensors], fragments)
        self._pending: PendingSync | None = None
        self._rank_sync: RankSync | None = None
        self._follower_sync: RankSync | None = None
        self._overlap: list[torch.Tensor] = []
        self._full_envelope = True
        """Hierarchical mode: the leader's next broadcast carries its whole state (the
        start, a catch-up, a repair), not only the synced fragment's."""
        self._sync_weight = 0
        """Hierarchical mode: this rank's samples since the last sync started."""
        self._executor = ThreadPoolExecutor(
            1, "swarmavg-stream", initializer=leave_signals_to_main_thread
        )
        try:
            # DiLoCo's bookkeeping counts one "outer step" per sync: H / F inner steps.
            super().__init__(
                tensors,
                inner_optimizer,
                client,
                run_id,
                local_steps="auto" if auto else period,
                batch_size_per_step=batch_size_per_step,
                outer_optimizer=outer_optimizer,
                codec=codec,
                local_steps_bounds=local_steps_bounds,
                **options,
            )
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        self._full_envelope = False

    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:
        """One inner step; applies a sync ``overlap_steps`` steps after it started, and
        starts the next one every ``H / F`` steps.

        Returns:
            The closure's loss, or None.
        """
        self._start_together()
        loss = self._run_closure(closure)
        samples = self._samples(batch_size)
        self.inner_optimizer.step()
        self._time_step()
        self.inner_steps += 1
        if self.local_group is not None:
            self._machine_step(samples)
        else:
            self.tracker.add_samples(samples)
            if self.pace is not None and not self._paced:
                self._plan_first_round()
            if self._pending is not None:
                self._pending.waited += 1
                if self._pending.waited >= self.overlap_steps:
                    self._apply_pending()
            if self._pending is None and self.inner_steps >= self.steps_this_round:
                self._start_sync()
            else:
                self.tracker.report_soon()  # as DiLoCo's inner steps: the step never waits on it
        self._log_progress()
        self.tracker.meter.start()
        self._last_step_end = time.monotonic()  # a wait for a round is not an inner step
        return loss

    # ------------------------------------------------------------ local_steps="auto"

    def _initial_local_steps(self) -> int:
        """DiLoCo's bookkeeping counts H / F inner steps per sync."""
        return self.cycle_steps // len(self.fragments)

    def _plan(self, ratio: float | None) -> None:
        if ratio is not None:
            self.agreed_ratio = ratio
            self._set_schedule(
                streaming_schedule(
                    ratio,
                    len(self.fragments),
                    margin=self.auto_margin,
                    bounds=self.local_steps_bounds,
                )
            )

    def _set_schedule(self, schedule: StreamingSchedule) -> None:
        self.cycle_steps = schedule.local_steps
        self.overlap_steps = schedule.overlap_steps
        self.local_steps = schedule.local_steps // len(self.fragments)
        self.steps_this_round = self.local_steps
        self.tracker.target_batch_size = self.local_steps * self.batch_size_per_step

    def _schedule_extra(self) -> dict[str, Any]:
        if not self.auto:
            return {}
        return {"local_steps": self.cycle_steps, "overlap_steps": self.overlap_steps}

    def _adopt_schedule(self, extra: dict[str, Any]) -> None:
        """The swarm's schedule from a loaded state, when it is a valid one."""
        h, overlap = extra.get("local_steps"), extra.get("overlap_steps")
        if not (self.auto and type(h) is int and type(overlap) is int):
            return
        low, high = self.local_steps_bounds
        f = len(self.fragments)
        if low <= h <= high and h % f == 0 and 1 <= overlap < h // f:
            self._set_schedule(StreamingSchedule(h, overlap))

    def state_dict(self) -> dict[str, Any]:
        """As for DiLoCo; a sync still in flight is applied first (early), except in the
        hierarchical mode, where applying it is a step of every rank together."""
        if self.local_group is None:
            self._apply_pending()
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As for DiLoCo; a sync in flight is waited for and dropped first (its thread reads
        the anchor that the checkpoint replaces, and its epoch is not the checkpoint's)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.exception()  # its outcome is dropped with it, failed or not
        super().load_state_dict(state)

    def _finish(self) -> None:
        try:
            if self.local_group is not None:
                if self._rank_sync is not None:  # every rank closes: land it together
                    self._land_machine_sync()
            else:
                self._apply_pending()
        finally:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------ hierarchical mode

    def _machine_step(self, samples: int) -> None:
        """After this rank's inner step: count the machine's samples, land a sync whose
        overlap is over and start the next one when due, all ranks together (their step
        counts agree: every sync's outcome reaches them from the leader)."""
        self._machine_samples(samples)
        self._sync_weight += samples
        sync = self._rank_sync
        if sync is not None:
            sync.waited += 1
            if sync.waited >= self.overlap_steps:
                self._land_machine_sync()
        if self._rank_sync is None and self.inner_steps >= self.steps_this_round:
            self._start_machine_sync()
        else:
            self._report_unless_follower()

    def _start_machine_sync(self) -> None:
        """Average the fragment due onto the leader (weighted by each rank's samples since
        the last sync), let the leader start its round (or catch up), and continue every
        rank from the leader's outcome."""
        group = self.local_group
        assert group is not None
        indices = self.fragments[fragment_of_sync(self.epoch, len(self.fragments))]
        self._mean_onto_leader([self.params[i] for i in indices], self._sync_weight)
        self._sync_weight = 0
        self._as_machine(self._leader_starts_sync)
        self._rank_sync = None
        pending = self._pending
        if group.is_leader and pending is not None:
            self._rank_sync = RankSync(pending.fragment, pending.start)
        elif not group.is_leader and self._follower_sync is not None:
            self._rank_sync = self._follower_sync
        self._follower_sync = None

    def _leader_starts_sync(self) -> None:
        self._full_envelope = False
        self._start_sync()

    def _land_machine_sync(self) -> None:
        """The leader applies its sync (waiting for its round if need be); every rank takes
        the new anchor and outer optimizer state and keeps its own overlap progress."""
        sync = self._rank_sync
        assert sync is not None
        import torch

        indices = self.fragments[sync.fragment]
        with torch.no_grad():
            self._overlap = [
                self.params[i].detach() - s for i, s in zip(indices, sync.start, strict=True)
            ]
        try:
            self._as_machine(self._leader_lands_sync)
        finally:
            self._rank_sync = None
            self._overlap = []

    def _leader_lands_sync(self) -> None:
        self._full_envelope = False
        self._apply_pending()

    def _catch_up(self, progress: GlobalProgress) -> None:
        super()._catch_up(progress)
        self._full_envelope = True  # every rank takes the loaded state whole

    def _take_synced(self, state: TrainingState) -> None:
        super()._take_synced(state)
        self._full_envelope = True

    def _state_id(self) -> bytes:
        """Each member's parameters carry its own progress since each fragment's sync."""
        return b""

    def _take_final(self, tensors: Any) -> None:
        super()._take_final(tensors)
        self._full_envelope = True  # every rank takes the final parameters whole

    def _mean_onto_leader(self, tensors: Sequence[torch.Tensor], weight: int) -> None:
        """Replace the leader's ``tensors`` with the mean of every rank's, weighted by
        ``weight`` (one reduction: the weights travel with the tensors)."""
        group = self.local_group
        assert group is not None
        import torch

        w = float(max(weight, 0))
        scaled = [t.detach().float() * w for t in tensors]
        summed = group.reduce_sum([*scaled, torch.tensor([w])])
        if summed is None:
            return
        total = float(summed[-1].reshape(-1)[0])
        if total > 0:
            copy_into(tensors, [s / total for s in summed[:-1]])

    def _machine_state(self) -> dict[str, Any]:
        """What the leader's ranks take after a sync starts or lands: its whole state when
        it loaded one (or at the start); otherwise the anchor, the outer optimizer's state,
        the schedule, and at a sync's start the fragment's (mean) parameters."""
        state = super()._machine_state()
        state["full"] = self._full_envelope
        state["schedule"] = (self.cycle_steps, self.overlap_steps, self.local_steps)
        pending = self._pending
        state["sync"] = None
        if pending is not None and pending.waited == 0:
            state["sync"] = (pending.fragment, [t.detach().cpu() for t in pending.start])
        if not self._full_envelope:
            del state["params"]
        return state

    def _take_machine_state(self, state: Mapping[str, Any]) -> None:
        cycle, overlap, local = state["schedule"]
        self.cycle_steps, self.overlap_steps, self.local_steps = cycle, overlap, local
        self.tracker.target_batch_size = self.local_steps * self.batch_size_per_step
        self._follower_sync = None
        if state["full"]:
            super()._take_machine_state(state)
            self._rank_sync = None
            return
        overlap_progress = self._overlap
        if state.get("optimizer") is not None:
            self.inner_optimizer.load_state_dict(state["optimizer"])
        copy_into(self.anchor, state["anchor"])
        self.outer_optimizer.load_state_dict(state["outer"])
        self.inner_steps = int(state["inner_steps"])
        self.steps_this_round = int(state["steps_this_round"])
        sync = state.get("sync")
        if sync is not None:  # a sync started: continue from the machine's mean
            fragment, start = sync
            indices = self.fragments[fragment]
            copy_into([self.params[i] for i in indices], start)
            self._follower_sync = RankSync(fragment, [t.clone() for t in start])
        elif overlap_progress and self._rank_sync is not None:
            # a sync landed: the new anchor plus this rank's own progress of the overlap
            import torch

            indices = self.fragments[self._rank_sync.fragment]
            with torch.no_grad():
                for i, moved in zip(indices, overlap_progress, strict=True):
                    self.params[i].copy_(self.anchor[i] + moved)

    # ------------------------------------------------------------------ one sync

    def _start_sync(self) -> None:
        """Snapshot the fragment due and hand its sync to the sync's thread
        (:func:`~swarmavg.averaging.training.streaming_sync.run_sync`: the progress read,
        the pseudo-gradient, the digest and the round all run there)."""
        epoch = self.epoch
        fragment = fragment_of_sync(epoch, len(self.fragments))
        indices = self.fragments[fragment]
        start = [self.params[i].detach().clone() for i in indices]
        anchor = [self.anchor[i] for i in indices]  # unchanged until this sync is applied
        samples = int(self.tracker.samples)
        reported = self.tracker.report_soon(latest=True)  # the samples it is weighed by
        future = self._executor.submit(
            run_sync,
            self.tracker,
            self.link,
            epoch,
            local=lambda: to_arrays(pseudo_gradient(anchor, start)),
            digest=self._shared_digest,
            with_schedule=self._with_schedule,
            weight=float(samples),
            reported=reported,
        )
        self._pending = PendingSync(epoch, fragment, start, future, samples)
        self.inner_steps = 0
        self.steps_this_round = self._round_steps(self.tracker.last)

    def _apply_pending(self) -> None:
        """Wait for the sync in flight (bounded by the round's deadline) and apply it."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        outcome = pending.future.result()
        result, error, seconds = outcome.result, outcome.error, outcome.seconds
        epoch, key = pending.epoch, f"diloco.{pending.epoch}"
        indices = self.fragments[pending.fragment]
        done = int(self.tracker.samples) - pending.samples  # samples during the overlap
        verdict: Verdict | None = None
        if outcome.behind or (result is None and error):
            after = self.tracker.refresh()
            if after.epoch != epoch:  # they stepped without us (or we ran ahead alone)
                self._catch_up(after)
                return
            warnings.warn(
                f"sync {epoch} failed ({error}); stepping with the local pseudo-gradient",
                SwarmRoundWarning,
                stacklevel=3,
            )
        averaged: list[Any] = []
        if result is not None:
            self.timer.add_round(seconds)
            averaged, ratio = self._split_schedule(result.tensors)
            if not result.partial:  # a partial round's pair may be this member's own
                self._plan(ratio)
            verdict = self._judge(result, outcome.digest, key)
        if result is not None and verdict is not None and verdict.role is Role.REPAIR:
            state = self._repair(verdict, result, epoch + 1, key, self.params)
            if state is not None:
                self._take_synced(state)
                self._take_provenance(state)
                self._advance_sync(epoch + 1, done, serve=False)
                return
        import torch

        with torch.no_grad():
            moved = [
                self.params[i].detach() - s for i, s in zip(indices, pending.start, strict=True)
            ]
        fragment_outer_step(
            self.params,
            self.anchor,
            indices,
            outcome.local if result is None else averaged,
            self.outer_optimizer,
        )
        with torch.no_grad():
            for i, m in zip(indices, moved, strict=True):
                self.params[i].add_(m)
        if result is None:
            self._provenance = None
        else:
            self._step_provenance(
                epoch + 1,
                verdict,
                outcome.digest,
                str(result.group_id),
                partial=bool(result.partial),
            )
        self._advance_sync(
            epoch + 1, done, serve=verdict is not None and verdict.role is Role.SERVE
        )

    def _advance_sync(self, epoch: int, samples: int, *, serve: bool) -> None:
        self.timer.reset_steps()
        self.tracker.set_epoch(epoch, samples)
        self._maybe_publish(epoch, serve=serve)  # in the background (PUBLISH_IN_BACKGROUND)
        self.tracker.report_soon(latest=True)  # the new epoch


__all__ = ["StreamingDiLoCo", "fragment_of_sync", "fragment_outer_step", "split_fragments"]
