"""ThroughputEstimator: the advertised bandwidth, set or measured (pure; no clock)."""

from __future__ import annotations

import pytest

from swarmavg.averaging.allreduce.throughput import (
    DEFAULT_BOUNDS,
    DEFAULT_INITIAL,
    DEFAULT_MIN_BYTES,
    MB,
    ThroughputEstimator,
)


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
    estimator.observe(2 * MB, 2.0)  # a hiccup: 1 MB/s
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
