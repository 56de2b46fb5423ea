"""Size each member's part by its reported bandwidth.

A member ``i`` that reduces ``x_i`` elements of a vector of ``total`` elements receives,
per direction, about ``total - x_i`` averaged elements of the other parts (when it
sends) plus ``(S - 1) x_i`` elements from the other senders of its own part, where ``S``
is the number of senders. An auxiliary member (sends nothing) receives ``S x_i``. The
round takes as long as its slowest member, so we minimise ``max_i load_i(x_i) / b_i``
subject to ``sum x_i = total`` and ``x_i >= 0``: a one-dimensional water-filling whose
level ``T`` is found by bisection (the closed form of this small linear program; cf.
hivemind's ``load_balance_peers``, which solves it with scipy's LP solver).

The result is deterministic: every member computes the same integers from the same
inputs.

Bounded claims: a bandwidth is a member's unverifiable word, and the member that
reduces a part decides what every member gets back for it. Claiming 1e9 used to hand the
claimant the whole vector (part sizes ``[0, 0, 0, N]``). So before balancing, every claim
is clamped to :data:`MAX_BANDWIDTH_RATIO` times the group's (lower) median claim, and no
reducer gets more than :data:`MAX_SHARE_RATIO` times an equal share of the vector. Both are
protocol constants, not settings: every member must compute the same parts. Claims the
daemon makes itself are its measured throughput (``throughput.py``) unless its user set one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from swarmavg.averaging.group import Member, Mode

_BISECTION_STEPS = 200
MAX_BANDWIDTH_RATIO = 4.0
"""A claim counts as at most this many times the group's lower median claim: a peer 4x
faster than its group still takes more work, a liar no more than that."""
MAX_SHARE_RATIO = 1.5
"""No reducer reduces more than 1.5x an equal share (3/4 of the vector in a group of two
reducers, 3/8 in one of four), whatever the claims: the part a lying reducer can forge is
bounded, and honest members' observation then marks it (see ``replies.py``)."""


def effective_bandwidths(members: Sequence[Member]) -> list[float]:
    """Each member's claim clamped to ``MAX_BANDWIDTH_RATIO`` x the reducers' lower median
    claim (0 for members that reduce nothing)."""
    claims = [m.bandwidth for m in members if m.is_reducer]
    if not claims:
        return [0.0] * len(members)
    cap = MAX_BANDWIDTH_RATIO * statistics.median_low(claims)
    return [min(m.bandwidth, cap) if m.is_reducer else 0.0 for m in members]


def _load_coefficients(members: Sequence[Member], total: int) -> list[tuple[float, float]]:
    """``(fixed, per_element)`` incoming load of each reducer as a function of its part."""
    senders = sum(1 for m in members if m.mode.sends)
    coefficients = []
    for m in members:
        if m.mode is Mode.AUX:
            coefficients.append((0.0, float(max(senders, 1))))
        else:
            # With two senders a node's load does not depend on its part (it swaps one
            # half for the other); count at least one element of work per element so
            # bandwidth still decides.
            coefficients.append((float(total), float(max(senders - 2, 1))))
    return coefficients


def part_sizes(members: Sequence[Member], total: int) -> list[int]:
    """Elements of the flat vector reduced by each member, in member order.

    Members that cannot reduce (clients, bandwidth 0) get 0. The sizes sum to ``total``.
    Claims are bounded first (:func:`effective_bandwidths`) and no part exceeds
    ``MAX_SHARE_RATIO`` x ``total / reducers`` (plus rounding).

    Raises:
        ValueError: ``total < 0`` or no member can reduce.
    """
    if total < 0:
        raise ValueError("total must be >= 0")
    reducers = [i for i, m in enumerate(members) if m.is_reducer]
    if not reducers:
        raise ValueError("no member can reduce a part")
    sizes = [0] * len(members)
    if total == 0:
        return sizes
    coeff = _load_coefficients(members, total)
    bandwidth = effective_bandwidths(members)
    cap = MAX_SHARE_RATIO * total / len(reducers)

    def fill(level: float) -> list[float]:
        out = []
        for i in reducers:
            fixed, per_element = coeff[i]
            out.append(min(cap, max(0.0, (level * bandwidth[i] - fixed) / per_element)))
        return out

    # Bracket the water level: at `high` every reducer reaches its cap (the caps sum to
    # more than the total).
    low = 0.0
    high = max((coeff[i][0] + coeff[i][1] * cap) / bandwidth[i] for i in reducers)
    for _ in range(_BISECTION_STEPS):
        mid = (low + high) / 2
        if mid in (low, high):
            break
        if sum(fill(mid)) >= total:
            high = mid
        else:
            low = mid
    shares = fill(high)
    scale = total / sum(shares)
    exact = [s * scale for s in shares]
    # Largest remainder rounding; ties go to the lower member index.
    floors = [int(e) for e in exact]
    remaining = total - sum(floors)
    order = sorted(range(len(reducers)), key=lambda k: (-(exact[k] - floors[k]), k))
    for k in order[:remaining]:
        floors[k] += 1
    for k, i in enumerate(reducers):
        sizes[i] = floors[k]
    return sizes


def equal_share_factor(members: Sequence[Member], index: int, sizes: Sequence[int]) -> float:
    """What member ``index`` would have moved in its busier direction with an equal part,
    over what it moved with its part of ``sizes`` (:func:`part_sizes`' result).

    A measured bandwidth is the bytes a round moved over its exchange time
    (``throughput.py``); every member waits for the slowest, so a member with a larger part
    moves more bytes in the same time and reads as faster, and its next part grows again,
    up to ``MAX_SHARE_RATIO`` on links that are all alike. Scaling its bytes to an equal
    part's first makes the sample the group's achieved rate, whatever part the member had.
    """
    senders = sum(1 for m in members if m.mode.sends)
    reducers = sum(1 for m in members if m.is_reducer)
    total = sum(sizes)
    mode = members[index].mode

    def moved(part: float) -> float:
        # Elements per direction: a sender's values for the other parts and the averages
        # of its own part for the other senders; an aux member only its part's traffic.
        if mode is Mode.AUX:
            return senders * part
        return total + (senders - 2) * part

    if not members[index].is_reducer:
        return 1.0  # no part: what it moves does not depend on the others' parts
    own = moved(sizes[index])
    return moved(total / reducers) / own if own > 0 else 1.0
