"""Part sizes from bandwidth: totals, modes, optimality against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmavg.averaging.allreduce.load_balancing import (
    MAX_BANDWIDTH_RATIO,
    MAX_SHARE_RATIO,
    _load_coefficients,
    effective_bandwidths,
    part_sizes,
)
from swarmavg.averaging.group import Member, Mode


def _members(spec: list[tuple[Mode, float]]) -> list[Member]:
    return [
        Member(bytes([i]) * 20, None if mode is Mode.CLIENT else f"h:{i}", mode, bw)
        for i, (mode, bw) in enumerate(spec)
    ]


def _cost(members: list[Member], sizes: list[int], total: int) -> float:
    """The round time the balancer minimises, with the claims as it bounds them."""
    coeff = _load_coefficients(members, total)
    bandwidth = effective_bandwidths(members)
    return max(
        (coeff[i][0] + coeff[i][1] * sizes[i]) / bandwidth[i]
        for i, m in enumerate(members)
        if m.is_reducer
    )


def test_equal_bandwidth_gives_equal_parts() -> None:
    members = _members([(Mode.NODE, 1.0)] * 4)
    assert part_sizes(members, 1000) == [250, 250, 250, 250]
    assert sorted(part_sizes(members, 1001)) == [250, 250, 250, 251]


def test_clients_and_zero_bandwidth_reduce_nothing() -> None:
    members = _members([(Mode.NODE, 1.0), (Mode.CLIENT, 0.0), (Mode.NODE, 0.0), (Mode.AUX, 1.0)])
    sizes = part_sizes(members, 999)
    assert sizes[1] == 0
    assert sizes[2] == 0
    assert sum(sizes) == 999
    assert sizes[0] > 0
    assert sizes[3] > 0


def test_faster_member_gets_more() -> None:
    members = _members([(Mode.NODE, 1.0), (Mode.NODE, 4.0), (Mode.NODE, 1.0), (Mode.NODE, 1.0)])
    sizes = part_sizes(members, 10_000)
    assert sizes[1] > sizes[0] == sizes[2] == sizes[3] or sizes[1] > max(sizes[0], sizes[2])
    assert sum(sizes) == 10_000


def test_single_element_and_empty() -> None:
    members = _members([(Mode.NODE, 1.0)] * 3)
    assert sum(part_sizes(members, 1)) == 1
    assert part_sizes(members, 0) == [0, 0, 0]
    with pytest.raises(ValueError, match="reduce"):
        part_sizes(_members([(Mode.CLIENT, 0.0)]), 5)


def test_deterministic() -> None:
    members = _members([(Mode.NODE, 1.3), (Mode.AUX, 0.7), (Mode.NODE, 2.9), (Mode.CLIENT, 0.0)])
    assert part_sizes(members, 123_457) == part_sizes(list(members), 123_457)


@settings(max_examples=40, deadline=None)
@given(
    spec=st.lists(
        st.tuples(st.sampled_from(list(Mode)), st.floats(0.1, 10.0)), min_size=1, max_size=4
    ),
    total=st.integers(1, 40),
)
def test_minimax_is_optimal_against_brute_force(spec: list[tuple[Mode, float]], total: int) -> None:
    if not any(m is not Mode.CLIENT for m, _ in spec) or not any(m.sends for m, _ in spec):
        return
    members = _members(spec)
    sizes = part_sizes(members, total)
    assert sum(sizes) == total
    assert min(sizes) >= 0
    reducers = [i for i, m in enumerate(members) if m.is_reducer]
    cap = MAX_SHARE_RATIO * total / len(reducers)
    assert max(sizes) <= cap + 1  # rounding may add one element
    best = float("inf")
    for combo in itertools.product(range(total + 1), repeat=len(reducers) - 1):
        last = total - sum(combo)
        if last < 0 or max((*combo, last)) > cap:
            continue
        candidate = [0] * len(members)
        for i, x in zip(reducers, [*combo, last], strict=True):
            candidate[i] = x
        best = min(best, _cost(members, candidate, total))
    # Integer rounding may cost at most one element on the worst reducer.
    bandwidth = effective_bandwidths(members)
    slack = max(_load_coefficients(members, total)[i][1] / bandwidth[i] for i in reducers)
    assert _cost(members, sizes, total) <= best + slack + 1e-9


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_an_inflated_claim_buys_at_most_a_bounded_share(n: int) -> None:
    """Claiming 1e9 used to give the claimant the whole vector ([0, 0, 0, N])."""
    members = _members([(Mode.NODE, 1.0)] * (n - 1) + [(Mode.NODE, 1e9)])
    assert effective_bandwidths(members)[-1] == MAX_BANDWIDTH_RATIO * 1.0
    total = 1_000_000
    sizes = part_sizes(members, total)
    assert sum(sizes) == total
    assert sizes[-1] <= MAX_SHARE_RATIO * total / n + 1
    assert min(sizes[:-1]) > 0


def test_claims_below_the_cap_are_untouched() -> None:
    members = _members([(Mode.NODE, 1.0), (Mode.NODE, 3.0), (Mode.NODE, 2.0), (Mode.CLIENT, 0.0)])
    assert effective_bandwidths(members) == [1.0, 3.0, 2.0, 0.0]
