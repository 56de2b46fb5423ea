"""PartReducer: weighted sums, per-chunk finalisation, drops and renormalisation."""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.averaging.aggregation import parse_aggregation
from swarmavg.averaging.allreduce.partition import PartPlan
from swarmavg.averaging.allreduce.reducer import ContributionError, PartReducer, weighted_mean


def _setup(
    senders: list[int], weights: list[float], size: int = 10, chunk: int = 4
) -> tuple[PartPlan, PartReducer]:
    plan = PartPlan.build([size], chunk)
    reducer = PartReducer(plan, 0, np.dtype(np.float32), senders)
    for s, w in zip(senders, weights, strict=True):
        reducer.set_weight(s, w)
    return plan, reducer


def _chunk(plan: PartPlan, data: np.ndarray, c: int) -> np.ndarray:
    lo, hi = plan.chunk_bounds(0, c)
    return data[lo:hi].astype(np.float32)


def test_weighted_mean_in_any_arrival_order() -> None:
    rng = np.random.default_rng(0)
    senders, weights = [0, 1, 2], [1.0, 3.0, 0.5]
    data = [rng.standard_normal(10) for _ in senders]
    plan, reducer = _setup(senders, weights)
    order = [(s, c) for c in range(3) for s in senders]
    rng.shuffle(order)
    finals = []
    for s, c in order:
        finals += reducer.add(s, c, _chunk(plan, data[s], c))
    assert sorted(finals) == [0, 1, 2]
    assert reducer.done
    got = np.concatenate([reducer.result(c) for c in range(3)])  # type: ignore[misc]
    np.testing.assert_allclose(got, weighted_mean(data, weights), rtol=1e-5, atol=1e-6)


def test_chunk_final_only_when_every_live_sender_delivered() -> None:
    _plan, reducer = _setup([0, 1], [1.0, 1.0])
    assert reducer.add(0, 1, np.ones(4, np.float32)) == []
    with pytest.raises(ValueError, match="not final"):
        reducer.result(1)
    assert reducer.add(1, 1, np.full(4, 3.0, np.float32)) == [1]
    np.testing.assert_array_equal(reducer.result(1), np.full(4, 2.0, np.float32))


def test_drop_renormalises_only_chunks_not_delivered() -> None:
    _plan, reducer = _setup([0, 1, 2], [1.0, 1.0, 2.0])
    ones = np.ones(4, np.float32)
    reducer.add(0, 0, ones)
    reducer.add(1, 0, 3 * ones)
    reducer.add(2, 0, 6 * ones)  # chunk 0 final with all three
    reducer.add(0, 1, ones)
    reducer.add(1, 1, 3 * ones)
    assert reducer.drop(2) == [1]  # chunk 1 now has all live senders
    assert reducer.drop(2) == []
    np.testing.assert_allclose(reducer.result(0), (1 + 3 + 12) / 4)
    np.testing.assert_allclose(reducer.result(1), 2.0)
    assert reducer.contributors(0) == 3
    assert reducer.contributors(1) == 2
    with pytest.raises(ContributionError, match="not a live sender"):
        reducer.add(2, 2, np.ones(2, np.float32))


def test_chunk_nobody_delivered_has_no_result() -> None:
    _plan, reducer = _setup([0, 1], [1.0, 1.0])
    reducer.drop(0)
    assert reducer.drop(1) == [0, 1, 2]
    assert reducer.result(0) is None
    assert reducer.contributors(0) == 0


def test_zero_weights() -> None:
    _plan, reducer = _setup([0, 1], [0.0, 2.0])
    reducer.add(0, 0, np.full(4, 100.0, np.float32))
    reducer.add(1, 0, np.full(4, 1.0, np.float32))
    np.testing.assert_array_equal(reducer.result(0), np.ones(4, np.float32))
    _plan, reducer = _setup([0, 1], [0.0, 0.0])
    reducer.add(0, 0, np.full(4, 1.0, np.float32))
    reducer.add(1, 0, np.full(4, 3.0, np.float32))
    np.testing.assert_array_equal(reducer.result(0), np.full(4, 2.0, np.float32))


@pytest.mark.parametrize(
    ("chunk", "values", "match"),
    [
        (3, np.ones(2, np.float32), "out of range"),
        (0, np.ones(3, np.float32), "must be float32"),
        (0, np.ones(4, np.float64), "must be float32"),
        (0, np.array([1, np.nan, 1, 1], np.float32), "NaN"),
        (0, np.array([1, np.inf, 1, 1], np.float32), "NaN"),
    ],
)
def test_invalid_contributions_change_nothing(chunk: int, values: np.ndarray, match: str) -> None:
    _plan, reducer = _setup([0, 1], [1.0, 1.0])
    with pytest.raises(ContributionError, match=match):
        reducer.add(0, chunk, values)
    assert reducer.delivered(0) == 0
    reducer.add(0, 0, np.ones(4, np.float32))
    reducer.add(1, 0, np.ones(4, np.float32))
    np.testing.assert_array_equal(reducer.result(0), np.ones(4, np.float32))


def test_duplicates_unknown_senders_and_bad_weights() -> None:
    plan, reducer = _setup([0, 1], [1.0, 1.0])
    reducer.add(0, 0, np.ones(4, np.float32))
    with pytest.raises(ContributionError, match="duplicate"):
        reducer.add(0, 0, np.ones(4, np.float32))
    with pytest.raises(ContributionError, match="not a live sender"):
        reducer.add(7, 0, np.ones(4, np.float32))
    with pytest.raises(ContributionError, match="already"):
        reducer.set_weight(0, 1.0)
    fresh = PartReducer(plan, 0, np.dtype(np.float32), [0, 1])
    with pytest.raises(ContributionError, match="before its weight"):
        fresh.add(0, 0, np.ones(4, np.float32))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ContributionError, match="weight"):
            fresh.set_weight(0, bad)


def test_float64_accumulation() -> None:
    plan = PartPlan.build([3], 3)
    reducer = PartReducer(plan, 0, np.dtype(np.float64), [0, 1])
    reducer.set_weight(0, 1.0)
    reducer.set_weight(1, 1.0)
    reducer.add(0, 0, np.array([1e300, 1.0, 1 + 2**-50]))
    reducer.add(1, 0, np.array([1e300, 3.0, 1.0]))
    out = reducer.result(0)
    assert out is not None
    assert out.dtype == np.float64
    assert out[0] == 1e300
    assert out[1] == 2.0
    assert out[2] == 1 + 2**-51


def _eager_mean(copies: list[tuple[np.ndarray, float]], weight_sum: float) -> np.ndarray:
    """The mean as the reducer computed it before its arithmetic was deferred: the first
    copy scaled into the accumulator, each later one added in arrival order, then the
    division. The deferred and fused path must give these bits."""
    t = copies[0][0].dtype.type
    acc = copies[0][0] * t(copies[0][1])
    for values, factor in copies[1:]:
        acc += values if factor == 1.0 else values * t(factor)
    return acc / t(weight_sum)  # type: ignore[no-any-return]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("senders", [1, 2, 3, 4, 6])
def test_deferred_mean_has_the_bits_of_the_eager_sum(
    compiled: bool, dtype: type, senders: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not compiled:  # the numpy fallback, used where the kernels are not built
        monkeypatch.setattr("swarmavg.averaging.allreduce.reducer.weighted_sum", _no_kernel)
    rng = np.random.default_rng(senders)
    weights = [1.0, 0.3, 1.0, 2.5, 0.7, 1.0][:senders]
    plan = PartPlan.build([1031], 300)  # ragged last chunk
    reducer = PartReducer(plan, 0, np.dtype(dtype), range(senders))
    data = [(rng.standard_normal(1031) * 10 ** rng.uniform(-3, 3)).astype(dtype) for _ in weights]
    for array in data:
        array.flags.writeable = False  # the reducer must never write a copy it holds
    for s, w in enumerate(weights):
        reducer.set_weight(s, w)
    arrivals: dict[int, list[int]] = {c: [] for c in range(reducer.num_chunks)}
    order = [(s, c) for c in range(reducer.num_chunks) for s in range(senders)]
    rng.shuffle(order)
    for s, c in order:
        lo, hi = plan.chunk_bounds(0, c)
        reducer.add(s, c, data[s][lo:hi])
        arrivals[c].append(s)
    factors = {s: reducer.factor(s) for s in range(senders)}
    for c, senders_in_order in arrivals.items():
        lo, hi = plan.chunk_bounds(0, c)
        copies = [(data[s][lo:hi], factors[s]) for s in senders_in_order]
        expected = _eager_mean(copies, sum(f for _, f in copies))  # type: ignore[misc]
        got, finite = reducer.mean(c)
        assert got is not None
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
        assert finite == compiled  # only the kernel checks as it writes
        with pytest.raises(ValueError, match="taken already"):
            reducer.mean(c)  # the held copies are gone: taken once


def _no_kernel(*args: object) -> None:
    return None


@pytest.mark.parametrize("senders", [2, 3])
def test_an_overflowing_mean_is_not_vouched_finite(senders: int) -> None:
    plan = PartPlan.build([4], 4)
    reducer = PartReducer(plan, 0, np.dtype(np.float32), range(senders))
    for s in range(senders):
        reducer.set_weight(s, 1.0)
        reducer.add(s, 0, np.full(4, 3e38, np.float32))  # finite copies, infinite sum
    values, finite = reducer.mean(0)
    assert values is not None
    assert not finite  # the codec then refuses the chunk
    assert np.isinf(values).all()


def test_mean_of_a_chunk_after_its_sender_dropped_uses_what_arrived() -> None:
    plan = PartPlan.build([8], 4)
    reducer = PartReducer(plan, 0, np.dtype(np.float32), [0, 1, 2])
    for s in range(3):
        reducer.set_weight(s, 1.0)
    for s, value in ((0, 1.0), (1, 2.0), (2, 6.0)):
        reducer.add(s, 0, np.full(4, value, np.float32))
    reducer.add(0, 1, np.full(4, 1.0, np.float32))
    reducer.add(2, 1, np.full(4, 5.0, np.float32))  # two copies held, none summed yet
    assert reducer.drop(1) == [1]
    np.testing.assert_array_equal(reducer.mean(0)[0], np.full(4, 3.0, np.float32))
    np.testing.assert_array_equal(reducer.mean(1)[0], np.full(4, 3.0, np.float32))


def test_mean_is_the_mean_rule_only() -> None:
    plan = PartPlan.build([4], 4)
    rule = parse_aggregation("trimmed-mean")
    reducer = PartReducer(plan, 0, np.dtype(np.float32), [0, 1], rule)
    for s in (0, 1):
        reducer.set_weight(s, 1.0)
        reducer.add(s, 0, np.full(4, float(s), np.float32))
    with pytest.raises(ValueError, match="robust"):
        reducer.mean(0)


def test_a_released_reducer_gives_no_mean() -> None:
    _plan, reducer = _setup([0, 1], [1.0, 1.0])
    reducer.add(0, 0, np.ones(4, np.float32))
    reducer.add(1, 0, np.ones(4, np.float32))
    assert reducer.release() is None  # the mean holds the copies, no buffer of its own
    assert reducer.mean(0) == (None, False)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_deferred_check_leaves_a_bad_copy_out_and_names_its_sender(
    compiled: bool, bad: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``add(defer_check=True)``: the mean checks the copies in the pass that reads them;
    a copy holding NaN/Inf is left out of its chunk (the result is the others' mean, bit
    for bit) and its sender named in ``rejected``, for the round to drop."""
    if not compiled:
        monkeypatch.setattr("swarmavg.averaging.allreduce.reducer.weighted_sum", _no_kernel)
    rng = np.random.default_rng(7)
    plan = PartPlan.build([12], 4)
    weights = [1.0, 2.0, 1.0, 0.5]
    data = [rng.standard_normal(12).astype(np.float32) for _ in weights]
    spoiled = data[2].copy()
    spoiled[5] = bad  # chunk 1
    reducer = PartReducer(plan, 0, np.dtype(np.float32), range(4))
    for s, w in enumerate(weights):
        reducer.set_weight(s, w)
    for c in range(3):
        lo, hi = plan.chunk_bounds(0, c)
        for s in range(4):
            values = (spoiled if s == 2 else data[s])[lo:hi]
            reducer.add(s, c, values, finite=s == 0, defer_check=s != 0)
    factors = {s: reducer.factor(s) for s in range(4)}
    for c in range(3):
        lo, hi = plan.chunk_bounds(0, c)
        kept = [s for s in range(4) if c != 1 or s != 2]
        copies = [(data[s][lo:hi], factors[s]) for s in kept]
        expected = _eager_mean(copies, sum(f for _, f in copies))  # type: ignore[misc]
        got, finite = reducer.mean(c)
        assert got is not None
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
        # checked: by the kernel, or by numpy's path while a copy is unchecked (after a
        # rejection the copies left are checked, and numpy's path does not vouch)
        assert finite == (compiled or c != 1)
        assert reducer.contributors(c) == len(kept)
    assert reducer.rejected == {2: "chunk 1 holds NaN or Inf"}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("word", [0x7C00, 0x7E00], ids=["inf", "nan"])
def test_float16_copies_are_averaged_as_their_decoded_values(
    compiled: bool, word: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Codec float16's words reach the float32 reducer as float16 values, unchecked: the
    mean has the bits of averaging the decoded copies, a copy with an Inf/NaN word is left
    out and its sender named (the check deferred into the mean, as for codec none), and a
    robust rule and a weight-0 sender take them as decoded values too."""
    if not compiled:
        monkeypatch.setattr("swarmavg.averaging.allreduce.reducer.weighted_sum", _no_kernel)
    rng = np.random.default_rng(11)
    plan = PartPlan.build([12], 4)
    weights = [1.0, 2.0, 0.5, 1.5]
    words = [rng.standard_normal(12).astype(np.float16) for _ in weights]
    spoiled = words[3].copy()
    spoiled.view(np.uint16)[9] = word  # chunk 2
    own = rng.standard_normal(12).astype(np.float32)
    reducer = PartReducer(plan, 0, np.dtype(np.float32), range(5))
    for s, w in enumerate([1.0, *weights]):
        reducer.set_weight(s, w)
    for c in range(3):
        lo, hi = plan.chunk_bounds(0, c)
        reducer.add(0, c, own[lo:hi], finite=True)
        for s in range(1, 5):
            values = (spoiled if s == 4 else words[s - 1])[lo:hi]
            reducer.add(s, c, values, defer_check=True)
    factors = {s: reducer.factor(s) for s in range(5)}
    for c in range(3):
        lo, hi = plan.chunk_bounds(0, c)
        kept = [s for s in range(5) if c != 2 or s != 4]
        decoded = [own[lo:hi]] + [w[lo:hi].astype(np.float32) for w in words]
        copies = [(decoded[s], factors[s]) for s in kept]
        expected = _eager_mean(copies, sum(f for _, f in copies))  # type: ignore[misc]
        got, _ = reducer.mean(c)
        assert got is not None
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
    assert reducer.rejected == {4: "chunk 2 holds NaN or Inf"}

    trimmed = parse_aggregation("trimmed-mean")
    robust = PartReducer(plan, 0, np.dtype(np.float32), range(3), trimmed)
    reference = PartReducer(plan, 0, np.dtype(np.float32), range(3), trimmed)
    for r in (robust, reference):
        for s in range(3):
            r.set_weight(s, 1.0)
    for s in range(3):
        lo, hi = plan.chunk_bounds(0, 0)
        robust.add(s, 0, words[s][lo:hi], defer_check=True)
        reference.add(s, 0, words[s][lo:hi].astype(np.float32))
    assert_bits = np.testing.assert_array_equal
    assert_bits(robust.result(0), reference.result(0))  # type: ignore[arg-type]
    with pytest.raises(ContributionError, match="NaN or Inf"):  # robust: checked at once
        robust.add(0, 1, spoiled[8:12].copy(), defer_check=True)

    zero = PartReducer(plan, 0, np.dtype(np.float32), [0, 1])
    zero.set_weight(0, 0.0)
    zero.set_weight(1, 0.0)
    zero.add(0, 0, words[0][:4], defer_check=True)
    zero.add(1, 0, words[1][:4], defer_check=True)
    got, _ = zero.mean(0)
    expected = (words[0][:4].astype(np.float32) + words[1][:4]) / np.float32(2)
    assert got is not None
    assert_bits(got.view(np.uint8), expected.view(np.uint8))
    wide = PartReducer(plan, 0, np.dtype(np.float64), [0])
    wide.set_weight(0, 1.0)
    with pytest.raises(ContributionError, match="must be float64"):  # float16 widens to f32 only
        wide.check(0, 0, words[0][:4])


def test_a_deferred_check_never_rejects_a_checked_copy() -> None:
    """A NaN in a copy the caller vouched for (this member's own, with ``none``) spoils
    the mean, which is then not vouched finite: the codec refuses it, nobody is named."""
    plan = PartPlan.build([4], 4)
    reducer = PartReducer(plan, 0, np.dtype(np.float32), [0, 1])
    for s in (0, 1):
        reducer.set_weight(s, 1.0)
    reducer.add(0, 0, np.full(4, np.nan, np.float32), finite=True)
    reducer.add(1, 0, np.ones(4, np.float32), defer_check=True)
    values, finite = reducer.mean(0)
    assert values is not None
    assert not finite
    assert reducer.rejected == {}
    assert reducer.contributors(0) == 2


def test_a_deferred_check_of_every_copy_failing_gives_no_mean() -> None:
    plan = PartPlan.build([4], 4)
    reducer = PartReducer(plan, 0, np.dtype(np.float32), [0, 1])
    for s in (0, 1):
        reducer.set_weight(s, 1.0)
    for s in (0, 1):
        reducer.add(s, 0, np.full(4, np.inf, np.float32), defer_check=True)
    assert reducer.mean(0) == (None, False)
    assert sorted(reducer.rejected) == [0, 1]
    assert reducer.contributors(0) == 0


def test_an_overflow_of_unchecked_finite_copies_names_nobody() -> None:
    plan = PartPlan.build([4], 4)
    reducer = PartReducer(plan, 0, np.dtype(np.float32), [0, 1])
    for s in (0, 1):
        reducer.set_weight(s, 1.0)
    for s in (0, 1):
        reducer.add(s, 0, np.full(4, 3e38, np.float32), defer_check=True)
    values, finite = reducer.mean(0)
    assert values is not None
    assert np.isinf(values).all()
    assert not finite
    assert reducer.rejected == {}


@pytest.mark.parametrize("case", ["robust", "weights unknown", "weight zero"])
def test_a_check_that_cannot_be_deferred_is_made_at_once(case: str) -> None:
    """Robust rules compare copies, a copy that waits for the weights is taken later, and a
    weight-0 copy is summed apart: each is checked as it arrives, deferral or not."""
    plan = PartPlan.build([4], 4)
    rule = parse_aggregation("trimmed-mean" if case == "robust" else "mean")
    reducer = PartReducer(plan, 0, np.dtype(np.float32), [0, 1], rule)
    reducer.set_weight(0, 0.0 if case == "weight zero" else 1.0)
    if case != "weights unknown":
        reducer.set_weight(1, 1.0)
    with pytest.raises(ContributionError, match="NaN or Inf"):
        reducer.add(0, 0, np.full(4, np.nan, np.float32), defer_check=True)
    assert reducer.delivered(0) == 0
