"""What every training wrapper shares: its link to the swarm, its progress, its lifecycle.

:class:`SwarmOptimizer` is the base of :class:`~swarmavg.averaging.training.collaborative.
CollaborativeOptimizer` and :class:`~swarmavg.averaging.training.diloco.DiLoCo`. It holds
the parts that do not depend on *what* a wrapper averages or *when*:

* the :class:`~swarmavg.averaging.training.swarm.SwarmLink` (rounds, state sharing,
  counters) and the :class:`~swarmavg.averaging.training.progress.ProgressTracker`;
* joining the swarm (a late joiner loads the newest state before its first step);
* the common part of ``step()`` (the closure, the batch size);
* publishing state every ``publish_state_every`` epochs, loading it when behind;
* ``close()`` (idempotent; withdraws the progress record), ``with`` support, checkpoint
  kinds.

A subclass builds its own fields after ``super().__init__`` and then calls
:meth:`_join_swarm`, which may already call its :meth:`_catch_up`. torch is imported
inside functions only (the daemon imports ``swarmavg.averaging`` and never loads torch).
"""

from __future__ import annotations

import logging
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from swarmavg.averaging.training.progress import GlobalProgress, ProgressTracker
from swarmavg.averaging.training.state import TrainingState
from swarmavg.averaging.training.swarm import (
    RoundStats,
    SwarmClient,
    SwarmLink,
    SwarmRoundWarning,
    swarm_errors,
)
from swarmavg.averaging.training.tensors import collect_params

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_W = TypeVar("_W", bound="SwarmOptimizer")


class SwarmOptimizer(ABC):
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
        codec, averaging_timeout, min_group_size, state_timeout: the rounds'
            settings (:class:`~swarmavg.averaging.training.swarm.SwarmLink`).
        progress_ttl: seconds a progress record lives in the DHT.
        publish_state_every: publish the state every this many epochs (0: never).
        peer_id: the daemon's peer id (read from ``client.status()`` when None).

    Raises:
        ValueError: a non-positive batch size or a negative ``publish_state_every``.
    """

    KIND: ClassVar[str]
    """Names the wrapper in its checkpoints and published states (a state of another kind
    is refused)."""

    def __init__(
        self,
        params: Iterable[Any],
        local_optimizer: torch.optim.Optimizer,
        client: SwarmClient,
        run_id: str,
        *,
        progress_key: str,
        target_samples: int,
        batch_size_per_step: int,
        codec: str | None,
        averaging_timeout: float,
        min_group_size: int,
        progress_ttl: float,
        publish_state_every: int,
        state_timeout: float,
        peer_id: str | None,
    ) -> None:
        if batch_size_per_step <= 0:
            raise ValueError(f"batch_size_per_step must be positive, got {batch_size_per_step}")
        if publish_state_every < 0:
            raise ValueError("publish_state_every must not be negative")
        self.params = collect_params(params)
        self.batch_size_per_step = batch_size_per_step
        self.publish_state_every = publish_state_every
        self._local_optimizer = local_optimizer
        self.link = SwarmLink(
            client,
            run_id,
            codec=codec,
            timeout=averaging_timeout,
            min_group_size=min_group_size,
            state_timeout=state_timeout,
        )
        self.tracker = ProgressTracker(
            client, progress_key, target_samples, ttl=progress_ttl, peer_id=peer_id
        )
        self._closed = False

    def _join_swarm(self, load_state_on_start: bool) -> None:
        """Catch up with a swarm past our epoch (if asked to), report, start the meter.

        Called by the subclass at the end of its ``__init__``, once :meth:`_catch_up` can
        run.
        """
        if load_state_on_start:
            progress = self.tracker.refresh()
            if progress.epoch > self.epoch:
                self._catch_up(progress)
        self.tracker.report()
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' ``.grad`` (what the wrapper accumulated is kept)."""
        self._local_optimizer.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Finish the wrapper's own work (:meth:`_finish`) and tell the swarm this process
        stopped, so that no round waits for it; idempotent."""
        if self._closed:
            return
        try:
            self._finish()
        finally:
            self._closed = True
        self._leave()

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ for subclasses

    def _finish(self) -> None:  # noqa: B027  (an optional hook, not an abstract method)
        """Work to complete before leaving the swarm on :meth:`close` (default: none)."""

    def _leave(self) -> None:
        """Withdraw from the swarm's progress so that nobody waits for this process."""
        try:
            self.tracker.leave()
        except swarm_errors() as exc:
            log.warning("could not withdraw the progress record: %s", exc)

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

    def _maybe_publish(self, epoch: int) -> None:
        """Publish the state of ``epoch`` when it is one of every ``publish_state_every``."""
        if self.publish_state_every and epoch % self.publish_state_every == 0:
            self.link.publish(self._training_state(epoch))

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

    @abstractmethod
    def _training_state(self, epoch: int) -> TrainingState:
        """What this wrapper publishes for ``epoch``."""

    @abstractmethod
    def _catch_up(self, progress: GlobalProgress) -> None:
        """Behind the swarm: take its newest state and continue at its epoch."""


__all__ = ["SwarmOptimizer"]
