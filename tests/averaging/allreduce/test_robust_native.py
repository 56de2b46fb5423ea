"""The compiled robust kernels (compression/_native.c: ``median_gram``, ``combine``,
``trimmed``, ``trimmed_weighted``) against the numpy code of averaging/allreduce/robust.py
they replace.

Each robust combination runs on one reducer and its result is sent to every member, so
the two paths need not give the same bits for members to end bit-identical; they must
give the same answer. The contract checked here:

- the trimmed mean, equal or unequal weights: the same bits (the same comparators or
  ranks, and the same sums in the same order);
- CenteredClip: the same median bits, the same clipped count, and a result within
  ``1e-6`` (float32) / ``1e-12`` (float64) of the largest copy's magnitude (the compiled
  Gram matrix is a float64 sum of float32 products in partial sums of 512 coordinates,
  the numpy one a float32 BLAS product per 8192; the combination is formed in float64).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest

from swarmavg.averaging.allreduce import robust
from swarmavg.compression.native import kernels

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        kernels is None or not hasattr(kernels, "median_gram"), reason="robust kernels not built"
    ),
]

T = TypeVar("T")

# Not a multiple of the kernels' 32-coordinate tile nor of their 16-tile partial sums,
# and more than one of numpy's 8192-coordinate Gram blocks.
SIZES = (1, 31, 513, 20481)
TOLERANCE = {np.float32: 1e-6, np.float64: 1e-12}


def numpy_path(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with the compiled kernels switched off in robust.py."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(robust, "native", None)
        return fn(*args)


def copies(n: int, size: int, dtype: type, seed: int = 3) -> np.ndarray:
    """``n`` honest copies around a common offset, the last one an attacker (-10x)."""
    rng = np.random.default_rng(seed + n)
    stack = (rng.standard_normal((n, size)) + 5.0).astype(dtype)
    if n > 2:
        stack[-1] *= -10.0
    return stack


def test_the_compiled_path_is_taken() -> None:
    stack = copies(4, 513, np.float32)
    assert robust._compiled(stack, "median_gram") is not None
    assert robust._compiled(stack, "trimmed") is not None
    assert robust._compiled_start_and_gram(stack) is not None
    assert robust._compiled(stack.astype(np.float16), "trimmed") is None
    assert robust._compiled(stack[:, ::2], "trimmed") is None  # not contiguous: numpy
    assert robust._compiled(copies(33, 16, np.float32), "trimmed") is None  # numpy sorts


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", range(1, 17))
def test_centered_clip_matches_numpy(n: int, dtype: type) -> None:
    unequal = 1.0 + np.arange(n) % 3
    for size in SIZES:
        stack = copies(n, size, dtype)
        scale = float(np.abs(stack).max())
        for weights in (np.ones(n), unequal):
            for tau in (0.5, 2.0):  # away from tau = 1, where 2 copies tie with the radius
                got, clipped = robust.centered_clip(stack, weights, tau, 5)
                ref, ref_clipped = numpy_path(robust.centered_clip, stack, weights, tau, 5)
                assert got.dtype == ref.dtype == dtype
                assert clipped == ref_clipped, (size, tau)
                error = float(np.abs(got.astype(np.float64) - ref).max()) / scale
                assert error <= TOLERANCE[dtype], (size, tau, error)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13, 16, 32])
def test_compiled_median_has_the_numpy_bits(n: int, dtype: type) -> None:
    stack = copies(n, 1000, dtype)
    stack[:, :100] = np.round(stack[:, :100])  # ties
    compiled = robust._compiled_start_and_gram(stack)
    assert compiled is not None
    start, gram = compiled
    expected = numpy_path(robust.weighted_median, stack, np.ones(n))
    np.testing.assert_array_equal(start, expected)
    diff = stack.astype(np.float64) - start
    exact = diff @ diff.T
    # relative to the entries' Cauchy-Schwarz bound: off-diagonal sums cancel
    bound = np.sqrt(np.outer(np.diag(exact), np.diag(exact)))
    assert (np.abs(gram - exact) <= TOLERANCE[dtype] * bound).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16, 32])
def test_trimmed_mean_has_the_numpy_bits(n: int, dtype: type) -> None:
    for size in SIZES:
        stack = copies(n, size, dtype)
        stack[:, : size // 3] = np.round(stack[:, : size // 3])  # ties
        for k in range((n + 1) // 2):
            got = robust.trimmed_mean(stack, np.ones(n), k)
            ref = numpy_path(robust.trimmed_mean, stack, np.ones(n), k)
            assert got.dtype == dtype
            np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))


@pytest.mark.skipif(
    kernels is None or not hasattr(kernels, "trimmed_weighted"), reason="an older build"
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16, 32])
def test_weighted_trimmed_mean_has_the_numpy_bits(n: int, dtype: type) -> None:
    for size in SIZES:
        stack = copies(n, size, dtype)
        stack[:, : size // 3] = np.round(stack[:, : size // 3])  # ties: dropped by row
        unequal = 1.0 + np.arange(n) % 3
        some_zero = np.where(np.arange(n) < n // 2, 0.0, unequal)  # kept sets of weight 0
        for weights in (unequal, some_zero):
            for k in range((n + 1) // 2):
                got = robust.trimmed_mean(stack, weights, k)
                ref = numpy_path(robust.trimmed_mean, stack, weights, k)
                assert got.dtype == dtype
                np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_copies_near_the_range_fall_back_to_the_rescaled_numpy_path(dtype: type) -> None:
    # float32 products of 1e30 overflow (float64 ones beyond 1e154): the kernel's Gram
    # matrix is not finite, so the numpy path rescales; the answer is the numpy one.
    huge = 1e30 if dtype is np.float32 else 1e200
    stack = copies(4, 4096, dtype)
    stack[-1] = huge
    assert robust._compiled_start_and_gram(stack) is None
    got, clipped = robust.centered_clip(stack, np.ones(4), 2.0, 5)
    ref, ref_clipped = numpy_path(robust.centered_clip, stack, np.ones(4), 2.0, 5)
    assert np.isfinite(got).all()
    assert clipped == ref_clipped == 1
    np.testing.assert_array_equal(got, ref)
    # large but with finite products: the compiled path, the same answer
    stack[-1] = huge**0.5 / 10
    assert robust._compiled_start_and_gram(stack) is not None
    got, clipped = robust.centered_clip(stack, np.ones(4), 2.0, 5)
    ref, ref_clipped = numpy_path(robust.centered_clip, stack, np.ones(4), 2.0, 5)
    assert clipped == ref_clipped == 1
    assert float(np.abs(got - ref).max()) <= TOLERANCE[dtype] * float(np.abs(stack).max())


def test_an_older_build_without_the_kernels_uses_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    stack = copies(5, 777, np.float32)
    expected = robust.centered_clip(stack, np.ones(5), 1.0, 5)
    older = types.SimpleNamespace(any_alignment=kernels.any_alignment if kernels else 1)
    monkeypatch.setattr(robust, "native", older)
    got = robust.centered_clip(stack, np.ones(5), 1.0, 5)
    assert got[1] == expected[1]
    np.testing.assert_allclose(got[0], expected[0], rtol=0, atol=1e-6 * np.abs(stack).max())
    trimmed = robust.trimmed_mean(stack, np.ones(5), 1)
    monkeypatch.setattr(robust, "native", None)
    np.testing.assert_array_equal(trimmed, robust.trimmed_mean(stack, np.ones(5), 1))


def test_the_kernels_refuse_inconsistent_arguments() -> None:
    assert kernels is not None
    stack = copies(4, 64, np.float32)
    pairs = robust._pairs_array(4, (1, 2))
    median, gram, out = np.empty(64, np.float32), np.empty((4, 4)), np.empty(64, np.float32)
    bad_pairs = np.array([0, 4], dtype=np.int32)
    with pytest.raises(ValueError, match="out of range"):
        kernels.median_gram(stack, 4, bad_pairs, 1, 2, 4, median, gram)
    with pytest.raises(ValueError, match="out of range"):
        kernels.trimmed(stack, 4, bad_pairs, 1, 3, 4, out)
    with pytest.raises(ValueError, match="multiple of the rows"):
        kernels.median_gram(stack, 3, pairs, 1, 1, 4, median, gram)
    with pytest.raises(ValueError, match="len\\(gram\\)"):
        kernels.median_gram(stack, 4, pairs, 1, 2, 4, median, np.empty(4))
    with pytest.raises(ValueError, match="len\\(coeffs\\)"):
        kernels.combine(stack, 4, median, np.ones(3), 4, out)
    with pytest.raises(ValueError, match="first < last"):
        kernels.trimmed(stack, 4, pairs, 2, 2, 4, out)
    with pytest.raises(ValueError, match=r"1\.\.32 rows"):
        kernels.trimmed(np.empty((33, 2), np.float32), 33, pairs, 0, 1, 4, np.empty(2, np.float32))
    with pytest.raises(ValueError, match="itemsize"):
        kernels.combine(stack, 4, median, np.ones(4), 2, out)
    if hasattr(kernels, "trimmed_weighted"):
        with pytest.raises(ValueError, match="2k < n"):
            kernels.trimmed_weighted(stack, 4, 2, np.ones(4, np.float32), 4, out)
        with pytest.raises(ValueError, match="len\\(weights\\)"):
            kernels.trimmed_weighted(stack, 4, 1, np.ones(3, np.float32), 4, out)
