"""The framework integrations end to end: a real ``transformers.Trainer`` and a real
Lightning ``Trainer`` per peer, each peer behind its own ``swarmavg peer`` daemon.

Two trainers run in threads of the test; their wrappers average over the network. Each test
is skipped, saying which extra to install, when its framework is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import CollaborativeOptimizer  # noqa: E402
from swarmavg.peer import Client, connect  # noqa: E402
from tests.harness import ProcessPool  # noqa: E402
from tests.training import test_collaborative_daemons as daemons  # noqa: E402
from tests.training.helpers import run_in_threads  # noqa: E402

pytestmark = pytest.mark.integration
RUN = daemons.RUN
TARGET = 16  # samples per global step: the two peers' batches of 4, twice over
EPOCHS = 3  # each trainer stops once the swarm took this many global steps ...
STEPS = 40  # ... well before this many local steps


@pytest.fixture
def two_clients(swarmavg_processes: ProcessPool) -> Iterator[list[Client]]:
    with ExitStack() as stack:
        yield [
            stack.enter_context(connect(d.control))
            for d in daemons.start_daemons(swarmavg_processes, 2)
        ]


def collaborative(params: Any, local: torch.optim.Optimizer, client: Client) -> Any:
    return CollaborativeOptimizer(
        params,
        local,
        client=client,
        run_id=RUN,
        target_batch_size=TARGET,
        batch_size_per_step=4,
        codec="none",
        averaging_timeout=20.0,
        max_wait=10.0,
    )


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


# ---------------------------------------------------------------------- Hugging Face


def tiny_gpt2(seed: int) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=32,
        n_positions=8,
        n_embd=16,
        n_layer=1,
        n_head=2,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


class TokenRows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Seeded rows of 8 random tokens, each its own language-model label."""

    def __init__(self, seed: int, rows: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, 32, (rows, 8), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


@pytest.mark.timeout(90)
def test_two_hf_trainers_train_one_model_through_the_swarm(
    two_clients: list[Client], tmp_path: Path
) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="the hf extra is not installed: pip install 'swarmavg[hf]'"
    )
    from swarmavg.averaging.training.integrations.hf_trainer import SwarmTrainerCallback

    models = [tiny_gpt2(seed=0) for _ in two_clients]
    opts = [
        collaborative(m.parameters(), torch.optim.AdamW(m.parameters(), lr=1e-3), c)
        for m, c in zip(models, two_clients, strict=True)
    ]
    logs: list[list[dict[str, float]]] = [[], []]

    class Recorder(transformers.TrainerCallback):  # type: ignore[misc]
        """Sees the log records after the swarm callback, as a reporting callback would."""

        def __init__(self, into: list[dict[str, float]], opt: CollaborativeOptimizer) -> None:
            self.into = into
            self.opt = opt

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            self.into.append(dict(logs or {}))

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # stop right after a global step, as both peers take it: a peer that ran out of
            # batches mid-epoch would leave the other's last round without a partner
            control.should_training_stop = self.opt.epoch >= EPOCHS

    def trainer_of(i: int) -> Any:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"hf{i}"),
            per_device_train_batch_size=4,
            max_steps=STEPS,
            lr_scheduler_type="constant",  # the local step count differs between peers
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        return transformers.Trainer(
            model=models[i],
            args=args,
            train_dataset=TokenRows(seed=i, rows=4 * STEPS),
            optimizers=(opts[i], None),
            callbacks=[SwarmTrainerCallback(opts[i]), Recorder(logs[i], opts[i])],
        )

    # Built here, one after the other: a Trainer's accelerate GradientState is one state per
    # process whose first construction is not thread-safe (two Trainers built in two
    # threads at once failed with "'GradientState' object has no attribute
    # 'plugin_kwargs'"). Real trainers are processes of their own.
    trainers = [trainer_of(0), trainer_of(1)]
    run_in_threads(trainers[0].train, trainers[1].train, timeout=80)
    for opt, log in zip(opts, logs, strict=True):
        assert opt.epoch == EPOCHS
        assert opt.stats.group_sizes == [2] * EPOCHS  # global steps taken together
        assert log
        assert all("swarm/epoch" in r for r in log)
        assert log[-1]["swarm/epoch"] == opt.epoch
        with pytest.raises(RuntimeError, match="closed"):
            opt.step()  # the callback closed it when training ended
    assert opts[0].epoch == opts[1].epoch
    assert_same_parameters(*models)
    assert not all(
        torch.equal(p, q)
        for p, q in zip(models[0].parameters(), tiny_gpt2(0).parameters(), strict=True)
    )


def test_hf_callback_refuses_a_trainer_that_steps_another_optimizer(
    two_clients: list[Client], tmp_path: Path
) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="the hf extra is not installed: pip install 'swarmavg[hf]'"
    )
    from swarmavg.averaging.training.integrations.hf_trainer import SwarmTrainerCallback

    model = tiny_gpt2(seed=0)
    opt = collaborative(model.parameters(), torch.optim.SGD(model.parameters()), two_clients[0])
    with opt:
        trainer = transformers.Trainer(
            model=model,
            args=transformers.TrainingArguments(
                output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True
            ),
            train_dataset=TokenRows(seed=0, rows=8),
            callbacks=[SwarmTrainerCallback(opt)],  # but no optimizers=(opt, None)
        )
        with pytest.raises(ValueError, match=r"optimizers=\(opt, None\)"):
            trainer.train()


# ---------------------------------------------------------------------- Lightning


def mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def regression_batches(seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * STEPS, 3, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :2] * 2.0)
    return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")
# lightning 2.6 calls a torch pytree API that torch 2.13 deprecates (their code, not ours)
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning")
def test_two_lightning_trainers_train_one_model_through_the_swarm(
    two_clients: list[Client],
) -> None:
    pl = pytest.importorskip(
        "lightning.pytorch",
        reason="the lightning extra is not installed: pip install 'swarmavg[lightning]'",
    )
    from swarmavg.averaging.training.integrations.lightning_callback import (
        SwarmLightningCallback,
    )

    class Regression(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(seed=0)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            # stop right after a global step, as both peers take it (see the hf test)
            self.trainer.should_stop = self.trainer.optimizers[0].epoch >= EPOCHS

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1000)]

    modules = [Regression(), Regression()]
    callbacks = [
        SwarmLightningCallback(lambda params, opt, c=c: collaborative(params, opt, c))
        for c in two_clients
    ]

    def fit(i: int) -> None:
        trainer = pl.Trainer(
            max_steps=STEPS,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callbacks[i]],  # the one line a user adds
        )
        trainer.fit(modules[i], regression_batches(seed=i))

    run_in_threads(lambda: fit(0), lambda: fit(1), timeout=80)
    opts = [cb.optimizer for cb in callbacks]
    for opt in opts:
        assert isinstance(opt, CollaborativeOptimizer)
        assert opt.epoch == EPOCHS
        assert opt.stats.group_sizes == [2] * EPOCHS
        with pytest.raises(RuntimeError, match="closed"):
            opt.step()
    assert opts[0].epoch == opts[1].epoch  # type: ignore[union-attr]
    assert_same_parameters(modules[0], modules[1])
    assert not all(
        torch.equal(p, q)
        for p, q in zip(modules[0].net.parameters(), mlp(0).parameters(), strict=True)
    )
