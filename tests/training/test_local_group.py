"""The hierarchical mode's arguments, checked at construction (one process, no daemon).

The behaviour across ranks and daemons is tested in test_hierarchical_daemons.py; here,
what a user gets wrong before any rank talks: no process group, a bad leader, options
the mode does not take, no client on the leader.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo, StreamingDiLoCo  # noqa: E402
from swarmavg.averaging.training.local_group import LocalGroup  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_rank_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A gloo group of this process alone (FileStore, loopback)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def model_and_sgd() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_without_an_initialised_group_the_error_says_what_to_call() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        LocalGroup()


def test_options_the_mode_does_not_take_are_refused() -> None:
    model, sgd = model_and_sgd()
    with pytest.raises(ValueError, match="'world'"):
        StreamingDiLoCo(
            model.parameters(), sgd, None, "run", local_steps=4, fragments=2, process_group="all"
        )
    with pytest.raises(ValueError, match="'world'"):
        DiLoCo(model.parameters(), sgd, None, "run", local_steps=2, process_group="everyone")


def test_a_leader_outside_the_group_and_a_leader_without_client(one_rank_group: None) -> None:
    model, sgd = model_and_sgd()
    with pytest.raises(ValueError, match="leader must be a rank"):
        LocalGroup(leader=1)
    with pytest.raises(ValueError, match="client is None"):
        CollaborativeOptimizer(model.parameters(), sgd, None, "run", 8, 4, process_group="world")


def test_the_collectives_of_a_one_rank_group(one_rank_group: None) -> None:
    group = LocalGroup(timeout=10)
    assert group.is_leader
    assert group.sum_int(7) == 7
    assert group.broadcast_int(5) == 5
    tensors = [torch.ones(2, 3), torch.arange(4.0)]
    summed = group.reduce_sum(tensors)
    assert summed is not None
    for a, b in zip(summed, tensors, strict=True):
        assert torch.equal(a, b)
    payload = {"epoch": 3, "params": [torch.zeros(2)], "error": None}
    assert group.broadcast_object(payload) is payload
