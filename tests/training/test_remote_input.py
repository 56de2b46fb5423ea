"""Remote input never crashes training: what other peers put in the DHT or send
back makes a round fail or leaves that peer out, is logged, and ``step()`` goes on. Only
the caller's own bad input raises.

Against the in-memory swarm (the fault seam); the schema mismatch and forged records are
also run against real daemons in ``test_remote_input_daemons.py``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.group import MAX_GROUP_SIZE  # noqa: E402
from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo, SwarmRoundWarning  # noqa: E402
from swarmavg.averaging.run_records.progress import PeerProgress, aggregate  # noqa: E402
from swarmavg.peer.client.errors import AveragingError, SchemaMismatchError  # noqa: E402
from tests.training.helpers import backward, batch, linear_model, run_in_threads  # noqa: E402
from tests.training.memswarm import MemorySwarm  # noqa: E402

LR = 0.1


def collaborative(swarm: MemorySwarm, name: str, **kwargs: object) -> tuple[torch.nn.Module, Any]:
    model = linear_model()
    options: dict[str, object] = {"max_wait": 0.0, "averaging_timeout": 0.5}
    options.update(kwargs)
    return model, CollaborativeOptimizer(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        client=swarm.client(name),
        run_id="run",
        target_batch_size=8,
        batch_size_per_step=4,
        **options,  # type: ignore[arg-type]
    )


def diloco(swarm: MemorySwarm, name: str, **kwargs: object) -> tuple[torch.nn.Module, Any]:
    model = linear_model()
    options: dict[str, object] = {"averaging_timeout": 0.5}
    options.update(kwargs)
    return model, DiLoCo(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=LR),
        client=swarm.client(name),
        run_id="run",
        local_steps=2,
        batch_size_per_step=4,
        **options,  # type: ignore[arg-type]
    )


WRAPPERS: dict[str, tuple[Callable[..., tuple[torch.nn.Module, Any]], str]] = {
    "collaborative": (collaborative, "run.progress"),
    "diloco": (diloco, "run.diloco.progress"),
}


def steps(model: torch.nn.Module, opt: Any, n: int, seed: int = 0) -> None:
    for i in range(n):
        backward(model, batch(seed + i))
        opt.step()
        opt.zero_grad()


def record(peer: str, epoch: int = 0, samples: int = 0, **extra: object) -> dict[str, object]:
    return {
        "peer": peer,
        "epoch": epoch,
        "samples": samples,
        "sps": 1.0,
        "time": time.time(),
    } | extra


def forge(swarm: MemorySwarm, key: str, records: dict[object, object]) -> None:
    """Store ``records`` the way the DHT would accept them from their (hostile) owners: a
    progress subkey names its owner, ``[owner:<peer>]``, and the owner signs the entry. A
    record that names no peer goes under its subkey as given."""
    dht = swarm.client("forger").dht
    for subkey, value in records.items():
        peer = value.get("peer") if isinstance(value, dict) else None
        if isinstance(peer, str) and isinstance(subkey, str) and "[owner:" not in subkey:
            subkey = f"{subkey}[owner:{peer}]"
        dht.store(key, value, ttl=600, subkey=subkey)


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_more_progress_records_than_a_group_holds_clamp_the_round(wrapper: str) -> None:
    make, key = WRAPPERS[wrapper]
    swarm = MemorySwarm()
    model, opt = make(swarm, "a")
    # 257 forged peers at the current epoch: before, group_size 258 made step() raise
    forge(swarm, key, {f"f{i}.x": record(f"forged-{i:03d}") for i in range(MAX_GROUP_SIZE + 1)})
    with pytest.warns(SwarmRoundWarning):
        steps(model, opt, 4)
    assert opt.epoch >= 1
    sizes = [c[3] for c in swarm.calls]
    assert sizes
    assert all(s == MAX_GROUP_SIZE for s in sizes)


GARBAGE: dict[object, object] = {
    "not-a-dict": [1, 2, 3],
    "no-fields": {},
    "bool-epoch": record("x1", epoch=True),  # type: ignore[arg-type]
    "negative": record("x2", epoch=-1),
    "float-samples": record("x3", samples=1.5),  # type: ignore[arg-type]
    "nan-rate": record("x4") | {"sps": math.nan},
    "inf-time": record("x5") | {"time": math.inf},
    "huge-epoch": record("x6", epoch=2**60),
    "long-peer": record("p" * 1000),
    "left-not-bool": record("x7", left="yes"),
    "from-the-future": record("x8", samples=10**9) | {"time": time.time() + 10**6},
    "ok": record("x9"),  # the one well-formed, plausible record
    "impostor[owner:someone-else]": record("x12"),  # signed by one daemon, naming another
    7: record("x13"),  # a non-string subkey: it names no owner
    "huge-rate": record("x10") | {"sps": 1e308},
    "huge-rate-2": record("x11") | {"sps": 1e308},
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_malformed_and_implausible_records_are_ignored(wrapper: str) -> None:
    make, key = WRAPPERS[wrapper]
    swarm = MemorySwarm()
    model, opt = make(swarm, "a")
    forge(swarm, key, GARBAGE)
    progress = opt.tracker.refresh()
    # the one well-formed, plausible record under its owner's subkey counts
    assert sorted(p.peer_id for p in progress.peers) == sorted([opt.tracker.peer_id, "x9"])
    assert math.isfinite(progress.samples_per_second)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SwarmRoundWarning)  # rounds with the forgers fail
        steps(model, opt, 4)
    assert opt.epoch >= 1


def test_a_far_future_record_does_not_count() -> None:
    now = time.time()
    honest = PeerProgress("h", 3, 4, 1.0, now)
    future = PeerProgress("f", 9, 10**6, 1.0, now + 3600)
    progress = aggregate([honest, future], target=8, now=now)
    assert (progress.epoch, progress.samples, progress.num_peers) == (3, 4, 1)
    # a peer whose clock is a little ahead still counts
    slightly = PeerProgress("s", 3, 4, 1.0, now + 60)
    assert aggregate([honest, slightly], target=8, now=now).num_peers == 2


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize(
    "error",
    [
        SchemaMismatchError("peer(s) abc average tensors of another schema"),
        AveragingError("leader 00ff sent a bad group: the group lacks this peer"),
    ],
    ids=["schema-mismatch", "leader-bad-answer"],
)
def test_a_round_failed_by_another_peer_is_a_local_step(wrapper: str, error: Exception) -> None:
    make, key = WRAPPERS[wrapper]
    swarm = MemorySwarm()
    model, opt = make(swarm, "a")
    forge(swarm, key, {"b.1": record("b", samples=4)})
    round_key = "run.grads.0" if wrapper == "collaborative" else "run.diloco.0"
    swarm.raise_for[round_key] = error
    with pytest.warns(SwarmRoundWarning, match=type(error).__name__):
        steps(model, opt, 2)
    assert opt.epoch == 1
    assert opt.stats.failed == 1
    assert type(error).__name__ in opt.stats.last_error


def test_the_callers_own_bad_input_still_raises() -> None:
    swarm = MemorySwarm()
    model, opt = collaborative(swarm, "a")
    forge(swarm, "run.progress", {"b.1": record("b", samples=4)})
    backward(model, batch(0))
    for p in model.parameters():
        assert p.grad is not None
        p.grad.fill_(math.nan)
    with pytest.raises(ValueError, match="NaN"):
        opt.step()


def test_two_real_peers_and_forgers_still_average_together() -> None:
    swarm = MemorySwarm()
    peers = [collaborative(swarm, n, averaging_timeout=2.0) for n in "ab"]
    forge(swarm, "run.progress", {f"f{i}.x": record(f"forged-{i}") for i in range(300)})
    run_in_threads(*(lambda m=m, o=o: steps(m, o, 2) for m, o in peers))
    assert [o.epoch for _, o in peers] == [1, 1]
    assert [o.stats.group_sizes for _, o in peers] == [[2], [2]]
    for p, q in zip(peers[0][0].parameters(), peers[1][0].parameters(), strict=True):
        assert torch.equal(p, q)
