"""A Hugging Face ``transformers.Trainer`` callback for a swarm wrapper (extra ``hf``).

The Trainer takes any ``torch.optim.Optimizer`` through ``optimizers=(optimizer,
scheduler)``; a :class:`~swarmavg.averaging.training.base.SwarmOptimizer` is one, so the
Trainer steps the swarm's wrapper as it would its own AdamW. :class:`SwarmTrainerCallback`
does the rest: it checks at the start that the Trainer really steps that wrapper (a
forgotten ``optimizers=`` would otherwise train alone, silently), adds the swarm's figures
to every log record, and closes the wrapper when training ends, so that no round of the
others waits for this process.
"""

from __future__ import annotations

import logging
from typing import Any

from swarmavg.averaging.training.base import SwarmOptimizer
from swarmavg.averaging.training.integrations.extras import missing_extra
from swarmavg.averaging.training.integrations.metrics import swarm_metrics

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # the extra is optional
    raise missing_extra("transformers", "hf") from exc

log = logging.getLogger(__name__)


class SwarmTrainerCallback(TrainerCallback):
    """Ties a ``transformers.Trainer`` to the swarm wrapper it steps.

    Args:
        optimizer: the wrapper, also given to the Trainer as ``optimizers=(optimizer, None)``.
        close_on_train_end: close the wrapper when ``train()`` ends (turn off to call
            ``train()`` again on the same wrapper).

    Use (a constant learning rate: the Trainer's default linear decay counts local steps,
    which differ between peers; docs/training.md)::

        args = TrainingArguments(..., lr_scheduler_type="constant")
        trainer = Trainer(model, args, train_dataset=data, optimizers=(opt, None),
                          callbacks=[SwarmTrainerCallback(opt)])
    """

    def __init__(self, optimizer: SwarmOptimizer, *, close_on_train_end: bool = True) -> None:
        if not isinstance(optimizer, SwarmOptimizer):
            raise TypeError(
                "SwarmTrainerCallback needs a swarm wrapper (CollaborativeOptimizer, DiLoCo, "
                f"...), got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.close_on_train_end = close_on_train_end

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Refuse a Trainer that steps another optimizer than the wrapper.

        Raises:
            ValueError: the Trainer's optimizer is not (a wrapper of) ``optimizer``.
        """
        stepped = kwargs.get("optimizer")
        # accelerate wraps the Trainer's optimizer in an AcceleratedOptimizer(.optimizer)
        for _ in range(8):  # a bounded unwrap: a chain of wrappers, never a cycle
            if stepped is None or stepped is self.optimizer:
                break
            stepped = getattr(stepped, "optimizer", None)
        if stepped is not self.optimizer:
            raise ValueError(
                "the Trainer does not step the swarm wrapper: pass it as "
                "Trainer(..., optimizers=(opt, None)) together with SwarmTrainerCallback(opt)"
            )
        schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
        if not schedule.startswith("constant"):
            log.warning(
                "the Trainer's lr_scheduler_type is %r: a schedule over local steps gives "
                "peers different learning rates at one global step (each such round repairs "
                "the differing peer); use lr_scheduler_type='constant' or a schedule driven by "
                "the wrapper's epoch",
                schedule,
            )

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the swarm's epoch, throughput, peers and round counts to the log record."""
        if logs is not None:
            logs.update(swarm_metrics(self.optimizer))

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Close the wrapper (when asked to): its last round finishes, the swarm stops
        counting this process."""
        if self.close_on_train_end:
            self.optimizer.close()


__all__ = ["SwarmTrainerCallback"]
