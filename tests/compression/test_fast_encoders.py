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
from swarmavg.compression import quantization as qz
from swarmavg.compression.kernels import sample

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


# --- uint8-quantile: borders snapped to a uniform grid of cells ---


def _quantile_parts(x: np.ndarray) -> tuple[np.ndarray, qz._SnappedTable]:
    smp = np.sort(sample(x))
    picks = np.minimum((qz._BORDER_PROBS * smp.size).astype(np.int64), smp.size - 1)
    borders = np.unique(smp[picks])
    cells = int(min(1 << 16, max(256, x.size // 4)))
    below, above = qz._TAIL_SPLITS + 1, borders.size - qz._TAIL_SPLITS - 1
    return borders, qz._SnappedTable(borders, cells, below, above)


def _exact_codes(borders: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.searchsorted(borders, x, side="right")


distributions = st.sampled_from(["normal", "t3", "lognormal", "sparse", "offset", "uniform"])


def _draw(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "t3":
        x = rng.standard_t(3, n)
    elif kind == "lognormal":
        x = rng.lognormal(0, 3, n) * rng.choice([-1, 1], n)
    elif kind == "sparse":
        x = np.where(rng.random(n) < 0.7, 0.0, rng.standard_normal(n))
    elif kind == "offset":
        x = 1000.0 + rng.standard_normal(n) * 1e-2
    else:
        x = rng.uniform(-5, 5, n)
    return x.astype(np.float32)


@SETTINGS
@given(kind=distributions, n=st.integers(1_100, 40_000), seed=st.integers(0, 2**32 - 1))
def test_snapped_codes_differ_from_exact_only_just_below_a_border(
    kind: str, n: int, seed: int
) -> None:
    x = _draw(kind, n, seed)
    borders, table = _quantile_parts(x)
    if not table.usable:
        return  # the encoder uses the exact table
    snapped = table.codes_of(x)
    streamed = np.empty(x.size, np.uint8)
    tail_codes, tail_values = table.encode(x, streamed)  # the codec's slab-wise path
    np.testing.assert_array_equal(streamed, snapped)
    tails = (snapped < table.below) | (snapped > table.above)
    np.testing.assert_array_equal(tail_codes, snapped[tails])
    np.testing.assert_array_equal(tail_values, x[tails])
    exact = _exact_codes(borders, x)
    moved = snapped != exact
    # Only values just below a border move, up by one code, into the border's cell.
    assert np.all(snapped[moved] == exact[moved] + 1)
    below = borders[exact[moved]]
    assert np.all(x[moved] < below)
    cells = np.empty(x.size, np.uint16)
    table.cells_of(x, cells, np.empty(x.size, np.float32))
    border_cells = np.empty(below.size, np.uint16)
    table.cells_of(below, border_cells, np.empty(below.size, np.float32))
    np.testing.assert_array_equal(cells[moved], border_cells)
    # Every value at or above a border is coded above it, as with exact borders.
    assert np.all(snapped >= exact)
    order = np.argsort(x, kind="stable")
    assert np.all(np.diff(snapped[order].astype(np.int32)) >= 0)  # monotone in x


@pytest.mark.parametrize("kind", ["normal", "t3", "lognormal", "sparse", "uniform"])
def test_quantile_fast_path_is_as_accurate_as_exact_borders(kind: str) -> None:
    """200,000 elements (the whole tensor is the sample): the codec's error is within
    0.5% of coding with the exact borders and every bin's exact mean."""
    x = _draw(kind, 200_000, 7)
    if kind == "lognormal":
        x = np.cbrt(x)  # still heavy-tailed, but a range the grid can resolve
    borders, table = _quantile_parts(x)
    assert table.usable
    assert table.exact_tails == (kind == "uniform")  # tail splits narrower than a cell
    y = decode_chunk(get_codec("uint8-quantile").encode(x, CodecInfo())).astype(np.float64)
    x64 = x.astype(np.float64)
    exact = _exact_codes(borders, x)
    counts = np.bincount(exact, minlength=256)
    means = np.bincount(exact, weights=x64, minlength=256) / np.maximum(counts, 1)
    reference = float(((means[exact] - x64) ** 2).sum())
    assert float(((y - x64) ** 2).sum()) <= 1.005 * reference


def test_quantile_outer_bins_hold_the_exact_means_of_their_elements() -> None:
    x = _draw("t3", 1_000_000, 8)  # sampled: the body's bin means are estimates
    enc = get_codec("uint8-quantile").encode_payload(x, CodecInfo())
    codes = np.frombuffer(enc.payload, np.uint8)
    codebook = np.frombuffer(enc.header.meta["codebook"], np.float32)
    borders, table = _quantile_parts(x)
    assert table.usable
    outer = [c for c in range(256) if c <= qz._TAIL_SPLITS or c >= borders.size - qz._TAIL_SPLITS]
    for c in outer:
        members = x[codes == c].astype(np.float64)
        if members.size:
            assert codebook[c] == np.float32(members.mean())


def test_quantile_concentrated_borders_use_the_exact_table() -> None:
    """All body borders in a few grid cells (a huge outlier stretches the range): the
    snapped table would merge bins, so codes come from the exact borders."""
    x = (1.0 + np.random.default_rng(9).standard_normal(100_000) * 1e-6).astype(np.float32)
    x[:30] = 1e6
    x[30:60] = -1e6
    borders, table = _quantile_parts(x)
    assert not table.usable
    msg = get_codec("uint8-quantile").encode(x, CodecInfo())
    np.testing.assert_array_equal(
        np.frombuffer(msg.buffer, np.uint8), _exact_codes(borders, x).astype(np.uint8)
    )


@pytest.mark.parametrize("shape", [(0, 100), (100, 0), (0,), (2, 0, 64)])
def test_scaled_empty_tensors_round_trip(shape: tuple[int, ...]) -> None:
    x = np.zeros(shape, np.float32)
    y = decode_chunk(get_codec("scaled-float16").encode(x, CodecInfo()))
    assert y.shape == shape
    assert y.dtype == np.float32
