"""The majority rule over a round's state digests (pure) and the state digest itself."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmavg.averaging.training.consensus import (
    Provenance,
    Role,
    judge,
    majority_digest,
)

A, B, C = b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32


def test_majority_is_the_most_held_digest() -> None:
    assert majority_digest({}) is None
    assert majority_digest({"p1": B, "p2": A, "p3": B}) == B
    # a plurality is enough: 2 of 5 hold B, the others all differ
    assert majority_digest({"p1": B, "p2": B, "p3": A, "p4": C, "p5": b"\x01"}) == B


def test_a_tie_goes_to_the_smaller_digest_whatever_the_order() -> None:
    members = [("p1", B), ("p2", A), ("p3", B), ("p4", A)]
    for order in itertools.permutations(members):
        assert majority_digest(dict(order)) == A
    assert majority_digest({"p1": C, "p2": B}) == B


def roles(digests: dict[str, bytes]) -> dict[str, Role]:
    return {peer: judge(digests, mine).role for peer, mine in digests.items()}


def test_one_member_off() -> None:
    digests = {"p1": A, "p2": A, "p3": B}
    assert roles(digests) == {"p1": Role.SERVE, "p2": Role.SERVE, "p3": Role.REPAIR}
    verdict = judge(digests, B)
    assert (verdict.majority, verdict.holders, verdict.differing) == (A, ("p1", "p2"), ("p3",))


def test_two_off_of_five() -> None:
    digests = {"p1": A, "p2": A, "p3": A, "p4": B, "p5": C}
    assert roles(digests) == {
        "p1": Role.SERVE,
        "p2": Role.SERVE,
        "p3": Role.SERVE,
        "p4": Role.REPAIR,
        "p5": Role.REPAIR,
    }
    # the two that are off agree with each other: still the minority
    digests = {"p1": B, "p2": B, "p3": B, "p4": A, "p5": A}
    assert judge(digests, A).role is Role.REPAIR
    assert judge(digests, A).holders == ("p1", "p2", "p3")


def test_a_tie_between_two_halves() -> None:
    digests = {"p1": B, "p2": B, "p3": A, "p4": A}
    assert roles(digests) == {
        "p1": Role.REPAIR,
        "p2": Role.REPAIR,
        "p3": Role.SERVE,
        "p4": Role.SERVE,
    }
    assert roles({"p1": B, "p2": A}) == {"p1": Role.REPAIR, "p2": Role.SERVE}


def test_nothing_to_compare_with_means_step() -> None:
    assert roles({"p1": A, "p2": A, "p3": A}) == dict.fromkeys(["p1", "p2", "p3"], Role.STEP)
    assert judge({"p1": A}, A).role is Role.STEP  # alone (or with digest-less members)
    assert judge({}, A).role is Role.STEP
    assert judge({"p1": A, "p2": B}, b"").role is Role.STEP  # this process attached none
    assert judge({"p1": A, "p2": b"", "p3": A}, A).role is Role.STEP  # empty: not a digest


def test_own_digest_is_compared_not_the_daemons_entry() -> None:
    # A daemon combining two local processes attaches its first caller's digest (A); the
    # second caller, whose own state is C, is the one that must repair.
    digests = {"daemon1": A, "daemon2": A}
    assert judge(digests, C).role is Role.REPAIR
    assert judge(digests, A).role is Role.STEP
    # a process that is not in the map at all (its daemon attached none) but holds A
    assert judge({"p1": A, "p2": B, "p3": A}, A).role is Role.SERVE


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=4), st.sampled_from([A, B, C, b"\x01"]), max_size=12
    )
)
def test_every_member_reaches_the_same_verdict(digests: dict[str, bytes]) -> None:
    verdicts = [judge(digests, mine) for mine in digests.values()]
    if len(digests) < 2:
        assert all(v.role is Role.STEP for v in verdicts)
        return
    majorities = {v.majority for v in verdicts}
    assert len(majorities) == 1
    (majority,) = majorities
    counts = [sum(1 for d in digests.values() if d == x) for x in (A, B, C, b"\x01")]
    assert sum(1 for d in digests.values() if d == majority) == max(counts)
    for peer, verdict in zip(digests, verdicts, strict=True):
        assert (verdict.role is Role.REPAIR) == (digests[peer] != majority)
        assert set(verdict.holders) | set(verdict.differing) == set(digests)


def test_provenance_round_trip_and_malformed_extras() -> None:
    p = Provenance(epoch=4, stepped_from=A, group="00ff")
    assert Provenance.from_extra({"provenance": p.to_extra()}) == p
    for bad in (
        {},
        {"provenance": "x"},
        {"provenance": {"epoch": True, "from": A, "group": "g"}},
        {"provenance": {"epoch": -1, "from": A, "group": "g"}},
        {"provenance": {"epoch": 1, "from": "not bytes", "group": "g"}},
        {"provenance": {"epoch": 1, "from": A}},
    ):
        assert Provenance.from_extra(bad) is None


torch = pytest.importorskip("torch")

from swarmavg.averaging.training.digest import state_digest  # noqa: E402
from swarmavg.averaging.training.state import TrainingState, pack_state, unpack_state  # noqa: E402
from tests.training.helpers import backward, batch, linear_model  # noqa: E402


def trained(optimizer: str = "sgd") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = linear_model()
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for i in range(3):
        backward(model, batch(i))
        opt.step()
        opt.zero_grad()
    return model, opt


def digest_of(model: torch.nn.Module, opt: torch.optim.Optimizer, epoch: int = 3) -> bytes:
    return state_digest(list(model.parameters()), {"optimizer": opt.state_dict()}, epoch)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_digest_is_equal_for_equal_states_and_survives_publish_and_load(optimizer: str) -> None:
    model, opt = trained(optimizer)
    twin, twin_opt = trained(optimizer)
    assert digest_of(model, opt) == digest_of(twin, twin_opt)
    # what a repairing member ends with: the state published, loaded into another replica
    metadata, arrays = pack_state(
        TrainingState("k", 3, list(model.parameters()), {"optimizer": opt.state_dict()})
    )
    replica = linear_model(seed=7)
    replica_opt = type(opt)(replica.parameters(), lr=0.5)
    loaded = unpack_state(metadata, arrays, kind="k", like=list(replica.parameters()))
    with torch.no_grad():
        for p, q in zip(replica.parameters(), loaded.params, strict=True):
            p.copy_(q)
    replica_opt.load_state_dict(loaded.optimizers["optimizer"])
    assert digest_of(replica, replica_opt) == digest_of(model, opt)


def test_digest_sees_every_part_of_the_state() -> None:
    model, opt = trained()
    base = digest_of(model, opt)
    assert digest_of(model, opt, epoch=4) != base
    with torch.no_grad():
        weight = next(model.parameters())
        flat = weight.view(-1)
        old = flat[0].item()
        flat[0] = torch.nextafter(flat[0], torch.tensor(1e9))  # one ulp
    assert digest_of(model, opt) != base
    with torch.no_grad():
        flat[0] = old
    assert digest_of(model, opt) == base
    opt.param_groups[0]["lr"] = 0.2
    assert digest_of(model, opt) != base
    opt.param_groups[0]["lr"] = 0.1
    buffer = opt.state[weight]["momentum_buffer"]
    buffer.view(-1)[0] += 1.0
    assert digest_of(model, opt) != base


def test_digest_is_stable_for_odd_values_and_dtypes() -> None:
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    values = {"b": (1, 2.5, None, "s"), "a": {2: torch.tensor(1.0), 10: torch.float16}}
    reordered = {"a": {10: torch.float16, 2: torch.tensor(1.0)}, "b": (1, 2.5, None, "s")}
    assert state_digest([x], values, 0) == state_digest([x.clone()], reordered, 0)
    assert state_digest([x], values, 0) != state_digest([x.float()], values, 0)  # dtype counts
    assert state_digest([x], values, 0) != state_digest([x.reshape(3, 2)], values, 0)
    # an object whose repr holds its address contributes its type only
    assert state_digest([x], {"f": object()}, 0) == state_digest([x], {"f": object()}, 0)
