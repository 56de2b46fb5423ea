"""One swarm under real timing: the swarm's epoch, rejoining it, finishing a run.

Pure rules first (which epoch is the swarm's, when a trainer decides it is off it), then
trainers against the in-memory swarm (``memswarm.py``), started at different times, cut
off and far ahead, and closing together; the same with real daemons is in
``test_one_swarm_daemons.py``. Readiness is signalled by events, never by sleeps.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo  # noqa: E402
from swarmavg.averaging.run_records.progress import (  # noqa: E402
    MAX_EPOCH_LEAD,
    STATE_ID_BYTES,
    PeerProgress,
    aggregate,
    swarm_epoch,
    within_epoch_lead,
)
from swarmavg.averaging.training.collaborative import _Action  # noqa: E402
from swarmavg.averaging.training.swarm import group_room  # noqa: E402
from swarmavg.peer.client.errors import NoGroupError  # noqa: E402
from swarmavg.peer.client.run_view import REJOINS_METRIC, ThisPeer, build_view  # noqa: E402
from tests.training.helpers import (  # noqa: E402
    backward,
    batch,
    linear_model,
    run_in_threads,
    sgd_collaborative,
    train_until,
)
from tests.training.memswarm import MemoryClient, MemorySwarm  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def at(peer: str, epoch: int, *, left: bool = False, **fields: Any) -> PeerProgress:
    return PeerProgress(peer, epoch, 1, 1.0, time.time(), left=left, **fields)


def sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- the swarm's epoch (pure)


def test_the_swarms_epoch_is_the_majoritys_not_the_newest() -> None:
    # one trainer took steps alone before the others came: it is the one off the swarm
    records = [at("a", 60), at("b", 60), at("c", 61), at("alone", 100)]
    assert swarm_epoch(records) == 61
    progress = aggregate(records, target=8)
    assert progress.epoch == 61
    assert set(progress.members()) == {"a", "b", "c"}  # the one ahead is not a member
    # also within max_epoch_lead, where the others still read its record
    assert swarm_epoch([at("a", 60), at("b", 60), at("ahead", 60 + MAX_EPOCH_LEAD)]) == 60


def test_a_tie_goes_to_the_newest_epoch() -> None:
    assert swarm_epoch([at("newcomer", 0), at("veteran", 50)]) == 50
    assert swarm_epoch([at("a", 97), at("b", 100)]) == 100
    assert swarm_epoch([at("a", 5), at("b", 5), at("c", 9), at("d", 9)]) == 9


def test_members_one_step_behind_count_for_the_epoch_ahead() -> None:
    # right after a step, half of the members have not reported it yet
    assert swarm_epoch([at("a", 7), at("b", 7), at("c", 6), at("d", 6), at("e", 6)]) == 7
    # but two steps behind is another epoch
    assert swarm_epoch([at("a", 7), at("b", 5), at("c", 5)]) == 5


def test_a_daemon_counts_once_however_many_processes_it_runs() -> None:
    records = [at("a", 10), at("a", 10), at("a", 10), at("b", 3), at("c", 3)]
    assert swarm_epoch(records) == 3


def test_one_hostile_record_cannot_move_the_swarms_epoch() -> None:
    honest = [at("a", 5), at("b", 5), at("c", 6)]
    for lie in (6 + 2, 6 + MAX_EPOCH_LEAD, 2**50):
        kept, _ = within_epoch_lead([*honest, at("evil", lie)], own_epoch=5)
        assert aggregate([*kept], target=8).epoch == 6
        assert swarm_epoch([*honest, at("evil", lie)]) == 6
    # nor drag it back
    assert swarm_epoch([*honest, at("evil", 0)]) == 6


def test_goodbyes_give_the_epoch_only_to_a_reader_alone() -> None:
    finished = [at("x", 153, left=True), at("y", 153, left=True)]
    # a newcomer to a run whose trainers all left loads its state (and reads their records)
    kept, dropped = within_epoch_lead(finished, own_epoch=0)
    assert dropped == 0
    assert swarm_epoch([at("me", 0), *kept]) == 153
    # with live trainers, the goodbyes say nothing
    assert swarm_epoch([at("me", 0), at("z", 3), *finished]) == 3


def test_a_trainer_alone_at_the_epoch_expects_those_catching_up() -> None:
    progress = aggregate([at("me", 40), at("late", 12), at("later", 3)], target=8)
    assert progress.epoch == 40
    assert progress.num_peers == 1
    assert set(progress.round_members("me")) == {"me", "late", "later"}
    # not alone: the members only (a round does not wait for those catching up)
    progress = aggregate([at("me", 40), at("b", 40), at("late", 12)], target=8)
    assert set(progress.round_members("me")) == {"me", "b"}


def test_round_in_flight_is_read_from_the_records_ahead() -> None:
    progress = aggregate([at("a", 8, inflight=7), at("b", 8), at("me", 7)], target=8)
    assert progress.round_in_flight(7)
    assert not aggregate([at("a", 8), at("b", 8), at("me", 7)], target=8).round_in_flight(7)


def test_the_new_record_fields_are_optional_and_checked() -> None:
    record = at("a", 3, rejoins=2, state=b"s" * STATE_ID_BYTES, inflight=2, final=True)
    assert PeerProgress.from_record(record.to_record()) == record
    old = {"peer": "a", "epoch": 1, "samples": 0, "sps": 0.0, "time": 0.0}
    parsed = PeerProgress.from_record(old)
    assert parsed is not None
    assert (parsed.rejoins, parsed.state, parsed.inflight, parsed.final) == (0, b"", None, False)
    for bad in (
        {"rejoins": -1},
        {"rejoins": True},
        {"state": "text"},
        {"state": b"x" * (STATE_ID_BYTES + 1)},
        {"inflight": -3},
        {"inflight": 1.5},
        {"final": 1},
    ):
        assert PeerProgress.from_record({**old, **bad}) is None, bad


def test_the_peers_view_shows_rejoins() -> None:
    records = [at("aa", 5, rejoins=1), at("aa", 5, rejoins=2), at("bb", 5)]
    view = build_view("r", ThisPeer("aa", None), [], {"collaborative": records}, time.time())
    rows = {r.peer_id: r for r in view.peers}
    assert dict(rows["aa"].metrics) == {REJOINS_METRIC: 3.0}
    assert dict(rows["bb"].metrics) == {}


# ---------------------------------------------------------------- when a trainer is off it


def make_peer(
    swarm: MemorySwarm, name: str, client: Any = None, **kwargs: Any
) -> tuple[torch.nn.Module, CollaborativeOptimizer]:
    model = linear_model()
    options: dict[str, Any] = {"averaging_timeout": 5.0, "max_wait": 0.0, **kwargs}
    opt = sgd_collaborative(
        model, client or swarm.client(name), run_id="run", target_batch_size=12, **options
    )
    return model, opt


def put(swarm: MemorySwarm, record: PeerProgress) -> None:
    """A record of another process (its own subkey, owned by its daemon)."""
    subkey = f"{len(swarm.dht.get('run.progress', {}))}x[owner:{record.peer_id}]"
    swarm.client(record.peer_id).dht.store("run.progress", record.to_record(), 30.0, subkey)


@pytest.mark.parametrize(
    ("others", "own", "action"),
    [
        ([("b", 5), ("c", 5)], 5, _Action.NONE),
        ([("b", 5), ("c", 5)], 14, _Action.CATCH_UP),  # ran ahead: back to the swarm's epoch
        ([("b", 5), ("c", 5)], 7, _Action.CATCH_UP),  # within max_epoch_lead too
        ([("b", 5), ("c", 5)], 2, _Action.CATCH_UP),  # behind
        ([("b", 5), ("c", 5)], 4, _Action.CATCH_UP),  # their round of epoch 4 is over
        ([("b", 5), ("c", 4)], 4, _Action.LATE),  # c was left at 4 too: their round
        ([("b", 5), ("c", 4)], 5, _Action.NONE),  # in step: c has not reported its step
        ([("b", 5), ("c", 5)], 6, _Action.NONE),  # this one stepped first
        ([("b", 4), ("c", 4), ("d", 4)], 6, _Action.CATCH_UP),  # two steps alone
    ],
)
def test_when_a_trainer_decides_it_is_off_the_swarms_epoch(
    others: list[tuple[str, int]], own: int, action: _Action
) -> None:
    swarm = MemorySwarm()
    _, opt = make_peer(swarm, "a", final_round=False)  # the others are only records
    for peer, epoch in others:
        put(swarm, at(peer, epoch))
    opt.tracker.set_epoch(own)
    assert opt._decide()[0] is action
    opt.close()


def test_one_epoch_behind_joins_a_round_still_in_flight() -> None:
    swarm = MemorySwarm()
    _, opt = make_peer(swarm, "a", final_round=False)
    put(swarm, at("b", 5, inflight=4))
    put(swarm, at("c", 5, inflight=4))
    opt.tracker.set_epoch(4)
    action, progress = opt._decide()
    assert action is _Action.LATE
    assert set(progress.members()) == {"a", "b", "c"}  # the round the others run
    opt.close()


def test_a_round_in_flight_allows_one_more_epoch_ahead() -> None:
    swarm = MemorySwarm()
    _, opt = make_peer(swarm, "a", final_round=False)
    put(swarm, at("b", 4))
    put(swarm, at("c", 4))
    opt.tracker.set_epoch(6)
    opt.tracker.inflight = 5  # delay_updates: its round of epoch 5 still runs
    assert opt._decide()[0] is _Action.NONE
    opt.tracker.inflight = None
    assert opt._decide()[0] is _Action.CATCH_UP
    opt.close()


# ---------------------------------------------------------------- trainers out of step


class CutClient:
    """A client of the in-memory swarm that, while ``cut`` is set, reads only its own
    daemon's progress records and whose rounds fail: a trainer cut off from the others."""

    def __init__(self, client: MemoryClient, cut: threading.Event) -> None:
        self._client, self.cut = client, cut
        self.dht = self

    def get(self, key: str) -> Any:
        value = self._client.dht.get(key)
        if not self.cut.is_set() or not isinstance(value, dict):
            return value
        own = f"[owner:{self._client.peer_id}]"
        return {k: v for k, v in value.items() if str(k).endswith(own)}

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: Any = None) -> bool:
        return self._client.dht.store(key, value, ttl, subkey)

    def average(self, *args: Any, **kwargs: Any) -> Any:
        if self.cut.is_set():
            raise NoGroupError("cut off")
        return self._client.average(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.mark.parametrize("lead", [5, 3 * MAX_EPOCH_LEAD])
def test_a_trainer_cut_off_and_far_ahead_moves_back_within_two_steps(lead: int) -> None:
    swarm = MemorySwarm()
    cut = threading.Event()
    peers = [
        make_peer(swarm, "a", CutClient(swarm.client("a"), cut)),
        make_peer(swarm, "b"),
        make_peer(swarm, "c"),
    ]
    (ma, a), _, _ = peers
    train_all(peers, 2)
    cut.set()  # a steps alone (it sees nobody) while the others do not hear from it
    train_until(ma, a, 1000, 2 + lead, limit=10 * lead)
    cut.clear()
    for step in range(2):  # its own next steps, the others idle
        backward(ma, batch(2000 + step))
        a.step()
        a.zero_grad()
        if a.epoch == 2:
            break
    assert a.epoch == 2, "did not move back to the swarm's epoch within two steps"
    assert a.stats.rejoins == 1
    assert a.tracker.local.rejoins == 1
    assert [o.epoch for _, o in peers[1:]] == [2, 2]  # the majority did not follow it
    train_all(peers, 5)
    close_all(peers)
    assert len({sha256(m) for m, _ in peers}) == 1
    assert peers[1][1].stats.rejoins == peers[2][1].stats.rejoins == 0


def train_all(peers: list[tuple[torch.nn.Module, Any]], epoch: int) -> None:
    trainers = [
        lambda m=m, o=o, i=i: train_until(m, o, 100 * i, epoch) for i, (m, o) in enumerate(peers)
    ]
    run_in_threads(*trainers, timeout=50)


def close_all(peers: list[tuple[torch.nn.Module, Any]]) -> None:
    run_in_threads(*(lambda o=o: o.close() for _, o in peers), timeout=50)


class AskingClient:
    """A client of the in-memory swarm that keeps what each round asked for."""

    def __init__(self, client: MemoryClient) -> None:
        self._client = client
        self.asked: list[dict[str, Any]] = []

    def average(self, tensors: Any, key: str, **options: Any) -> Any:
        self.asked.append(options)
        return self._client.average(tensors, key, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_round_waits_for_the_peers_it_counted_and_takes_more() -> None:
    # A newcomer's first record reaches some members before others: a member that counted
    # fewer peers than its leader must still take the leader's group (issue: a joiner
    # made a member refuse a group of 3 it had counted as 2).
    swarm = MemorySwarm()
    clients = [AskingClient(swarm.client(name)) for name in "abc"]
    peers = [make_peer(swarm, name, client) for name, client in zip("abc", clients, strict=True)]
    train_all(peers, 2)
    close_all(peers)
    asked = [options for client in clients for options in client.asked]
    assert asked
    for options in asked:
        counted = options["group_size"]
        assert options["max_group_size"] == group_room(counted) > counted


# A newcomer that loads the state in the instant the first trainer steps alone can wait
# out one round at the epoch it loaded (a local step, with a warning): what the run must
# survive, not a failure.
@pytest.mark.filterwarnings("ignore::swarmavg.averaging.training.swarm.SwarmRoundWarning")
def test_trainers_started_at_different_times_end_as_one() -> None:
    """The first trains alone, the second starts when it is at epoch 6, the third much
    later (epoch 12); each trains to epoch 20 and closes. The first goes on as soon as
    each newcomer's wrapper is built (so that a starved thread does not start after the
    run), meanwhile racing it through its download. The first never steps alone for more
    than two of its steps once the second is there, and all end identical."""
    swarm = MemorySwarm()
    end = 20
    starts = {6: threading.Event(), 12: threading.Event()}
    built = {6: threading.Event(), 12: threading.Event()}
    alone_after_join = [0]
    models: dict[str, tuple[torch.nn.Module, Any]] = {}

    def first() -> None:
        model, opt = models["a"] = make_peer(swarm, "a", averaging_timeout=2.0)
        round_of = opt._round

        def counted(*args: Any) -> Any:
            before = opt.link.stats.rounds
            outcome = round_of(*args)
            if built[6].is_set() and opt.link.stats.rounds == before:
                alone_after_join[0] += 1  # a global step without a round
            return outcome

        opt._round = counted

        def on_epoch(epoch: int) -> None:
            for at_epoch, event in starts.items():
                if epoch >= at_epoch and not event.is_set():  # a catch-up may jump it
                    event.set()
                    assert built[at_epoch].wait(30)

        run(model, opt, seed=0, on_epoch=on_epoch)

    def later(name: str, start: int, seed: int) -> Callable[[], None]:
        def train() -> None:
            assert starts[start].wait(30)
            model, opt = models[name] = make_peer(swarm, name, averaging_timeout=2.0)
            built[start].set()
            run(model, opt, seed=seed)

        return train

    def run(model: torch.nn.Module, opt: Any, seed: int, on_epoch: Any = None) -> None:
        for step in range(400):
            if opt.epoch >= end:
                break
            backward(model, batch(seed + step))
            opt.step()
            opt.zero_grad()
            if on_epoch is not None:
                on_epoch(opt.epoch)
        opt.close()

    run_in_threads(first, later("b", 6, 100), later("c", 12, 200), timeout=55)
    assert [o.epoch for _, o in models.values()] == [end] * 3
    assert alone_after_join[0] <= 2
    assert len({sha256(m) for m, _ in models.values()}) == 1
    assert all(o.stats.group_sizes for _, o in models.values())


# ---------------------------------------------------------------- finishing a run


def perturb(model: torch.nn.Module, amount: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


@pytest.mark.parametrize(
    "options",
    [{}, {"average": "parameters"}, {"delay_updates": True}],
    ids=["gradients", "parameters", "delay_updates"],
)
def test_close_ends_members_that_differ_with_identical_parameters(
    options: dict[str, Any],
) -> None:
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n, **options) for n in "abc"]
    train_all(peers, 3)
    perturb(peers[2][0], 0.25)  # c holds other parameters (a local step, say) ...
    peers[2][1].tracker.report()  # ... and reported (a step does)
    expected = [
        torch.stack([p.detach() for p in ps]).mean(0)
        for ps in zip(*(m.parameters() for m, _ in peers), strict=True)
    ]
    if options.get("delay_updates"):
        expected = []  # the pending rounds land first: the mean is of the updated ones
    close_all(peers)
    assert len({sha256(m) for m, _ in peers}) == 1
    assert {o.stats.final_agreement for _, o in peers} == {"averaged"}
    assert {o.stats.final_group_size for _, o in peers} == {3}
    for p, e in zip(peers[0][0].parameters(), expected, strict=False):
        assert torch.allclose(p.detach(), e, atol=1e-6)
    assert all(o._pending is None for _, o in peers if isinstance(o, CollaborativeOptimizer))


class FailingLastRound:
    """A client whose round of one key fails (before reaching the swarm): that member's
    last global step is a local one."""

    def __init__(self, client: MemoryClient, key: str) -> None:
        self._client, self._key = client, key

    def average(self, tensors: Any, key: str, **kwargs: Any) -> Any:
        if key == self._key:
            raise NoGroupError(f"injected: {key}")
        return self._client.average(tensors, key=key, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_close_after_a_last_round_that_failed_for_one_member() -> None:
    swarm = MemorySwarm()
    failing = FailingLastRound(swarm.client("c"), "run.grads.2")
    peers = [make_peer(swarm, n, averaging_timeout=1.0) for n in "ab"]
    peers.append(make_peer(swarm, "c", failing, averaging_timeout=1.0))
    with pytest.warns(UserWarning, match="stepping with local values"):
        train_all(peers, 3)
    assert len({sha256(m) for m, _ in peers}) == 2  # c stepped alone
    close_all(peers)
    assert len({sha256(m) for m, _ in peers}) == 1
    assert {o.stats.final_agreement for _, o in peers} == {"averaged"}


def test_close_needs_no_round_when_the_members_are_identical() -> None:
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n) for n in "abc"]
    train_all(peers, 3)
    for _, o in peers:  # one after the other: nobody waits for the others
        o.close()
    assert [o.stats.final_agreement for _, o in peers] == ["identical", "identical", "alone"]
    assert not [c for c in swarm.calls if ".final." in c[1]]
    assert len({sha256(m) for m, _ in peers}) == 1


def test_close_one_after_the_other_with_a_round_in_flight() -> None:
    """delay_updates: b's record (usually) says its last round is still in flight, so it
    carries no state id: a cannot tell that b holds its state (b may have changed its
    parameters since the round started), waits at most ``final_timeout`` for b, which
    does not close yet, and keeps its own parameters; once b closes too, landing its
    round, both hold the same bytes."""
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n, delay_updates=True, final_timeout=0.5) for n in "ab"]
    train_all(peers, 3)
    (ma, a), (mb, b) = peers
    a.close()
    assert a.stats.final_agreement in {"identical", "failed"}
    b.close()
    assert b.stats.final_agreement in {"alone", "identical"}
    assert sha256(ma) == sha256(mb)


def test_close_alone_and_without_the_final_round() -> None:
    swarm = MemorySwarm()
    (_, a), (_, b) = make_peer(swarm, "a"), make_peer(swarm, "b", final_round=False)
    b.close()
    a.close()
    assert (a.stats.final_agreement, b.stats.final_agreement) == ("alone", "")


def test_a_closer_waits_at_most_final_timeout_for_others_that_train_on() -> None:
    swarm = MemorySwarm()
    (ma, a), (mb, b) = make_peer(swarm, "a", final_timeout=0.3), make_peer(swarm, "b")
    train_all([(ma, a), (mb, b)], 2)
    perturb(ma, 0.5)
    before = sha256(ma)
    a.close()  # b trains on (not at a's state): nobody to agree with
    assert a.stats.final_agreement == "failed"
    assert sha256(ma) == before
    b.close()
    assert b.stats.final_agreement == "alone"


def test_a_with_block_that_raised_leaves_without_the_final_round() -> None:
    swarm = MemorySwarm()
    (ma, a), (mb, b) = make_peer(swarm, "a"), make_peer(swarm, "b")
    train_all([(ma, a), (mb, b)], 2)
    perturb(ma, 0.5)
    with pytest.raises(RuntimeError, match="boom"), a:
        raise RuntimeError("boom")
    assert a.stats.final_agreement == ""
    assert a._closed


def test_diloco_close_agrees_on_parameters_and_anchor() -> None:
    swarm = MemorySwarm()
    peers = []
    for name in "ab":
        model = linear_model()
        opt = DiLoCo(
            model.parameters(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            swarm.client(name),
            run_id="run",
            local_steps=3,
            batch_size_per_step=4,
            averaging_timeout=5.0,
        )
        peers.append((model, opt))

    def train(i: int) -> None:
        model, opt = peers[i]
        for step in range(4):  # one outer step, then one inner step of its own
            backward(model, batch(10 * (i + 1) + step))
            opt.step()
            opt.zero_grad()

    run_in_threads(lambda: train(0), lambda: train(1), timeout=50)
    assert [o.epoch for _, o in peers] == [1, 1]
    assert sha256(peers[0][0]) != sha256(peers[1][0])  # their own inner steps
    close_all(peers)
    assert len({sha256(m) for m, _ in peers}) == 1
    for model, opt in peers:
        assert opt.stats.final_agreement == "averaged"
        for p, anchor in zip(model.parameters(), opt.anchor, strict=True):
            assert torch.equal(p.detach(), anchor)


# ---------------------------------------------------------------- the state of the swarm's epoch


class StaleFirst:
    """A client whose first downloads find the state before the newest one: its donor
    serves a new state at once and advertises it a moment later."""

    def __init__(self, states: list[tuple[Any, list[Any]]]) -> None:
        self.states = states
        self.loads = 0

    def load_state(self, timeout: float = 60.0) -> tuple[Any, list[Any]]:
        self.loads += 1
        return self.states[min(self.loads, len(self.states)) - 1]


def published(epoch: int) -> tuple[Any, list[Any]]:
    from swarmavg.averaging.training.state import TrainingState, pack_state

    metadata, arrays = pack_state(
        TrainingState(kind="collaborative", epoch=epoch, params=[torch.full((3,), float(epoch))])
    )
    return metadata, [a.copy() for a in arrays]


def link_to(client: StaleFirst) -> Any:
    from swarmavg.averaging.training.swarm import SwarmLink

    return SwarmLink(client, "run", codec=None, timeout=5.0, min_group_size=1, state_timeout=5.0)


def test_a_catch_up_that_finds_the_state_before_the_due_one_waits_for_it() -> None:
    """Seen in CI: a trainer caught up at the run's last epoch, found the state before it
    (its advertisement was still on its way) and ended the run with other parameters than
    the others, who had already left. The due epoch's state is now waited for briefly."""
    like = [torch.zeros(3)]
    client = StaleFirst([published(15), published(15), published(16)])
    state = link_to(client).load("collaborative", like, at_least=16)
    assert state is not None
    assert state.epoch == 16
    assert client.loads == 3
    # Without a due epoch, the first state found is the answer (as before).
    client = StaleFirst([published(15), published(16)])
    state = link_to(client).load("collaborative", like)
    assert state is not None
    assert state.epoch == 15
    assert client.loads == 1


def test_a_due_state_that_never_comes_is_waited_for_a_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from swarmavg.averaging.training import swarm

    monkeypatch.setattr(swarm, "DUE_STATE_WAIT", 0.3)  # members that publish less often
    client = StaleFirst([published(15)])
    state = link_to(client).load("collaborative", [torch.zeros(3)], at_least=16)
    assert state is not None
    assert state.epoch == 15, "the newest found is taken when the due one does not come"
    assert client.loads > 1
