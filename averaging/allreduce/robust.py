"""Robust combination of the senders' copies of one chunk (numpy and compiled kernels, no I/O).

The reducer of a part calls these once every sender's copy of a chunk arrived
(:mod:`~swarmavg.averaging.allreduce.reducer`), with the copies stacked as the rows of
one ``(n, m)`` array in the reduction dtype (float32, or float64 for float64 layouts)
and the senders' weights. Everything is vectorised over the chunk's ``m`` coordinates;
the loops run over senders or iterations only. The rules and their parameters:
:mod:`swarmavg.averaging.aggregation`.

Sorting each coordinate's ``n`` copies is the costly step (``np.sort`` along the short
axis is about 50x a sum for ``n = 4``), so equal weights, the common case, go through a
sorting network of elementwise ``minimum``/``maximum`` instead (Batcher's odd-even merge
sort, Knuth TAOCP vol. 3, 5.3.4), pruned to the comparators the wanted rows (the median's
two, the trimmed mean's middle) depend on. With unequal weights the trimmed mean ranks
each value by pairwise comparisons instead of carrying weights through the network.
CenteredClip's cost after the median is one float32 BLAS product per block of coordinates
(:func:`_gram`). Per 1 MiB chunk that made CenteredClip 2x (4 copies) to 3x (8 copies)
cheaper than sorting fully and forming the Gram matrix in float64 (thread CPU per chunk,
both in one process).

Where the compiled kernels are built (:mod:`swarmavg.compression.native`), contiguous
float32/float64 copies of at most :data:`_NETWORK_MAX` senders skip numpy's pass per
operation: CenteredClip is one tiled pass for the median (the same comparators, the same
bits) and the Gram matrix of ``x_i - median``, then one for the result
(``compression/_native.c``, ``median_gram`` and ``combine``); the trimmed mean of equal
weights is one pass with numpy's bits (``trimmed``), and so is the trimmed mean of unequal
weights (``trimmed_weighted``: ranks by pairwise comparison, then the weighted sums). The
numpy code below stays the reference (tests/averaging/allreduce/test_robust_native.py) and the
fallback: more senders, other layouts, builds without the kernels, and Gram matrices
that overflow (float32 products beyond 3.4e38, which the numpy path rescales). Only the
part's reducer combines and every member receives its encoded result, so members with and
without the kernels still end bit-identical.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from swarmavg.compression.native import kernels as native
from swarmavg.compression.native import takes

__all__ = ["centered_clip", "selected_rows", "sorted_copies", "trimmed_mean", "weighted_median"]

_NETWORK_MAX = 32
"""Above this many senders ``np.sort`` beats the network's ~n log^2 n passes."""


_GRAM_BLOCK = 8192
"""Coordinates per block of :func:`_gram`: each block's products are summed by BLAS in the
copies' dtype, the blocks' sums in float64."""


def _gram(diff: np.ndarray) -> np.ndarray:
    """The Gram matrix ``diff @ diff.T`` (float64) of the ``(n, m)`` rows of ``diff``.

    Converting the copies to float64 for one product costs 10-30x the product itself
    (``np.einsum(..., dtype=float64)``: 4 ms for 4 rows of 256 Ki float32, 60 ms for 8);
    one float32 product over all ``m`` coordinates loses 6 digits (relative error 5e-7).
    Blocks of :data:`_GRAM_BLOCK` coordinates, each one batched BLAS product, summed in
    float64, keep the error near 3e-8 at the cost of the float32 product (0.7 / 2 ms).
    """
    n, m = diff.shape
    whole = m - m % _GRAM_BLOCK
    gram = np.zeros((n, n), dtype=np.float64)
    if whole:  # a view (no copy even when m is not a multiple): (blocks, n, _GRAM_BLOCK)
        row, item = diff.strides
        blocks = np.lib.stride_tricks.as_strided(
            diff,
            shape=(whole // _GRAM_BLOCK, n, _GRAM_BLOCK),
            strides=(_GRAM_BLOCK * item, row, item),
            writeable=False,
        )
        gram += np.matmul(blocks, blocks.transpose(0, 2, 1)).sum(axis=0, dtype=np.float64)
    if whole < m:
        rest = diff[:, whole:]
        gram += rest @ rest.T
    return gram


@functools.cache
def _batcher_pairs(n: int) -> tuple[tuple[int, int], ...]:
    """Comparators of Batcher's odd-even merge sort for ``n`` inputs (``i < j``).

    Built for the next power of two; a comparator touching an index ``>= n`` would compare
    with a +inf pad and change nothing, so it is left out.
    """
    size = 1 << max(n - 1, 0).bit_length()
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n:
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def sorted_copies(stack: np.ndarray) -> np.ndarray:
    """A new array: each column of ``stack`` (``(n, m)``) sorted ascending."""
    n = stack.shape[0]
    if n > _NETWORK_MAX:
        return np.sort(stack, axis=0)
    out = stack.copy()
    low = np.empty_like(out[0])
    for i, j in _batcher_pairs(n):
        np.minimum(out[i], out[j], out=low)
        np.maximum(out[i], out[j], out=out[j])
        out[i] = low
    return out


@functools.cache
def _selection_pairs(n: int, rows: tuple[int, ...]) -> tuple[tuple[int, int, bool, bool], ...]:
    """The comparators of :func:`_batcher_pairs` that the output ``rows`` depend on, each
    as ``(i, j, keep_min, keep_max)``: whether its minimum (to ``i``) and its maximum (to
    ``j``) are read later. Walking the network backwards from the wanted outputs drops
    every comparator they do not depend on."""
    needed = set(rows)
    kept = []
    for i, j in reversed(_batcher_pairs(n)):
        keep_min, keep_max = i in needed, j in needed
        if keep_min or keep_max:
            kept.append((i, j, keep_min, keep_max))
            needed |= {i, j}
    return tuple(reversed(kept))


def selected_rows(stack: np.ndarray, rows: tuple[int, ...]) -> list[np.ndarray]:
    """Rows ``rows`` of :func:`sorted_copies` of ``stack`` (in that order), computing only
    the compare-exchanges they depend on (the median of 8: 17 of the 19, 6 of them
    one-sided). The first comparator on a row reads it from ``stack`` and writes a work
    row, so nothing is copied for its own sake. The rows may be views of ``stack``."""
    n = stack.shape[0]
    if n > _NETWORK_MAX:
        ordered = np.sort(stack, axis=0)
        return [ordered[r] for r in rows]
    current = list(stack)  # row i's values so far: a row of stack until a comparator wrote it
    work = np.empty((n + 1, stack.shape[1]), dtype=stack.dtype)
    spare = list(work)  # rows of `work` not holding anything now
    owned = [False] * n
    for i, j, keep_min, keep_max in _selection_pairs(n, rows):
        a, b = current[i], current[j]
        if keep_min and keep_max:  # elementwise: writing an input of the same call is exact
            low, high = spare.pop(), b if owned[j] else spare.pop()
            np.minimum(a, b, out=low)
            np.maximum(a, b, out=high)
            if owned[i]:
                spare.append(a)
            current[i], current[j] = low, high
            owned[i] = owned[j] = True
        elif keep_min:
            current[i] = np.minimum(a, b, out=a if owned[i] else spare.pop())
            owned[i] = True
        else:
            current[j] = np.maximum(a, b, out=b if owned[j] else spare.pop())
            owned[j] = True
    return [current[r] for r in rows]


def _sorted_with_weights(stack: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each column of ``stack`` sorted, with the weight of each value carried along (the
    network's compare-exchanges move weights with values); argsort above the network."""
    n = stack.shape[0]
    if n > _NETWORK_MAX:
        order = np.argsort(stack, axis=0, kind="stable")
        return np.take_along_axis(stack, order, axis=0), weights[order].astype(stack.dtype)
    values = stack.copy()
    carried = np.repeat(weights.astype(stack.dtype)[:, None], stack.shape[1], axis=1)
    low = np.empty_like(values[0])
    swap = np.empty(stack.shape[1], dtype=bool)
    for i, j in _batcher_pairs(n):
        np.greater(values[i], values[j], out=swap)
        np.minimum(values[i], values[j], out=low)
        np.maximum(values[i], values[j], out=values[j])
        values[i] = low
        w_i = carried[i].copy()
        np.copyto(carried[i], carried[j], where=swap)
        np.copyto(carried[j], w_i, where=swap)
    return values, carried


def _equal(weights: np.ndarray) -> bool:
    return bool(np.all(weights == weights[0]))


def _effective(weights: np.ndarray) -> np.ndarray:
    """The weights as float64; all zero (no one asked for influence) counts as equal."""
    w = np.asarray(weights, dtype=np.float64)
    return np.ones_like(w) if not np.any(w > 0) else w


_COMPILED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_NO_PAIRS = np.empty(0, dtype=np.int32)


@functools.cache
def _pairs_array(n: int, rows: tuple[int, ...]) -> np.ndarray:
    """:func:`_selection_pairs` as the compiled kernels take them: int32 ``i, j, ...``."""
    flat = [index for i, j, _, _ in _selection_pairs(n, rows) for index in (i, j)]
    return np.array(flat, dtype=np.int32)


def _compiled(stack: np.ndarray, name: str) -> Callable[..., None] | None:
    """The compiled kernel ``name`` when it applies to ``stack``: the kernels are in use
    (``native``: tests switch them off), have it (an older build may not), and read
    ``stack``'s buffer; at most :data:`_NETWORK_MAX` copies (above, numpy sorts)."""
    if (
        native is None
        or stack.dtype not in _COMPILED_DTYPES
        or not 1 <= stack.shape[0] <= _NETWORK_MAX
        or not takes(stack)
    ):
        return None
    kernel: Callable[..., None] | None = getattr(native, name, None)
    return kernel


def weighted_median(stack: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per column of ``stack`` (``(n, m)``), the weighted median of its ``n`` values.

    The value at which the cumulative weight crosses half the total; when it reaches
    exactly half at a value, the midpoint of that value and the next (so equal weights
    give ``np.median``). Zero-weight rows count only when every weight is zero.
    """
    w = _effective(weights)
    n = stack.shape[0]
    if _equal(w):
        lower, upper = selected_rows(stack, ((n - 1) // 2, n // 2))
    else:
        ordered, carried = _sorted_with_weights(stack, w)
        half = w.sum() / 2
        lower, upper = np.empty_like(ordered[0]), np.empty_like(ordered[0])
        cumulative = np.zeros(stack.shape[1], dtype=np.float64)
        found_lower = np.zeros(stack.shape[1], dtype=bool)
        found_upper = np.zeros(stack.shape[1], dtype=bool)
        for row in range(n):  # the first value at which the half is reached / passed
            cumulative += carried[row]
            at_lower = ~found_lower & (cumulative >= half * (1 - 1e-12))
            at_upper = ~found_upper & (cumulative > half * (1 + 1e-12))
            np.copyto(lower, ordered[row], where=at_lower)
            np.copyto(upper, ordered[row], where=at_upper)
            found_lower |= at_lower
            found_upper |= at_upper
    out: np.ndarray = lower + (upper - lower) * stack.dtype.type(0.5)
    return out


def centered_clip(
    stack: np.ndarray, weights: np.ndarray, tau: float, iters: int, reject: float = 0.0
) -> tuple[np.ndarray, int]:
    """CenteredClip of the rows of ``stack`` (``(n, m)``) with weights ``weights``.

    Starting from the coordinate-wise median ``v``, iterate
    ``v <- v + sum_i w_i clip(x_i - v) / sum_i w_i``, where ``clip(d)`` scales ``d`` to a
    norm of at most ``r = tau * median_i ||x_i - v_0||`` (Gorbunov et al. 2022, BTARD,
    algorithm "CenteredClip"; the radius is relative, see
    :mod:`swarmavg.averaging.aggregation`). At most ``iters`` iterations; it stops early
    when the estimate came from an iteration that clipped nothing and clips nothing
    itself, since it is then the weighted mean and a fixed point. With ``reject > 0``,
    rows farther than ``reject * median_i ||x_i - v_0||`` from ``v_0`` first lose their
    weight: they neither pull the estimate nor count in its denominator.

    Every iterate is ``v_0 + sum_i a_i (x_i - v_0)``, so the iterations run on the
    coefficients ``a`` and the Gram matrix of the ``x_i - v_0`` (float64): one pass over
    the copies for the Gram matrix and one for the result, whatever ``iters`` is.

    Returns:
        The combined row (``stack``'s dtype) and how many rows were rejected or clipped by
        the last iteration.
    """
    w = _effective(weights)
    total = w.sum()
    positive = w > 0
    compiled = _compiled_start_and_gram(stack)
    diff: np.ndarray | None = None
    if compiled is not None:
        start, gram = compiled
    else:
        # The start only has to be robust, not weighted: the plain median is as robust
        # (the weights are bounded by their median) and the fixed point of the
        # iteration, which carries the weights, does not depend on it; sorting without
        # weights costs a third.
        start = weighted_median(stack, np.ones_like(w))
        diff = stack - start
        with np.errstate(over="ignore", invalid="ignore"):
            gram = _gram(diff)
        if not np.isfinite(gram).all():  # copies near the dtype's range: units of the largest
            unit = float(np.abs(diff).max())
            gram = _gram(diff / diff.dtype.type(unit))
    a, clipped = _clip_coefficients(gram, w, total, positive, tau, iters, reject)
    if diff is None:
        out = np.empty_like(start)
        combine = _compiled(stack, "combine")
        assert combine is not None  # the same build gave the start and the Gram matrix
        combine(stack, stack.shape[0], start, a, stack.dtype.itemsize, out)
        return out, clipped
    out = start + np.einsum("i,ij->j", a.astype(stack.dtype), diff)
    return out, clipped


def _compiled_start_and_gram(stack: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """CenteredClip's start (the median) and the Gram matrix of ``stack - start`` in one
    compiled pass, or ``None`` where the kernel does not apply or the Gram matrix is not
    finite (differences from the median beyond about 1.8e19 in float32, 1.3e154 in
    float64, whose products overflow: the numpy path rescales them).

    The median has the bits of :func:`weighted_median` with equal weights (the same
    comparators); the Gram matrix sums the products in partial sums of 16 per coordinate
    in the copies' dtype, then in float64 (within 1e-6 of the exact one relative to its
    entries' Cauchy-Schwarz bound, as tests/averaging/allreduce/test_robust_native.py checks).
    """
    median_gram = _compiled(stack, "median_gram")
    if median_gram is None or _compiled(stack, "combine") is None:
        return None
    n, m = stack.shape
    rows = ((n - 1) // 2, n // 2)
    start = np.empty(m, dtype=stack.dtype)
    gram = np.empty((n, n), dtype=np.float64)
    median_gram(stack, n, _pairs_array(n, rows), *rows, stack.dtype.itemsize, start, gram)
    return (start, gram) if np.isfinite(gram).all() else None


def _clip_coefficients(
    gram: np.ndarray,
    w: np.ndarray,
    total: float,
    positive: np.ndarray,
    tau: float,
    iters: int,
    reject: float,
) -> tuple[np.ndarray, int]:
    """CenteredClip's iterations on the coefficients ``a`` of ``v = v_0 + sum_i a_i d_i``
    given the Gram matrix of the ``d_i = x_i - v_0``: the final ``a`` and how many rows
    were rejected or clipped by the last iteration (see :func:`centered_clip`)."""
    norms = np.diag(gram).copy()
    from_start = np.sqrt(np.maximum(norms, 0.0))  # ||d_i||
    spread = float(np.median(from_start[positive]))
    radius = tau * spread
    rejected = 0
    if reject > 0.0 and spread > 0.0:
        # At most half the rows lie beyond the median distance (reject >= 1), so at least
        # one positive weight stays; with a zero spread every row is clipped to v_0 anyway.
        far = positive & (from_start > reject * spread)
        rejected = int(np.count_nonzero(far))
        if rejected:
            w = np.where(far, 0.0, w)
            positive = positive & ~far
            total = float(w.sum())
    a = np.zeros(len(w))
    clipped = 0
    previous_clipped = -1
    for _ in range(iters):
        # ||d_j - u||^2 with u = sum_i a_i d_i: ||d_j||^2 - 2 (G a)_j + a^T G a
        ga = gram @ a
        distances = np.sqrt(np.maximum(norms - 2 * ga + a @ ga, 0.0))
        outside = distances > radius
        clipped_now = int(np.count_nonzero(outside & positive))
        if clipped_now == 0 and previous_clipped == 0:
            break  # the estimate is the weighted mean and nothing is clipped at it
        scale = np.ones_like(distances)
        np.divide(radius, distances, out=scale, where=outside)
        c = w * scale / total
        a = a * (1.0 - c.sum()) + c  # u <- u + sum_i c_i (d_i - u)
        clipped = previous_clipped = clipped_now
    return a, rejected + clipped


def trimmed_mean(stack: np.ndarray, weights: np.ndarray, trim_per_side: int) -> np.ndarray:
    """Per column of ``stack`` (``(n, m)``): drop the ``trim_per_side`` smallest and
    largest values, then the weighted mean of the rest (plain mean where their weights
    are all zero). Equal values are ranked by row, as a stable sort ranks them: which of
    two equal values is dropped matters when their weights differ.

    Raises:
        ValueError: ``2 * trim_per_side >= n`` (nothing would be left).
    """
    n = stack.shape[0]
    k = trim_per_side
    if not 0 <= 2 * k < n:
        raise ValueError(f"cannot trim {k} per side of {n} values")
    w = _effective(weights)
    dtype = stack.dtype.type
    out: np.ndarray
    if _equal(w):
        trimmed = _compiled(stack, "trimmed")
        if trimmed is not None:  # the same comparators and sums: the same bits
            out = np.empty(stack.shape[1], dtype=stack.dtype)
            pairs = _pairs_array(n, tuple(range(k, n - k))) if k else _NO_PAIRS  # rows as given
            trimmed(stack, n, pairs, k, n - k, stack.dtype.itemsize, out)
            return out
        middle = selected_rows(stack, tuple(range(k, n - k))) if k else list(stack)
        out = middle[0].copy()
        for row in middle[1:]:
            out += row
        out /= dtype(n - 2 * k)
        return out
    weighted = _compiled(stack, "trimmed_weighted")
    if weighted is not None:  # the same ranks and sums: the same bits
        out = np.empty(stack.shape[1], dtype=stack.dtype)
        weighted(stack, n, k, w.astype(stack.dtype), stack.dtype.itemsize, out)
        return out
    kept = _kept_by_rank(stack, k) if k else np.ones(stack.shape, dtype=bool)
    return _weighted_average(stack, w.astype(stack.dtype), kept, n - 2 * k)


def _kept_by_rank(stack: np.ndarray, k: int) -> np.ndarray:
    """``(n, m)`` booleans: whether each value is neither among the ``k`` smallest nor the
    ``k`` largest of its column, ties ranked by row (so exactly ``n - 2k`` per column).

    Ranks from the ``n (n - 1) / 2`` pairwise comparisons: for 4 to 8 senders a fraction of
    sorting the values with their weights carried along (which moves every weight with
    every compare-exchange).
    """
    n, m = stack.shape
    rank = np.zeros((n, m), dtype=np.uint8 if n < 256 else np.int32)
    before = np.empty(m, dtype=bool)
    for i in range(n):
        for j in range(i + 1, n):
            np.less_equal(stack[i], stack[j], out=before)  # i sorts before j (a tie: by row)
            rank[j] += before
            np.logical_not(before, out=before)
            rank[i] += before
    kept: np.ndarray = (rank >= k) & (rank < n - k)
    return kept


def _weighted_average(
    stack: np.ndarray, weights: np.ndarray, kept: np.ndarray, count: int
) -> np.ndarray:
    """Per column, the ``weights``-weighted mean of the ``count`` kept values; their plain
    mean where the kept values' weights are all zero."""
    m = stack.shape[1]
    weighted, total, plain = (np.zeros(m, dtype=stack.dtype) for _ in range(3))
    indicator, product = np.empty(m, dtype=stack.dtype), np.empty(m, dtype=stack.dtype)
    for row, weight, keep in zip(stack, weights, kept, strict=True):
        # products with a 0/1 indicator: numpy's masked (where=) operations cost 20-30x
        np.copyto(indicator, keep)
        np.multiply(row, indicator, out=product)
        plain += product
        product *= weight
        weighted += product
        indicator *= weight
        total += indicator
    dtype = stack.dtype.type
    combined: np.ndarray = np.where(
        total > 0, weighted / np.where(total > 0, total, dtype(1)), plain / dtype(count)
    )
    return combined


def trimmed_values(senders: int, trim_per_side: int, size: int) -> int:
    """How many values the trimmed mean drops from a chunk of ``size`` coordinates."""
    return 2 * trim_per_side * size if senders > 2 * trim_per_side else 0


def clip_weights(weights: dict[int, float], bound_factor: float) -> tuple[dict[int, float], int]:
    """Bound each weight by ``bound_factor`` times the median of the positive weights.

    Returns the clipped weights rescaled to a maximum of 1 (so that the reducer's
    accumulator sums copies times factors in [0, 1] and a weight of 1e300 cannot overflow
    it), and how many weights were clipped. Zero weights stay zero; ratios between the
    unclipped weights are kept exactly.
    """
    positive = [w for w in weights.values() if w > 0]
    if not positive:
        return dict(weights), 0
    bound = bound_factor * float(np.median(positive))
    clipped = {s: min(w, bound) for s, w in weights.items()}
    count = sum(1 for s, w in weights.items() if w > bound)
    top = max(clipped.values())  # > 0: some weight is positive, and all are finite
    return {s: (w / top if w > 0 else 0.0) for s, w in clipped.items()}, count
