"""Streaming DiLoCo's network work off the step: the publishes, the sync's progress read.

What the background work guarantees (no daemon): a step never waits for a publish or for
the DHT read at a sync's start; publishes land in order, a newer one replaces one that
has not started, a failed one is logged and the next one lands; ``close()`` lets the last
one land within its deadline. The real-daemon runs are in test_streaming_faults.py and
test_modern_daemons.py.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.training.background import LatestWork  # noqa: E402
from swarmavg.averaging.training.state import unpack_state  # noqa: E402
from swarmavg.averaging.training.streaming import StreamingDiLoCo  # noqa: E402
from swarmavg.peer.client.errors import NoGroupError  # noqa: E402
from tests.training.helpers import linear_model, run_in_threads, train_until  # noqa: E402
from tests.training.memswarm import MemoryClient, MemorySwarm  # noqa: E402

WAIT = 10.0  # seconds an event may take before the test fails (never reached when it works)


# ------------------------------------------------------------------ LatestWork alone


@pytest.mark.timeout(30)
def test_a_newer_job_replaces_one_waiting_and_runs_after_the_one_running() -> None:
    work = LatestWork("test job")
    gate, entered = threading.Event(), threading.Event()
    done: list[str] = []

    def job(name: str) -> str:
        if name == "a":
            entered.set()
            assert gate.wait(WAIT)
        done.append(name)
        return name

    a = work.submit(job, "a")
    assert entered.wait(WAIT)
    b = work.submit(job, "b")  # waits behind a ...
    c = work.submit(job, "c")  # ... and is replaced by c before it starts
    assert b.cancelled()
    assert work.busy()
    gate.set()
    assert (a.result(WAIT), c.result(WAIT)) == ("a", "c")
    assert done == ["a", "c"]  # nothing older lands after the newest
    assert (work.submitted, work.dropped, work.failed) == (3, 1, 0)
    assert work.close(WAIT)
    with pytest.raises(RuntimeError, match="after close"):
        work.submit(job, "d")


@pytest.mark.timeout(30)
def test_a_dropped_job_lets_go_of_its_arguments_while_the_running_one_still_runs() -> None:
    # A publish's arguments are a copy of the whole state: a job replaced while the one
    # before it hangs must not keep its copy alive (the executor keeps a cancelled job in
    # its queue until the running one ends).
    work = LatestWork("test job")
    gate, entered = threading.Event(), threading.Event()

    class Snapshot:
        pass

    def job(snapshot: Snapshot | None) -> None:
        if snapshot is None:
            entered.set()
            assert gate.wait(WAIT)

    work.submit(job, None)
    assert entered.wait(WAIT)
    snapshots = [Snapshot() for _ in range(3)]
    alive = [weakref.ref(s) for s in snapshots]
    for snapshot in snapshots:
        work.submit(job, snapshot)
    del snapshot, snapshots
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True, False]  # the newest still waits
    assert work.dropped == 2
    gate.set()
    assert work.close(WAIT)
    gc.collect()
    assert alive[2]() is None  # and once it ran, nothing holds it either


@pytest.mark.timeout(30)
def test_a_failed_job_is_logged_and_the_next_one_runs(caplog: pytest.LogCaptureFixture) -> None:
    work = LatestWork("test job")

    def fail() -> None:
        raise RuntimeError("daemon gone")

    with caplog.at_level(logging.WARNING):
        assert work.submit(fail).result(WAIT) is None  # not raised at the caller
        assert work.submit(lambda: 7).result(WAIT) == 7
    assert "a background test job failed: RuntimeError: daemon gone" in caplog.text
    assert (work.failed, work.last_error) == (1, "RuntimeError: daemon gone")
    assert work.close(WAIT)


@pytest.mark.timeout(30)
def test_close_gives_up_on_a_stuck_job_at_its_deadline_and_drops_the_one_waiting() -> None:
    work = LatestWork("test job")
    gate, entered = threading.Event(), threading.Event()

    def stuck() -> None:
        entered.set()
        assert gate.wait(WAIT)

    work.submit(stuck)
    assert entered.wait(WAIT)
    waiting = work.submit(lambda: None)
    assert not work.close(0.0)  # the stuck job does not finish by the deadline
    assert waiting.cancelled()
    assert work.dropped == 1
    gate.set()
    assert work.close(WAIT)  # idempotent


# ------------------------------------------------------------------ the wrapper


class _GatedDHT:
    """The in-memory DHT, whose reads can be held (a slow DHT)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.read_gate = threading.Event()
        self.read_gate.set()
        self.reading = threading.Event()

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: Any = None) -> bool:
        return bool(self.inner.store(key, value, ttl, subkey))

    def get(self, key: str) -> Any:
        self.reading.set()
        assert self.read_gate.wait(WAIT), "the test never let the read through"
        return self.inner.get(key)


class _SlowClient(MemoryClient):
    """A client whose publishes and DHT reads wait for the test, and log the publishes."""

    def __init__(self, swarm: MemorySwarm, peer_id: str) -> None:
        super().__init__(swarm, peer_id)
        self.dht = _GatedDHT(self.dht)  # type: ignore[assignment]
        self.publish_gate = threading.Event()
        self.publish_gate.set()
        self.publishing = threading.Event()
        self.published: list[int] = []
        self.states: dict[int, tuple[Any, list[np.ndarray]]] = {}
        self.failures = 0  # the next publishes that fail

    def publish_state(self, tensors: Sequence[Any], metadata: Any) -> None:
        self.publishing.set()
        assert self.publish_gate.wait(WAIT), "the test never let the publish through"
        if self.failures:
            self.failures -= 1
            raise NoGroupError("daemon unreachable")
        super().publish_state(tensors, metadata)
        self.published.append(int(metadata["epoch"]))
        self.states[int(metadata["epoch"])] = (metadata, [np.array(t) for t in tensors])


def _alone(client: MemoryClient) -> tuple[torch.nn.Module, StreamingDiLoCo]:
    """One member (its rounds are local): H = 8, F = 2, so a sync starts every 4 steps
    and is applied 3 steps later."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = StreamingDiLoCo(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        client,
        "run",
        local_steps=8,
        fragments=2,
        overlap_steps=3,
        min_group_size=1,
    )
    return model, opt


def _step(model: torch.nn.Module, opt: StreamingDiLoCo) -> None:
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.timeout(60)
def test_a_sync_starts_without_waiting_for_the_dht_read_of_the_swarms_progress() -> None:
    client = _SlowClient(MemorySwarm(), "a")
    model, opt = _alone(client)
    for _ in range(3):
        _step(model, opt)
    client.dht.reading.clear()
    client.dht.read_gate.clear()  # the DHT stops answering reads
    _step(model, opt)  # step 4: sync 0 starts; its progress read hangs on its thread
    assert client.dht.reading.wait(WAIT)
    _step(model, opt)
    _step(model, opt)  # steps 5 and 6 train on during the overlap
    assert (opt.epoch, opt.inner_steps) == (0, 2)
    client.dht.read_gate.set()
    _step(model, opt)  # step 7: applied (the read and the local round are done)
    assert opt.epoch == 1
    opt.close()
    assert client.published == [1]


@pytest.mark.timeout(60)
def test_publishes_run_behind_the_steps_in_order_newest_last_and_close_lands_the_last() -> None:
    client = _SlowClient(MemorySwarm(), "a")
    model, opt = _alone(client)
    for _ in range(6):
        _step(model, opt)
    client.publish_gate.clear()  # the daemon stops taking states
    _step(model, opt)  # step 7: sync 0 applied; the state of epoch 1 goes out, and hangs
    assert client.publishing.wait(WAIT)
    anchor_1 = [a.clone() for a in opt.anchor]
    for _ in range(8):  # epochs 2 and 3: 2 waits behind 1, then 3 replaces it
        _step(model, opt)
    assert opt.epoch == 3
    assert client.published == []
    assert opt._publisher.dropped == 1
    client.publish_gate.set()
    opt.close()  # waits for the publishes left
    assert client.published == [1, 3]
    assert opt.stats.states_published == 2
    # The first publish carried the snapshot taken at its epoch, not the anchor it held
    # when the daemon took it (two syncs later).
    first = unpack_state(*client.states[1], kind=opt.KIND, like=opt.params)
    assert all(torch.equal(a, b) for a, b in zip(first.params, anchor_1, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first.params, opt.anchor, strict=True))


@pytest.mark.timeout(60)
def test_a_failed_publish_is_logged_and_the_next_one_replaces_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = _SlowClient(MemorySwarm(), "a")
    client.failures = 1
    model, opt = _alone(client)
    with caplog.at_level(logging.WARNING):
        for _ in range(7):  # sync 0 applied at step 7: its publish fails
            _step(model, opt)
        assert opt._publisher.settle(WAIT)
        assert "could not publish state" in caplog.text
        for _ in range(4):  # sync 1 applied at step 11: its publish lands
            _step(model, opt)
    opt.close()
    assert client.published == [2]
    assert opt.stats.states_published == 1


@pytest.mark.timeout(60)
def test_a_member_off_repairs_from_the_holders_whose_states_are_published_behind_the_steps() -> (
    None
):
    # The digest is taken on the sync's thread: it must still be of the state the round's
    # members share (anchor, outer optimizer state, epoch), so a member whose anchor
    # drifted is found, and repairs from the holders' background-published state.
    swarm = MemorySwarm()
    peers = []
    for name in "abc":
        model = linear_model()
        opt = StreamingDiLoCo(
            model.parameters(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            swarm.client(name),
            "run",
            local_steps=4,
            fragments=2,
            overlap_steps=1,
            batch_size_per_step=4,
            averaging_timeout=10.0,
            final_timeout=0.5,  # closers that stop one after another wait this
        )
        peers.append((model, opt))

    def train_all(epoch: int) -> None:
        run_in_threads(
            *(
                lambda m=m, o=o, i=i: train_until(m, o, 100 * i, epoch)
                for i, (m, o) in enumerate(peers)
            )
        )

    train_all(1)
    with torch.no_grad():
        for a in peers[2][1].anchor:
            a.add_(0.5)  # c's synchronised parameters drifted
    train_all(3)
    for _, o in peers:
        o.close()  # lets the last publishes land
    first = peers[0][1]
    for _, o in peers:
        assert o.epoch == first.epoch
        for x, y in zip(first.anchor, o.anchor, strict=True):
            assert torch.equal(x, y)
        mine, theirs = o.outer_optimizer.state_dict(), first.outer_optimizer.state_dict()
        for index, entry in theirs["state"].items():
            assert torch.equal(entry["momentum_buffer"], mine["state"][index]["momentum_buffer"])
    assert [o.stats.repairs for _, o in peers] == [0, 0, 1]
    assert [o.stats.served for _, o in peers] == [1, 1, 0]


def _blocked_signals(native_id: int) -> set[int]:
    """The signals a thread of this process blocks (its ``SigBlk`` mask)."""
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    mask = int(
        next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16
    )
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
@pytest.mark.timeout(60)
def test_the_background_threads_leave_ctrl_c_to_the_main_thread() -> None:
    """A Ctrl+C taken by one of the wrapper's threads would only set Python's flag, and a
    main thread blocked in a wait would never raise its KeyboardInterrupt: the threads
    block SIGINT and SIGTERM (and so do the threads they start, gRPC's among them)."""
    model, opt = _alone(MemorySwarm().client("a"))
    with opt:
        while opt.epoch < 1:  # the sync's thread, the publisher's and the progress reporter's
            _step(model, opt)
        ours = [t for t in threading.enumerate() if t.name.startswith("swarmavg-")]
        names = {t.name.rsplit("_", 1)[0] for t in ours}
        assert {"swarmavg-stream", "swarmavg-state-publish", "swarmavg-progress-report"} <= names
        for thread in ours:
            assert thread.native_id is not None
            assert {signal.SIGINT, signal.SIGTERM} <= _blocked_signals(thread.native_id), thread
    assert signal.SIGINT not in _blocked_signals(threading.get_native_id())
