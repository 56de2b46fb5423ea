"""ThroughputEstimator: the advertised bandwidth, set or measured (pure; no clock), and the
loop it closes with the next round's parts."""

from __future__ import annotations

import pytest

from swarmavg.averaging.allreduce.load_balancing import equal_share_factor, part_sizes
from swarmavg.averaging.allreduce.throughput import (
    DEFAULT_BOUNDS,
    DEFAULT_INITIAL,
    DEFAULT_MIN_BYTES,
    MB,
    ThroughputEstimator,
)
from swarmavg.averaging.group import Member, Mode


def test_starts_from_the_conservative_default_until_the_first_round() -> None:
    estimator = ThroughputEstimator()
    assert estimator.measured
    assert estimator.value == DEFAULT_INITIAL
    assert estimator.samples == 0


def test_first_sample_replaces_the_default_then_smoothing() -> None:
    estimator = ThroughputEstimator(smoothing=0.25)
    assert estimator.observe(100 * MB, 2.0)  # 50 MB/s
    assert estimator.value == pytest.approx(50.0)
    assert estimator.observe(100 * MB, 1.0)  # 100 MB/s: a quarter of the way there
    assert estimator.value == pytest.approx(62.5)
    assert estimator.samples == 2


def test_converges_to_a_steady_throughput() -> None:
    estimator = ThroughputEstimator()
    estimator.observe(8 * MB, 1.0)
    for _ in range(60):
        estimator.observe(30 * MB, 1.0)
    assert estimator.value == pytest.approx(30.0, rel=1e-6)


def test_one_slow_round_is_not_the_new_normal() -> None:
    estimator = ThroughputEstimator(smoothing=0.25)
    estimator.observe(100 * MB, 1.0)
    estimator.observe(10 * MB, 10.0)  # a hiccup: 1 MB/s
    assert estimator.value == pytest.approx(75.25)


@pytest.mark.parametrize(
    ("nbytes", "seconds", "expected"),
    [
        (10_000 * MB, 1e-3, DEFAULT_BOUNDS[1]),  # 10 TB/s: clamped to the ceiling
        (DEFAULT_MIN_BYTES, 3600.0, DEFAULT_BOUNDS[0]),  # 1 MiB an hour: the floor
    ],
)
def test_samples_are_clamped(nbytes: int, seconds: float, expected: float) -> None:
    estimator = ThroughputEstimator()
    assert estimator.observe(nbytes, seconds)
    assert estimator.value == expected


@pytest.mark.parametrize(
    ("nbytes", "seconds", "partial"),
    [
        (DEFAULT_MIN_BYTES - 1, 1.0, False),  # too small: latency, not throughput
        (100 * MB, 1.0, True),  # a partial round waited for a stalled member
        (100 * MB, 0.0, False),
        (100 * MB, -1.0, False),
        (100 * MB, float("nan"), False),
        (100 * MB, float("inf"), False),
    ],
)
def test_uninformative_rounds_are_ignored(nbytes: int, seconds: float, partial: bool) -> None:
    estimator = ThroughputEstimator()
    assert not estimator.observe(nbytes, seconds, partial=partial)
    assert estimator.value == DEFAULT_INITIAL
    assert estimator.samples == 0


def test_a_set_bandwidth_is_never_overwritten() -> None:
    estimator = ThroughputEstimator(250.0)
    assert not estimator.measured
    assert not estimator.observe(100 * MB, 10.0)
    assert estimator.value == 250.0
    assert estimator.samples == 0


def test_zero_is_a_valid_set_bandwidth() -> None:
    assert ThroughputEstimator(0.0).value == 0.0  # a member that reduces nothing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fixed": -1.0}, "bandwidth"),
        ({"fixed": float("inf")}, "bandwidth"),
        ({"bounds": (0.0, 1.0)}, "bounds"),
        ({"bounds": (5.0, 1.0)}, "bounds"),
        ({"initial": 0.01}, "initial"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"smoothing": 1.5}, "smoothing"),
        ({"min_bytes": 0}, "min_bytes"),
    ],
)
def test_bad_parameters_name_themselves(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThroughputEstimator(**kwargs)


# -- the closed loop: measured bandwidths size the next round's parts ---------------------


def _members(claims: list[float]) -> list[Member]:
    return [
        Member(bytes([i + 1]) * 20, f"127.0.0.1:{7000 + i}", Mode.NODE, claim)
        for i, claim in enumerate(claims)
    ]


def _rounds_on_equal_links(
    scaled: bool,
    claims: list[float],
    rounds: int,
    *,
    own_time: bool = False,
    anchored: bool = True,
) -> list[int]:
    """Rounds of a group whose links all carry 12.5 MB/s, each member measuring the round
    as the averager does: its bytes over the group's time (every member waits for the
    slowest); ``scaled``: the bytes an equal part would have moved. ``own_time``: each
    member's time ends with the last reply it waits for, the busiest *other* member's
    (the busiest member ends first). ``anchored``: the group's claims go with each sample,
    as the averager passes them. The last parts."""
    estimators = [ThroughputEstimator() for _ in claims]
    total, itemsize, rate = 4_000_000, 4, 12.5 * MB
    members = _members(claims)
    sizes = part_sizes(members, total)
    for _ in range(rounds):
        moved = [itemsize * (total + (len(members) - 2) * size) for size in sizes]
        group = [m.bandwidth for m in members]
        for i, estimator in enumerate(estimators):
            waited = [moved[j] for j in range(len(moved)) if j != i] if own_time else moved
            factor = equal_share_factor(members, i, sizes) if scaled else 1.0
            estimator.observe(
                round(moved[i] * factor), max(waited) / rate, group=group if anchored else ()
            )
        members = _members([estimator.value for estimator in estimators])
        sizes = part_sizes(members, total)
    return sizes


def test_parts_on_alike_links_become_equal_whatever_the_first_claims() -> None:
    # After one noisy round the claims differ by a few percent. Measured on the bytes its
    # own part made it move, the member with the largest part reads as the fastest in
    # every round and keeps its larger part (here 1.19x the smallest, for good); on the
    # bytes an equal part would have moved, every member reads the group's rate.
    claims = [10.0, 10.4, 9.8, 10.1]
    kept = _rounds_on_equal_links(scaled=False, claims=claims, rounds=30, anchored=False)
    assert max(kept) / min(kept) > 1.15  # the unscaled sample: the model of the old rule
    sizes = _rounds_on_equal_links(scaled=True, claims=claims, rounds=30, anchored=False)
    assert max(sizes) / min(sizes) < 1.001


def test_the_busiest_member_ending_first_does_not_keep_the_largest_part() -> None:
    # What the test bed showed: every member's exchange ends with the last reply it waits
    # for, so the member with the largest part (whose replies are last) ends first and
    # reads as the fastest. Following its own samples, it keeps a larger part for good
    # (1.09x in this model, 1.28x on the bed); read as a sample of the group's rate, the
    # parts come together.
    claims = [10.0, 10.4, 9.8, 10.1]
    drifted = _rounds_on_equal_links(True, claims, rounds=30, own_time=True, anchored=False)
    assert max(drifted) / min(drifted) > 1.05
    # One round of samples, then every alike member advertises the group's median: equal.
    for rounds in (2, 30):
        sizes = _rounds_on_equal_links(True, claims, rounds=rounds, own_time=True)
        assert len(set(sizes)) == 1, sizes


def test_an_estimate_near_the_groups_median_moves_from_the_median() -> None:
    estimator = ThroughputEstimator(smoothing=0.25)
    estimator.observe(20 * MB, 1.0)  # first sample: 20 MB/s
    # The group claims 18, 18, 20: this member's 20 lies within the band of the median 18,
    # so its sample of 16 MB/s reads the group's rate and moves the median.
    assert estimator.observe(16 * MB, 1.0, group=[18.0, 18.0, 20.0])
    assert estimator.value == pytest.approx(18 + 0.25 * (16 - 18))
    # A sample within SAME_RATE of the median is the group's rate: the median itself.
    assert estimator.observe(17 * MB, 1.0, group=[18.0, 17.5, 18.0, 19.0])
    assert estimator.value == 18.0


def test_an_estimate_far_from_the_groups_median_moves_from_itself() -> None:
    estimator = ThroughputEstimator(smoothing=0.25)
    estimator.observe(100 * MB, 1.0)
    # A fast member beside slow ones (or a user's figure): its own link, not the group's.
    assert estimator.observe(100 * MB, 1.0, group=[10.0, 100.0, 10.0])
    assert estimator.value == pytest.approx(100.0)
    # Claims that are not positive and finite do not count; a lone claim is no group.
    estimator.observe(80 * MB, 1.0, group=[0.0, float("nan"), 90.0])
    assert estimator.value == pytest.approx(100 + 0.25 * (80 - 100))


def test_equal_share_factor_follows_the_traffic_model() -> None:
    members = _members([1.0] * 4)
    assert equal_share_factor(members, 0, [25, 25, 25, 25]) == pytest.approx(1.0)
    # A sender-reducer of 4 moves total + 2 x its part per direction: 100 + 2 * 40 = 180
    # with part 40, 150 with an equal part of 25.
    assert equal_share_factor(members, 0, [40, 20, 20, 20]) == pytest.approx(150 / 180)
    assert equal_share_factor(members, 1, [40, 20, 20, 20]) == pytest.approx(150 / 140)
    # Two members swap halves: the traffic does not depend on the parts.
    assert equal_share_factor(_members([1.0, 1.0]), 0, [70, 30]) == pytest.approx(1.0)
    # A client reduces nothing: nothing to scale.
    client = [*_members([1.0, 1.0]), Member(b"\x09" * 20, None, Mode.CLIENT, 0.0)]
    assert equal_share_factor(client, 2, [50, 50, 0]) == 1.0
    # An aux member moves only its part's traffic (3 senders' values in, the average out).
    aux = [*_members([1.0, 1.0, 1.0]), Member(b"\x09" * 20, "127.0.0.1:7009", Mode.AUX, 1.0)]
    assert equal_share_factor(aux, 3, [20, 20, 20, 40]) == pytest.approx(25 / 40)
