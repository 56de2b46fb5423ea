"""A PyTorch Lightning callback that trains through a swarm wrapper (extra ``lightning``).

Lightning builds the optimizer from ``configure_optimizers``; :class:`SwarmLightningCallback`
replaces it, once the strategy has set it up and before the first batch, with the wrapper
that ``wrap`` builds around it. The module's code stays as it is; learning-rate schedulers
keep working because a wrapper shares the local optimizer's ``param_groups``. The callback
logs the swarm's figures every batch and closes the wrapper when fitting ends (or fails), so
that no round of the others waits for this process.

A ``configure_optimizers`` that already returns a swarm wrapper needs no ``wrap``: the
callback then only logs and closes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from swarmavg.averaging.training.base import SwarmOptimizer
from swarmavg.averaging.training.integrations.extras import missing_extra
from swarmavg.averaging.training.integrations.metrics import swarm_metrics

try:
    import lightning.pytorch as pl
except ImportError as exc:  # the extra is optional
    raise missing_extra("lightning", "lightning") from exc

WrapOptimizer = Callable[[list[torch.nn.Parameter], torch.optim.Optimizer], SwarmOptimizer]
"""Builds the swarm wrapper from the parameters and the module's own optimizer, e.g.
``lambda params, opt: CollaborativeOptimizer(params, opt, client=..., run_id=..., ...)``."""


class SwarmLightningCallback(pl.Callback):
    """Steps a Lightning module's optimizer through a swarm wrapper.

    Args:
        wrap: builds the wrapper around the optimizer of ``configure_optimizers`` (None: that
            optimizer already is one).
        log_metrics: log ``swarm/epoch``, ``swarm/samples_per_second``, ... every batch.

    Use::

        trainer = lightning.Trainer(..., callbacks=[SwarmLightningCallback(
            lambda params, opt: CollaborativeOptimizer(params, opt, client=client,
                run_id="my-run", target_batch_size=256, batch_size_per_step=32))])
    """

    def __init__(self, wrap: WrapOptimizer | None = None, *, log_metrics: bool = True) -> None:
        self.wrap = wrap
        self.log_metrics = log_metrics
        self.optimizer: SwarmOptimizer | None = None
        """The wrapper Lightning steps (set when fitting starts)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Swap the strategy's optimizer for the wrapper.

        Raises:
            ValueError: not exactly one optimizer, or no ``wrap`` for one that is not a
                swarm wrapper.
        """
        optimizers = trainer.strategy.optimizers
        if len(optimizers) != 1:
            raise ValueError(
                f"SwarmLightningCallback supports one optimizer, configure_optimizers gave "
                f"{len(optimizers)}"
            )
        (local,) = optimizers
        if isinstance(local, SwarmOptimizer):
            self.optimizer = local
            return
        if self.wrap is None:
            raise ValueError(
                f"configure_optimizers returned a {type(local).__name__}, not a swarm "
                "wrapper: give SwarmLightningCallback a wrap function that builds one"
            )
        params = [p for group in local.param_groups for p in group["params"]]
        self.optimizer = self.wrap(params, local)
        # the setter also rebuilds Lightning's LightningOptimizer around the new object
        trainer.strategy.optimizers = [self.optimizer]

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Log the swarm's figures next to the module's own."""
        if self.log_metrics and self.optimizer is not None:
            pl_module.log_dict(swarm_metrics(self.optimizer), on_step=True, on_epoch=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the wrapper once fitting ends, normally or not."""
        if stage == "fit" and self.optimizer is not None:
            self.optimizer.close()


__all__ = ["SwarmLightningCallback", "WrapOptimizer"]
