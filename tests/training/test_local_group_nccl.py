"""The hierarchical mode's collectives on NCCL: runs where there is a CUDA device
and NCCL, skipped elsewhere (the project's CI machines have no GPU).

NCCL moves CUDA tensors only and refuses CPU ones even in a group of one rank, so a group
of this process alone on its current device is enough to show that every collective the
wrappers use (the sample counts, the reductions, the broadcasts of the leader's decision
and state) runs on the device, and that a wrapper over a model on the GPU steps through them.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from swarmavg.averaging.optim import CollaborativeOptimizer  # noqa: E402
from swarmavg.averaging.training.local_group import LocalGroup  # noqa: E402
from tests.training.memswarm import MemorySwarm  # noqa: E402

HAS_NCCL = (
    torch.cuda.is_available()
    and torch.cuda.device_count() >= 1
    and dist.is_available()
    and dist.is_nccl_available()
)
NO_NCCL = "needs a CUDA device and NCCL (none here)"
pytestmark = pytest.mark.timeout(120)
BACKENDS = [
    pytest.param("gloo", id="gloo-cpu"),  # the same test on the CPU: it runs everywhere
    pytest.param("nccl", id="nccl-cuda", marks=pytest.mark.skipif(not HAS_NCCL, reason=NO_NCCL)),
]


def one_rank_group(backend: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A group of this process alone; returns the device its tensors live on."""
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(0)
        device = "cuda"
    else:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(str(folder / "store"), 1)
    dist.init_process_group(
        backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    return device


@pytest.fixture
def nccl_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An NCCL group of this process alone, on CUDA device 0."""
    one_rank_group("nccl", tmp_path, monkeypatch)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not HAS_NCCL, reason=NO_NCCL)
def test_every_collective_runs_on_the_device(nccl_group: None) -> None:
    group = LocalGroup(timeout=30)
    assert group.sum_int(7) == 7
    assert group.broadcast_int(5) == 5
    tensors = [torch.ones(2, 3, device="cuda"), torch.arange(4.0, device="cuda")]
    summed = group.reduce_sum(tensors)
    assert summed is not None
    for got, want in zip(summed, tensors, strict=True):
        assert got.device == want.device
        assert torch.equal(got, want)
    cpu_input = [torch.full((3,), 2.0)]  # a CPU tensor is moved to the device and back
    back = group.reduce_sum(cpu_input)
    assert back is not None
    assert back[0].device.type == "cpu"
    assert torch.equal(back[0], cpu_input[0])
    payload = {"epoch": 3, "params": [torch.zeros(2, device="cuda")], "error": None}
    assert group.broadcast_object(payload) is payload


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wrapper_over_a_model_on_the_groups_device_steps_through_its_collectives(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = one_rank_group(backend, tmp_path, monkeypatch)
    try:
        wrapper_steps_on(device)
    finally:
        dist.destroy_process_group()


def wrapper_steps_on(device: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(device)
    opt = CollaborativeOptimizer(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        MemorySwarm().client("a"),
        "run",
        target_batch_size=8,
        batch_size_per_step=4,
        min_group_size=1,
        process_group="world",
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(4, 3, device=device), torch.randn(4, 2, device=device)
    for _ in range(2):  # the second step completes the epoch: a (lone) global step
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    assert opt.epoch == 1
    assert all(p.device.type == device for p in model.parameters())
    assert not torch.equal(before[0], next(model.parameters()).detach())
