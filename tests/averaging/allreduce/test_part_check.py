"""The member-side check of averaged parts (averaging/allreduce/part_check.py), as a pure
rule: honest rounds of realistic shapes refuse nothing, forged parts are refused, and what
passes is what the docs say passes."""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np
import pytest

from swarmavg.averaging.allreduce.part_check import (
    DEFAULT_FACTOR,
    DeviationTally,
    PartDeviation,
    forged_parts,
    mean_absolute_deviation,
)

Values = Callable[[np.random.Generator, int, np.ndarray], np.ndarray]


def _layered(rng: np.random.Generator, size: int) -> np.ndarray:
    """Per-element scales of a vector made of layers whose scales differ up to e^4."""
    cuts = np.sort(rng.choice(np.arange(1, size), 7, replace=False))
    scales = np.exp(rng.normal(0.0, 2.0, 8))
    return np.concatenate(
        [np.full(len(s), c) for s, c in zip(np.split(np.arange(size), cuts), scales, strict=True)]
    )


SHAPES: dict[str, Values] = {
    "gaussian": lambda rng, n, signal: rng.standard_normal(n),
    "shared-signal": lambda rng, n, signal: signal + 0.5 * rng.standard_normal(n),
    "student-t-2": lambda rng, n, signal: rng.standard_t(2, n),
    "student-t-3": lambda rng, n, signal: rng.standard_t(3, n),
    "member-scales": lambda rng, n, signal: rng.standard_normal(n) * rng.lognormal(0.0, 1.0),
    "one-percent-non-zero": lambda rng, n, signal: np.where(
        rng.random(n) < 0.01, rng.standard_normal(n), 0.0
    ),
    "nearly-identical": lambda rng, n, signal: signal + 1e-7 * rng.standard_normal(n),
}


def _deviations(
    result: np.ndarray, own: np.ndarray, parts: int, chunk: int = 1000
) -> dict[int, PartDeviation]:
    deviations = {}
    for p, (res, mine) in enumerate(
        zip(np.array_split(result, parts), np.array_split(own, parts), strict=True)
    ):
        tally = DeviationTally()
        for start in range(0, mine.size, chunk):
            tally.add(res[start : start + chunk], mine[start : start + chunk])
        deviation = tally.result()
        assert deviation is not None
        deviations[p] = deviation
    return deviations


def _refused(
    result: np.ndarray, own: np.ndarray, parts: int, trusted: int, chunk: int = 1000
) -> dict[int, str]:
    """What a member holding ``own`` refuses of ``result``, both cut in ``parts``, as the
    runner asks it: rms deviations, then zeros and mean absolute ones on demand."""
    results, owns = np.array_split(result, parts), np.array_split(own, parts)

    def confirm(asked: Collection[int]) -> dict[int, PartDeviation]:
        return {p: mean_absolute_deviation([(results[p], owns[p])]) for p in asked}

    return forged_parts(
        _deviations(result, own, parts, chunk),
        {trusted},
        zeros=lambda p: float(np.mean(owns[p] == 0)),
        confirm=confirm,
    )


def _honest_round(
    rng: np.random.Generator, shape: str, members: int, size: int
) -> list[np.ndarray]:
    signal = rng.standard_normal(size)
    scales = _layered(rng, size)
    return [(SHAPES[shape](rng, size, signal) * scales).astype(np.float32) for _ in range(members)]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_honest_rounds_refuse_nothing(shape: str) -> None:
    """Parts of 6,000 elements and more (a part is a share of a model: usually far more);
    in smaller ones a 1%-non-zero slice can hold no non-zero value of this member."""
    rng = np.random.default_rng(7)
    for members in range(2, 9):
        for _ in range(3):
            size = int(rng.integers(6000 * members, 200_000))
            values = _honest_round(rng, shape, members, size)
            average = np.mean(values, axis=0).astype(np.float32)
            for i, own in enumerate(values):
                refused = _refused(average, own, members, i)
                assert refused == {}, (members, i, refused)


def test_a_part_where_this_member_has_only_zeros_is_not_refused() -> None:
    """A sparse embedding slice its batch did not touch: the relative distance is
    infinite there, the absolute one like the other parts'."""
    rng = np.random.default_rng(8)
    for members in range(2, 9):
        values = [rng.standard_normal(40000).astype(np.float32) for _ in range(members)]
        values[0][np.array_split(np.arange(40000), members)[0]] = 0.0  # all of part 0
        average = np.mean(values, axis=0).astype(np.float32)
        deviations = _deviations(average, values[0], members)
        assert deviations[0].relative == np.inf
        assert _refused(average, values[0], members, members - 1) == {}
        # the same distances where this member's values are not zeros: refused
        assert list(forged_parts(deviations, {members - 1})) == [0]


FORGED: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "1e6": lambda average: np.full_like(average, 1e6),
    "reversed-4x": lambda average: -4.0 * average,
    "noise-30x": lambda average: (
        30.0 * np.abs(average).mean() * np.sign(np.sin(np.arange(average.size)))
    ),
}


@pytest.mark.parametrize("forgery", list(FORGED))
@pytest.mark.parametrize("members", [2, 3, 4, 8])
def test_a_forged_part_is_refused(forgery: str, members: int) -> None:
    """Gradients with a shared signal; the last part forged; member 0 checks, its own part
    (0) trusted. In a group of two the trusted part is the only reference."""
    rng = np.random.default_rng(9)
    values = _honest_round(rng, "shared-signal", members, 30000)
    average = np.mean(values, axis=0).astype(np.float32)
    parts = np.array_split(np.arange(average.size), members)
    forged = average.copy()
    forged[parts[-1]] = FORGED[forgery](average[parts[-1]])
    refused = _refused(forged, values[0], members, 0)
    assert list(refused) == [members - 1]
    assert "beyond 8 x" in refused[members - 1]
    assert "mean absolute" in refused[members - 1]


def test_what_passes() -> None:
    """The bound, not more: an echo of the member's own values, and a part moved by less
    than ``factor`` honest distances, are accepted."""
    rng = np.random.default_rng(10)
    values = _honest_round(rng, "gaussian", 4, 20000)
    average = np.mean(values, axis=0).astype(np.float32)
    own = values[0]
    last = np.array_split(np.arange(own.size), 4)[-1]
    echoed = average.copy()
    echoed[last] = own[last]
    assert _refused(echoed, own, 4, 0) == {}
    honest = _deviations(average, own, 4)
    within = average.copy()
    step = 0.5 * DEFAULT_FACTOR * honest[3].deviation
    within[last] = own[last] + step * np.sign(average[last] - own[last])
    assert _refused(within, own, 4, 0) == {}


def test_trusted_parts_and_lone_parts_are_never_refused() -> None:
    near = PartDeviation(deviation=1.0, scale=1.0)
    far = PartDeviation(deviation=1e6, scale=1.0)
    assert forged_parts({0: far}) == {}  # nothing to compare with
    assert forged_parts({0: far, 1: near}, {0}) == {}
    assert list(forged_parts({0: near, 1: far}, {0})) == [1]
    # a colluding majority of the other parts moves the median
    assert forged_parts({0: near, 1: far, 2: far}, {0}) == {}


def test_near_zero_distances_do_not_trigger() -> None:
    exact = PartDeviation(deviation=0.0, scale=1.0)
    rounding = PartDeviation(deviation=1e-7, scale=1.0)
    assert forged_parts({0: exact, 1: exact, 2: rounding}) == {}


def test_tally_is_the_sum_of_its_chunks_in_any_order() -> None:
    rng = np.random.default_rng(11)
    result = rng.standard_normal(5000).astype(np.float32)
    own = rng.standard_normal(5000).astype(np.float32)
    whole, pieces = DeviationTally(), DeviationTally()
    whole.add(result, own)
    for start in (4000, 0, 2500, 1000):
        end = {4000: 5000, 0: 1000, 2500: 4000, 1000: 2500}[start]
        pieces.add(result[start:end], own[start:end])
    a, b = whole.result(), pieces.result()
    assert a is not None
    assert b is not None
    assert a.deviation == pytest.approx(np.sqrt(np.mean((result - own) ** 2)), rel=1e-5)
    assert a.scale == pytest.approx(np.sqrt(np.mean(own.astype(np.float64) ** 2)), rel=1e-5)
    assert (a.deviation, a.scale) == pytest.approx((b.deviation, b.scale), rel=1e-5)
    assert DeviationTally().result() is None


def test_tally_gives_the_mean_absolute_distance_and_the_share_of_zeros() -> None:
    rng = np.random.default_rng(12)
    own = rng.standard_normal(3001).astype(np.float32)
    own[::3] = 0.0
    result = (own + rng.standard_normal(3001)).astype(np.float32)
    tally = DeviationTally()
    tally.add(result[:1000], own[:1000])
    tally.add(result[1000:], own[1000:])
    absolute = tally.mean_absolute()
    assert absolute.deviation == pytest.approx(np.mean(np.abs(result - own)), rel=1e-6)
    assert absolute.scale == pytest.approx(np.mean(np.abs(own)), rel=1e-6)
    assert tally.zeros() == pytest.approx(1001 / 3001)
    assert DeviationTally().zeros() == 0.0
    assert DeviationTally().mean_absolute() == PartDeviation(0.0, 0.0)


def test_tally_measures_a_tiny_distance_from_large_values() -> None:
    """Averages a millionth away from this member's values of about 1,000 (parameters
    right after an average, a codec's rounding): the distance is summed itself, not
    formed as r.r - 2 r.o + o.o, whose float32 rounding is a thousand times larger."""
    rng = np.random.default_rng(13)
    own = (1000.0 + rng.standard_normal(1 << 16)).astype(np.float32)
    result = own + np.float32(1e-3) * rng.choice([-1, 1], own.size).astype(np.float32)
    tally = DeviationTally()
    tally.add(result, own)
    deviation = tally.result()
    assert deviation is not None
    exact = np.sqrt(np.mean((result.astype(np.float64) - own) ** 2))
    assert deviation.deviation == pytest.approx(exact, rel=1e-3)


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="factor"):
        forged_parts({}, factor=1.0)
    with pytest.raises(ValueError, match="1-D"):
        DeviationTally().add(np.zeros(3, np.float32), np.zeros(4, np.float32))


def test_a_concentrated_forgery_is_bounded_by_its_total_absolute_change() -> None:
    """A few values forged far off move the rms, not the mean absolute distance: they pass
    while their total absolute change stays within ``factor`` honest parts' (the bound the
    docs state), and are refused beyond it."""
    rng = np.random.default_rng(12)
    values = _honest_round(rng, "gaussian", 4, 40000)
    average = np.mean(values, axis=0).astype(np.float32)
    own = values[0]
    last = np.array_split(np.arange(own.size), 4)[-1]
    honest = mean_absolute_deviation([(average[last], own[last])])
    few = last[:10]
    inside = average.copy()
    inside[few] = own[few] + 0.5 * DEFAULT_FACTOR * honest.deviation * last.size / few.size
    assert _refused(inside, own, 4, 0) == {}
    beyond = average.copy()
    beyond[few] = own[few] + 4 * DEFAULT_FACTOR * honest.deviation * last.size / few.size
    assert list(_refused(beyond, own, 4, 0)) == [3]
