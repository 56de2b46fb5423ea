"""Robust aggregation rules: names, the two aggregators' math, weight bounds, the reducer."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.aggregation import Aggregation, parse_aggregation
from swarmavg.averaging.allreduce import reducer as reducer_module
from swarmavg.averaging.allreduce.partition import PartPlan
from swarmavg.averaging.allreduce.reducer import PartReducer, weighted_mean
from swarmavg.averaging.allreduce.robust import (
    centered_clip,
    clip_weights,
    selected_rows,
    sorted_copies,
    trimmed_mean,
    weighted_median,
)
from swarmavg.averaging.errors import InvalidRequestError
from swarmavg.averaging.request import RoundRequest

pytestmark = pytest.mark.timeout(30)


# ---- names ----


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("mean", "mean"),
        ("centered-clip", "centered-clip:tau=1.0,iters=5,reject=3.0"),
        ("centered-clip:iters=3,tau=1", "centered-clip:tau=1.0,iters=3,reject=3.0"),
        ("centered-clip:tau=0.5", "centered-clip:tau=0.5,iters=5,reject=3.0"),
        ("centered-clip:reject=0", "centered-clip:tau=1.0,iters=5,reject=0.0"),
        ("centered-clip:reject=-0.0", "centered-clip:tau=1.0,iters=5,reject=0.0"),
        ("trimmed-mean:trim=-0.0", "trimmed-mean:trim=0.0"),
        ("centered-clip:reject=1", "centered-clip:tau=1.0,iters=5,reject=1.0"),
        ("trimmed-mean", "trimmed-mean:trim=0.25"),
        ("trimmed-mean:trim=0.1", "trimmed-mean:trim=0.1"),
    ],
)
def test_names_are_canonical(spec: str, name: str) -> None:
    rule = parse_aggregation(spec)
    assert rule.name == name
    assert parse_aggregation(rule.name) == rule


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("median", "known: mean, centered-clip \\(tau, iters, reject\\), trimmed-mean \\(trim\\)"),
        ("centered-clip:tau=0", "tau must be"),
        ("centered-clip:tau=inf", "tau must be"),
        ("centered-clip:iters=0", "iters must be"),
        ("centered-clip:iters=2.5", "iters must be an integer"),
        ("centered-clip:trim=0.1", "takes tau, iters, reject, not trim"),
        ("centered-clip:reject=0.5", "reject must be 0 \\(off\\) or"),
        ("centered-clip:reject=-1", "reject must be"),
        ("centered-clip:reject=inf", "reject must be"),
        ("trimmed-mean:trim=0.5", "trim must be in"),
        ("trimmed-mean:trim=-0.1", "trim must be in"),
        ("trimmed-mean:trim=abc", "not a number"),
        ("trimmed-mean:0.2", "bad aggregation parameter"),
        ("mean:x=1", "takes no parameters"),
        ("", "aggregation must be a name"),
    ],
)
def test_bad_names_raise_value_error(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_aggregation(spec)
    with pytest.raises(InvalidRequestError, match=match):
        RoundRequest.build(key="k", aggregation=spec)


def test_round_request_keeps_the_canonical_name() -> None:
    assert RoundRequest.build(key="k").aggregation == "mean"
    request = RoundRequest.build(key="k", aggregation="trimmed-mean")
    assert request.aggregation == "trimmed-mean:trim=0.25"
    with pytest.raises(InvalidRequestError):
        RoundRequest.build(key="k", aggregation=3)


# ---- the math ----


def _rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 16, 33])
def test_sorting_network_and_median_match_numpy(n: int) -> None:
    stack = _rng().standard_normal((n, 257)).astype(np.float32)
    np.testing.assert_array_equal(sorted_copies(stack), np.sort(stack, axis=0))
    expected = np.median(stack, axis=0)
    np.testing.assert_allclose(weighted_median(stack, np.ones(n)), expected, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 16, 33])
def test_selected_rows_are_the_sorted_rows(n: int) -> None:
    stack = _rng().standard_normal((n, 257)).astype(np.float32)
    stack[:, :40] = np.round(stack[:, :40])  # ties
    before = stack.copy()
    ordered = np.sort(stack, axis=0)
    for rows in [((n - 1) // 2, n // 2), tuple(range(n // 4, n - n // 4)), (0, n - 1), (n - 1,)]:
        got = selected_rows(stack, rows)
        assert len(got) == len(rows)
        for row, values in zip(rows, got, strict=True):
            np.testing.assert_array_equal(values, ordered[row])
    np.testing.assert_array_equal(stack, before)  # the input is only read


def _trimmed_reference(stack: np.ndarray, weights: np.ndarray, k: int) -> np.ndarray:
    """Per column in float64: a stable sort, drop k per side, weighted mean of the rest."""
    n = stack.shape[0]
    order = np.argsort(stack, axis=0, kind="stable")
    kept = np.take_along_axis(stack, order, axis=0)[k : n - k].astype(np.float64)
    kept_w = weights[order][k : n - k]
    total = kept_w.sum(axis=0)
    safe = np.where(total > 0, total, 1.0)
    return np.where(total > 0, (kept * kept_w).sum(axis=0) / safe, kept.mean(axis=0))


@pytest.mark.parametrize("n", [3, 4, 5, 8, 9])
def test_weighted_trimmed_mean_matches_a_stable_sort(n: int) -> None:
    rng = _rng()
    stack = rng.standard_normal((n, 513)).astype(np.float32)
    stack[:, :100] = np.round(stack[:, :100])  # ties: dropped by row order, as a stable sort
    weights = 1.0 + np.arange(n) % 3
    for k in range((n + 1) // 2):
        got = trimmed_mean(stack, weights, k)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, _trimmed_reference(stack, weights, k), rtol=1e-5, atol=1e-6)
    weights[: n // 2] = 0.0  # some kept values weigh nothing; all-zero kept sets: plain mean
    for k in range((n + 1) // 2):
        expected = _trimmed_reference(stack, weights, k)
        np.testing.assert_allclose(trimmed_mean(stack, weights, k), expected, rtol=1e-5, atol=1e-6)


def test_centered_clip_gram_keeps_float64_accuracy() -> None:
    # 2.5 blocks of coordinates with a large common offset: one float32 product over all
    # coordinates would lose digits; the clipped estimate must match a float64 reference
    rng = _rng()
    honest = (rng.standard_normal((3, 20481)) + 1000.0).astype(np.float32)
    stack = np.concatenate([honest, honest[:1] + 50.0])
    out, clipped = centered_clip(stack, np.ones(4), tau=1.0, iters=20)
    ref, ref_clipped = centered_clip(stack.astype(np.float64), np.ones(4), tau=1.0, iters=20)
    assert clipped == ref_clipped
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_weighted_median_known_answers() -> None:
    stack = np.array([[1.0], [2.0], [3.0], [10.0]], dtype=np.float32)
    assert weighted_median(stack, np.array([1.0, 1.0, 1.0, 1.0]))[0] == 2.5
    assert weighted_median(stack, np.array([1.0, 1.0, 1.0, 5.0]))[0] == 10.0
    assert weighted_median(stack, np.array([3.0, 1.0, 1.0, 1.0]))[0] == 1.5  # half reached at 1
    assert weighted_median(stack, np.zeros(4))[0] == 2.5  # all zero: as if equal


def test_trimmed_mean_known_answers_and_weights() -> None:
    stack = np.array([[1.0, -5.0], [2.0, 0.0], [3.0, 1.0], [100.0, 2.0]], dtype=np.float32)
    np.testing.assert_allclose(trimmed_mean(stack, np.ones(4), 1), [2.5, 0.5])
    np.testing.assert_allclose(trimmed_mean(stack, np.ones(4), 0), stack.mean(axis=0))
    # weights apply to the kept values: column 0 keeps 2 (w=3) and 3 (w=1)
    weights = np.array([1.0, 3.0, 1.0, 1.0])
    np.testing.assert_allclose(trimmed_mean(stack, weights, 1), [(2 * 3 + 3) / 4, (0 * 3 + 1) / 4])
    with pytest.raises(ValueError, match="cannot trim"):
        trimmed_mean(stack, np.ones(4), 2)


@pytest.mark.parametrize("reject", [0.0, 3.0])
def test_centered_clip_is_the_mean_without_outliers(reject: float) -> None:
    stack = _rng().standard_normal((6, 1000)).astype(np.float32)
    weights = np.array([1.0, 2.0, 1.0, 0.5, 1.0, 1.5])
    out, clipped = centered_clip(stack, weights, tau=2.0, iters=5, reject=reject)
    assert clipped == 0
    np.testing.assert_allclose(out, weighted_mean(list(stack), list(weights)), atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_outlier_is_bounded(dtype: type) -> None:
    honest = _rng().standard_normal((3, 4096)).astype(dtype)
    for scale in (1e3, 1e30 if dtype is np.float32 else 1e200):
        attacker = np.full((1, 4096), scale, dtype=dtype)
        stack = np.concatenate([honest, attacker])
        honest_mean = honest.astype(np.float64).mean(axis=0)
        spread = np.linalg.norm(honest - honest_mean, axis=1).max()
        out, clipped = centered_clip(stack, np.ones(4), tau=2.0, iters=5)
        assert out.dtype == dtype
        assert np.isfinite(out).all()
        assert clipped == 1
        # the attacker moves the estimate by at most its weight share of the radius
        # (2 x a median distance from the median, itself within the honest spread)
        assert np.linalg.norm(out - honest_mean) <= 2 * spread
        trimmed = trimmed_mean(stack, np.ones(4), 1)
        assert trimmed.dtype == dtype
        assert np.abs(trimmed - honest_mean).max() <= np.abs(honest - honest_mean).max()


def _signal_and_attacker(dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Three honest copies of a gradient (signal 0.5 plus unit noise) and one of -10 x it."""
    honest = (0.5 + _rng().standard_normal((3, 4096))).astype(dtype)
    return honest, np.full((1, 4096), -5.0, dtype=dtype)


def test_a_far_copy_is_rejected_not_only_clipped() -> None:
    honest, attacker = _signal_and_attacker()
    stack = np.concatenate([honest, attacker])
    honest_mean = honest.astype(np.float64).mean(axis=0)
    plain, plain_adjusted = centered_clip(stack, np.ones(4), tau=1.0, iters=5, reject=0.0)
    out, adjusted = centered_clip(stack, np.ones(4), tau=1.0, iters=5, reject=3.0)
    assert plain_adjusted >= 1
    assert adjusted >= 1  # the rejected copy counts as adjusted
    plain_pull = np.linalg.norm(plain - honest_mean)
    pull = np.linalg.norm(out - honest_mean)
    # clipped, the attacker still pulls by about the radius over the 3 honest copies (a
    # median distance, ~64 here); rejected, only the start (the median of 4) differs
    assert plain_pull > 10.0
    assert pull < plain_pull / 5
    # the pull is a bias against the signal: the mean of the result keeps the signal
    assert float(out.mean()) == pytest.approx(float(honest_mean.mean()), abs=0.05)
    assert float(plain.mean()) < float(honest_mean.mean()) - 0.1


def test_a_copy_inside_the_rejection_radius_is_clipped_as_before() -> None:
    honest, _ = _signal_and_attacker()
    # 2.5 median distances away: outside tau=1's radius, inside reject=3's
    spread = float(np.median(np.linalg.norm(honest - np.median(honest, axis=0), axis=1)))
    attacker = np.median(honest, axis=0, keepdims=True) + 2.0 * spread / np.sqrt(4096)
    stack = np.concatenate([honest, attacker]).astype(np.float32)
    out, adjusted = centered_clip(stack, np.ones(4), tau=1.0, iters=5, reject=3.0)
    plain, plain_adjusted = centered_clip(stack, np.ones(4), tau=1.0, iters=5, reject=0.0)
    np.testing.assert_array_equal(out, plain)
    assert adjusted == plain_adjusted


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_rejection_never_drops_an_honest_majority(n: int) -> None:
    # the farthest half may all be far: reject >= 1 keeps the rows within the median
    rng = _rng()
    stack = np.concatenate(
        [rng.standard_normal(((n + 1) // 2, 256)), 1e6 + rng.standard_normal((n // 2, 256))]
    ).astype(np.float32)
    out, _ = centered_clip(stack, np.ones(n), tau=1.0, iters=5, reject=1.0)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out) < 1e7  # a finite estimate, not the empty set's 0/0


def test_centered_clip_respects_weights() -> None:
    # two clusters, far apart: the heavier one wins whichever the order
    a = np.zeros((2, 64), np.float32)
    b = np.full((2, 64), 100.0, np.float32)
    stack = np.concatenate([a, b])
    out, _ = centered_clip(stack, np.array([5.0, 5.0, 1.0, 1.0]), tau=1.0, iters=20)
    assert np.abs(out).max() < 20.0
    out, _ = centered_clip(stack, np.array([1.0, 1.0, 5.0, 5.0]), tau=1.0, iters=20)
    assert np.abs(out - 100.0).max() < 20.0


def test_identical_copies_give_themselves() -> None:
    stack = np.tile(np.arange(10, dtype=np.float32), (4, 1))
    out, clipped = centered_clip(stack, np.ones(4), 2.0, 5)
    np.testing.assert_array_equal(out, stack[0])
    assert clipped == 0
    np.testing.assert_array_equal(trimmed_mean(stack, np.ones(4), 1), stack[0])


def test_clip_weights_bounds_relative_to_the_median() -> None:
    factors, clipped = clip_weights({0: 1.0, 1: 1.0, 2: 2.0, 3: 1e300}, 10.0)
    assert clipped == 1  # 1e300 counts as 10 x the median weight 1.5
    assert factors == pytest.approx({0: 1 / 15, 1: 1 / 15, 2: 2 / 15, 3: 1.0})
    factors, clipped = clip_weights({0: 1.0, 1: 3.0, 2: 0.0}, 10.0)
    assert clipped == 0
    assert factors == {0: 1 / 3, 1: 1.0, 2: 0.0}
    assert clip_weights({0: 0.0, 1: 0.0}, 10.0) == ({0: 0.0, 1: 0.0}, 0)


# ---- the reducer ----


def _reducer(rule: str, senders: int = 4, size: int = 12, chunk: int = 4) -> PartReducer:
    plan = PartPlan.build([size], chunk)
    return PartReducer(
        plan, 0, np.dtype(np.float32), range(senders), parse_aggregation(rule), weight_bound=10.0
    )


@pytest.mark.parametrize("rule", ["mean", "centered-clip", "trimmed-mean"])
def test_reducer_waits_for_every_weight_and_bounds_a_huge_one(rule: str) -> None:
    reducer = _reducer(rule)
    values = [np.full(12, float(i), np.float32) for i in range(3)] + [np.full(12, 50.0, np.float32)]
    assert reducer.set_weight(0, 1.0) == []
    assert reducer.add(0, 0, values[0][:4]) == []  # waits: other weights unknown
    for s, w in ((1, 1.0), (2, 1.0)):
        assert reducer.set_weight(s, w) == []
    assert reducer.factor(0) is None
    for s in range(1, 3):
        reducer.add(s, 0, values[s][:4])
    assert reducer.set_weight(3, 1e300) == []  # resolves; chunk 0 still misses sender 3
    assert reducer.weights_clipped == 1
    # the mean bounds at 10 x the median, the robust rules at the median
    assert reducer.factor(3) == 1.0
    assert reducer.factor(0) == pytest.approx(0.1 if rule == "mean" else 1.0)
    assert reducer.add(3, 0, values[3][:4]) == [0]
    out, adjusted = reducer.aggregate(0)
    assert out is not None
    assert np.isfinite(out).all()
    if rule == "mean":  # bounded influence: weight 10 against 3 x 1
        np.testing.assert_allclose(out, (0 + 1 + 2 + 10 * 50) / 13, rtol=1e-6)
        assert adjusted == 0
    elif rule == "trimmed-mean":
        np.testing.assert_allclose(out, 1.5)  # the middle two of 0, 1, 2, 50
        assert adjusted == 2 * 4
    else:  # the median distance from the median (1.5) is 2: 50 (97 away) is rejected,
        # then 0 (3 away) is clipped to the radius 2
        assert adjusted == 2
        assert np.abs(out - 1.0).max() < 1.0


@pytest.mark.parametrize("rule", ["centered-clip", "trimmed-mean"])
def test_reducer_renormalises_a_dropped_sender(rule: str) -> None:
    reducer = _reducer(rule, senders=5, size=8)
    for s in range(5):
        reducer.set_weight(s, 1.0)
    for s in range(5):
        reducer.add(s, 0, np.full(4, float(s), np.float32))
    for s in range(4):
        reducer.add(s, 1, np.full(4, float(s), np.float32))
    assert reducer.drop(4) == [1]
    out, _ = reducer.aggregate(1)  # four copies 0..3: symmetric, the answer is 1.5
    np.testing.assert_allclose(out, 1.5)  # type: ignore[arg-type]
    out, _ = reducer.aggregate(0)
    np.testing.assert_allclose(out, 2.0)  # type: ignore[arg-type]


def test_reducer_keeps_copies_not_views() -> None:
    reducer = _reducer("trimmed-mean", senders=2, size=4)
    buffer = np.ones(4, np.float32)
    for s in range(2):
        reducer.set_weight(s, 1.0)
    reducer.add(0, 0, buffer)
    buffer[:] = 7.0  # a reused receive buffer must not change what was taken
    reducer.add(1, 0, np.ones(4, np.float32))
    np.testing.assert_array_equal(reducer.result(0), np.ones(4, np.float32))


@pytest.mark.parametrize("rule", ["centered-clip", "trimmed-mean"])
def test_robust_copies_live_in_the_given_buffer_and_go_back(rule: str) -> None:
    # a pooled buffer of n x the part holds the copies (no array per chunk, no page
    # faults per round); release() hands it back; the results are a fresh buffer's
    plan = PartPlan.build([10], 4)  # chunks of 4, 4, 2
    aggregation = parse_aggregation(rule)
    size = PartReducer.buffer_size(plan, 0, 4, aggregation)
    assert size == 4 * 10
    assert PartReducer.buffer_size(plan, 0, 4, parse_aggregation("mean")) == 0  # holds copies
    rng = np.random.default_rng(5)
    copies = rng.standard_normal((4, 10)).astype(np.float32)
    outcomes = []
    for buffer in (np.full(size, np.nan, np.float32), None):  # stale contents do not matter
        reducer = PartReducer(plan, 0, np.dtype(np.float32), range(4), aggregation, 10.0, buffer)
        for s in range(4):
            reducer.set_weight(s, 1.0)
        for chunk in (2, 0, 1):  # any order
            start, end = plan.chunk_bounds(0, chunk)
            for s in range(4):
                reducer.add(s, chunk, copies[s, start:end].copy())
        outcomes.append([reducer.aggregate(c) for c in range(3)])
        released = reducer.release()
        assert released is not None
        if buffer is not None:
            assert released is buffer
    for (a, adjusted_a), (b, adjusted_b) in zip(*outcomes, strict=True):
        np.testing.assert_array_equal(a, b)  # type: ignore[arg-type]
        assert adjusted_a == adjusted_b


def test_a_combination_in_flight_keeps_the_copies_from_the_next_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # release() during a combination in a worker: the buffer is not handed back (the next
    # round would overwrite copies being read), and no combination starts after it
    started, proceed = threading.Event(), threading.Event()

    def slow_clip(*args: Any) -> tuple[np.ndarray, int]:
        started.set()
        assert proceed.wait(10)
        return centered_clip(*args)

    monkeypatch.setattr(reducer_module, "centered_clip", slow_clip)
    plan = PartPlan.build([8], 4)
    aggregation = parse_aggregation("centered-clip")
    buffer = np.empty(PartReducer.buffer_size(plan, 0, 3, aggregation), np.float32)
    reducer = PartReducer(plan, 0, np.dtype(np.float32), range(3), aggregation, 10.0, buffer)
    for s in range(3):
        reducer.set_weight(s, 1.0)
        for chunk in range(2):
            reducer.add(s, chunk, np.full(4, float(s), np.float32))
    with ThreadPoolExecutor(1) as worker:
        running = worker.submit(reducer.aggregate, 0)
        assert started.wait(10)
        assert reducer.release() is None  # busy: the buffer goes with the combination
        assert reducer.aggregate(1) == (None, 0)  # released: nothing more is combined
        proceed.set()
        out, _ = running.result(timeout=10)
    np.testing.assert_allclose(out, 1.0)  # type: ignore[arg-type]


def test_default_rule_is_the_mean() -> None:
    assert Aggregation().name == "mean"
    assert not Aggregation().robust
