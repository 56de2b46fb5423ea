"""The fast encoding paths of ``scaled-float16`` and ``uint8-quantile`` agree with their
general, checked paths (which the fast paths replace only where that is safe)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmavg.compression import CodecInfo, decode_chunk, get_codec
from swarmavg.compression import floating as fl

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_F16_MIN_NORMAL = 2.0**-14


def _both_paths(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Words from the fast and the checked scaled-float16 paths, and |z| per element."""
    stats = fl._RowStats(x)
    stds = np.sqrt(stats.squares / x.shape[1]).astype(np.float32)
    scales = np.where(stds > 0, stds, np.float32(1)).astype(np.float32)
    inverse = (np.float32(1) / scales).astype(np.float32)
    fast = np.empty(x.size, np.uint16)
    checked = np.empty(x.size, np.uint16)
    fl._encode_scaled_fast(x, stats.means, inverse * fl._TWO_M112, fast)
    fl._encode_scaled_checked(x, stats.means, inverse, checked)
    z = np.abs((x - stats.means[:, None]) * inverse[:, None]).reshape(-1)
    return fast, checked, z


def _assert_same_words(fast: np.ndarray, checked: np.ndarray, z: np.ndarray) -> None:
    # Identical wherever z is a binary16 normal. Below 2**-14 the fast path rounds
    # twice (float32 subnormal, then binary16): at most one binary16 subnormal apart.
    normal = z >= _F16_MIN_NORMAL
    np.testing.assert_array_equal(fast[normal], checked[normal])
    diff = np.abs(fast.astype(np.int32) - checked.astype(np.int32))
    assert np.all(diff[~normal] <= 1)


rows32 = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 6), st.integers(1, 300)),
    elements=st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32),
)


@SETTINGS
@given(x=rows32)
@example(x=np.array([[0.0, 1e-30, -1e-30, 3.0, 3.0]], np.float32))
@example(x=np.full((2, 7), 5.0, np.float32))
@example(x=np.array([[1.0, 1.0000001, 1.0, 1.0]], np.float32))
def test_scaled_fast_path_matches_checked_path(x: np.ndarray) -> None:
    stats = fl._RowStats(x)
    stds = np.sqrt(stats.squares / x.shape[1]).astype(np.float32)
    inverse = np.float32(1) / np.where(stds > 0, stds, np.float32(1)).astype(np.float32)
    if not fl._fast_path_safe(stats, inverse.astype(np.float32)):
        return  # std above 2**14: the encoder takes the checked path
    _assert_same_words(*_both_paths(x))


@pytest.mark.parametrize(
    ("shape", "seed"), [((1, 200_000), 0), ((3, 70_000), 1), ((400, 500), 2), ((7, 65_536), 3)]
)
def test_scaled_fast_path_matches_on_large_rows(shape: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(3, shape) * 10.0 ** rng.uniform(-3, 3, (shape[0], 1))).astype(np.float32)
    x[:, ::97] = 0.0
    _assert_same_words(*_both_paths(x))


def test_long_row_statistics_match_a_float64_reference() -> None:
    """Segments are combined exactly: mean and std agree with float64 to float32 rounding."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 300_001)) * [[1e-3], [50.0]] + [[1e3], [-7.0]]).astype(np.float32)
    stats = fl._RowStats(x)
    ref = x.astype(np.float64)
    np.testing.assert_allclose(stats.means, ref.mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(np.sqrt(stats.squares / x.shape[1]), ref.std(axis=1), rtol=1e-5)
    assert np.all(stats.spread >= np.abs(ref - stats.means[:, None].astype(np.float64)).max(axis=1))


def test_scaled_huge_spread_takes_the_checked_path_and_round_trips() -> None:
    x = (np.random.default_rng(5).standard_normal(10_000) * 1e6).astype(np.float32)
    stats = fl._RowStats(x.reshape(1, -1))
    inverse = np.float32(1) / np.sqrt(stats.squares / x.size).astype(np.float32)
    assert not fl._fast_path_safe(stats, inverse)
    y = decode_chunk(get_codec("scaled-float16").encode(x, CodecInfo()))
    assert np.abs(y - x).max() <= 2.0**-10 * np.abs(x).max()


def test_scaled_fast_path_refuses_rows_whose_bound_is_too_large() -> None:
    stats = fl._RowStats(np.zeros((1, 4), np.float32))
    stats.spread[:] = 40_000.0  # as if |x - mean| could reach 40,000 std
    assert not fl._fast_path_safe(stats, np.ones(1, np.float32))
    stats.spread[:] = 30_000.0
    assert fl._fast_path_safe(stats, np.ones(1, np.float32))
