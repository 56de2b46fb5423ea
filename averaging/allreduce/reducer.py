"""Combination of one part, chunk by chunk (pure logic of the reducer side).

The reducer of part ``j`` receives every sender's copy of each chunk of part ``j``. A chunk
is *final* as soon as every sender that is still live has delivered it; its result combines
the copies of the senders that delivered that chunk, so a dropped sender's weight is
renormalised away only for the chunks it did not deliver (docs/averaging.md, "Failures").

How copies combine is the group's aggregation rule (:mod:`swarmavg.averaging.aggregation`):

- ``mean`` holds each sender's copy of a chunk (a view of the caller's tensors or of a
  received message, or a decoded array) until the chunk is final, then writes
  ``sum w_i x_i / sum w_i`` in one pass over the copies that also checks the result for
  NaN/Inf (``weighted_sum``, :mod:`~swarmavg.compression.native`): each copy is read
  once and the result written once, where
  adding each copy into an accumulator as it arrived read and wrote the accumulator once
  per copy, and dividing and checking it took two more passes. The operations and their
  order are those of the accumulation (arrival order, each rounded in the reduction
  dtype), so the bits are the same. When every delivering sender has weight 0, the chunk
  is the plain mean of their copies.
  A received copy may come unchecked (``add(..., defer_check=True)``: ``none`` hands the
  message's bytes as they came, ``float16`` its words, as float16 values the kernel widens
  exactly where it adds them): a finite result vouches for every copy (a NaN or an Inf
  times a weight stays one, and sums keep it), and only a non-finite result has its
  unchecked copies checked one by one; a copy holding NaN/Inf is then left out of the
  chunk's mean and its sender named in :attr:`PartReducer.rejected`, for the caller to
  drop, as a chunk that fails on arrival drops its sender.
- the robust rules (``centered-clip``, ``trimmed-mean``) keep each sender's copy of a chunk
  until the chunk is final, then combine them (:mod:`~swarmavg.averaging.allreduce.robust`).
  The copies live in one buffer of ``n`` times the part (chunk ``c``'s ``(n, size)`` rows
  at ``n * start(c)``, contiguous): a robust rule writes each copy there, and fresh
  arrays per chunk would cost a page fault per 4 KiB on first touch, round after round
  (7x the mean's faults per 64 MB round at 4 peers); one buffer can come from the
  service's pool. The mean writes nothing but its results and needs no buffer.

Weights are bounded relative to the group: once every
sender's weight is known (each sender's first message carries it, before its first
chunk), a weight above ``weight_bound`` times the median of the senders' positive weights
is clipped to that bound (the robust rules bound every weight by the median itself, so
that a minority of members never holds most of the weight), and every weight is rescaled
to at most 1, so the mean sums copies times factors in [0, 1] and no finite weight can
overflow it. Chunks that arrive before the last weight is known wait (the weights'
median is not known yet); none of them could be final before anyway.

Errors in a contribution raise :class:`ContributionError` before anything is
accumulated (a deferred check aside, see above); the caller then drops that sender.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from swarmavg.averaging.aggregation import CENTERED_CLIP, Aggregation
from swarmavg.averaging.allreduce.partition import PartPlan
from swarmavg.averaging.allreduce.robust import (
    centered_clip,
    clip_weights,
    trimmed_mean,
    trimmed_values,
)
from swarmavg.compression.kernels import all_finite
from swarmavg.compression.native import weighted_sum

_HALF = np.dtype(np.float16)

DEFAULT_WEIGHT_BOUND = 10.0
"""A sender's weight counts as at most this many times the median weight of its part."""


class ContributionError(ValueError):
    """A sender's chunk is invalid (wrong index, size, dtype, a duplicate, NaN/Inf)."""


class HeldCopy(NamedTuple):
    """A sender's copy of a chunk, held by the mean until the chunk is final."""

    sender: int
    values: np.ndarray
    factor: float
    """The sender's bounded weight (> 0)."""
    checked: bool
    """Whether the values were checked for NaN/Inf (else the mean's pass checks them)."""


class PartReducer:
    """Combines the senders' chunks of one part and finalises chunks in any order.

    Not thread-safe: call it from one thread (the event loop, or one worker at a time).
    The one exception is :meth:`aggregate` of a final chunk, which reads only that chunk's
    copies and may run in a worker while the loop adds chunks that are not final.
    """

    def __init__(
        self,
        plan: PartPlan,
        part: int,
        dtype: np.dtype,
        senders: Iterable[int],
        aggregation: Aggregation | None = None,
        weight_bound: float = DEFAULT_WEIGHT_BOUND,
        accumulator: np.ndarray | None = None,
    ):
        """Prepare an empty reducer for ``part`` of ``plan``.

        Args:
            plan: the round's partition.
            part: which part this reducer owns.
            dtype: reduction dtype (float32 or float64).
            senders: group indices of every member expected to contribute.
            aggregation: the group's rule; ``None``: the weighted mean.
            weight_bound: for the mean, weights above this many times the median
                positive weight of the part's senders are clipped to it (>= 1); the
                robust rules clip at the median.
            accumulator: for a robust rule, memory for the copies (:meth:`buffer_size`
                elements, any contents), e.g. a reused buffer; ``None``: a new one.
                :meth:`release` hands it back. The mean needs none.
        """
        self.plan = plan
        self.part = part
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError("reduction dtype must be float32 or float64")
        if not (np.isfinite(weight_bound) and weight_bound >= 1.0):
            raise ValueError(f"weight_bound must be finite and >= 1, got {weight_bound}")
        self.aggregation = aggregation if aggregation is not None else Aggregation()
        self.weight_bound = float(weight_bound)
        self.num_chunks = plan.num_chunks(part)
        self._robust = self.aggregation.robust
        # float16 copies (codec float16's words as received) widen exactly to float32:
        # every rule takes them as they are (numpy and the mean's kernel widen them).
        self._value_dtypes = (self.dtype, _HALF) if self.dtype == np.float32 else (self.dtype,)
        senders = list(senders)
        size = self.buffer_size(plan, part, len(set(senders)), self.aggregation)
        if accumulator is not None and (accumulator.shape != (size,) or accumulator.dtype != dtype):
            accumulator = None  # not this part's shape: a new one
        # No zero-fill: a robust rule writes every copy it reads.
        self._acc = accumulator if accumulator is not None else np.empty(size, dtype=self.dtype)
        self._released = False
        self._zero_acc: np.ndarray | None = None  # plain sums from weight-0 senders
        # mean: per chunk, the copies of weight > 0 in arrival order, until mean()
        self._held: dict[int, list[HeldCopy]] = {}
        self._taken = np.zeros(self.num_chunks, dtype=bool)  # mean() returned the result
        self._zero_count = np.zeros(self.num_chunks, dtype=np.int64)
        self._delivered = np.zeros(self.num_chunks, dtype=np.int64)  # copies per chunk
        self._have: dict[int, np.ndarray] = {s: np.zeros(self.num_chunks, bool) for s in senders}
        if not self._have:
            raise ValueError("a part needs at least one sender")
        self._row = {s: i for i, s in enumerate(sorted(self._have))}
        self._live = set(self._have)
        self._weights: dict[int, float] = {}
        self._factors: dict[int, float] | None = None  # bounded weights, set once all known
        self._pending: list[tuple[int, int, np.ndarray]] = []  # chunks before that
        self._copies: dict[int, np.ndarray] = {}  # robust: chunk -> (senders, size) rows
        # robust: combinations reading the copies now (in workers); release() hands the
        # buffer back only when none is, and no combination starts after it
        self._combining = 0
        self._combining_lock = threading.Lock()
        self._final = np.zeros(self.num_chunks, dtype=bool)
        self.weights_clipped = 0
        """How many senders' weights exceeded the bound (known once weights resolved)."""
        self.rejected: dict[int, str] = {}
        """Senders whose copy of a chunk failed the check deferred into the mean (the copy
        was left out), with the reason: the caller drops them."""

    @staticmethod
    def buffer_size(plan: PartPlan, part: int, senders: int, aggregation: Aggregation) -> int:
        """Elements of the reducer's buffer: ``senders`` times the part (a robust rule's
        copies), or 0 (the mean holds the copies themselves)."""
        return plan.part_size(part) * senders if aggregation.robust else 0

    @property
    def live_senders(self) -> frozenset[int]:
        return frozenset(self._live)

    @property
    def done(self) -> bool:
        """Whether every chunk is final."""
        return bool(self._final.all())

    def is_final(self, chunk: int) -> bool:
        return bool(self._final[chunk])

    def delivered(self, sender: int) -> int:
        """How many chunks ``sender`` delivered so far."""
        return int(self._have[sender].sum())

    def set_weight(self, sender: int, weight: float) -> list[int]:
        """Record ``sender``'s weight; must precede its first :meth:`add`.

        Returns chunks that became final (possible once the last weight is known and the
        chunks that waited for it are combined).
        """
        if sender not in self._live:
            raise ContributionError(f"member {sender} is not a live sender of this part")
        if sender in self._weights:
            raise ContributionError(f"member {sender} already announced its weight")
        if not (np.isfinite(weight) and weight >= 0.0):
            raise ContributionError(f"weight must be finite and >= 0, got {weight}")
        self._weights[sender] = float(weight)
        return self._resolve_weights()

    def factor(self, sender: int) -> float | None:
        """``sender``'s bounded weight relative to the largest (in [0, 1]); ``None`` until
        every live sender announced its weight."""
        return None if self._factors is None else self._factors.get(sender)

    def check(self, sender: int, chunk: int, values: np.ndarray, *, finite: bool = False) -> None:
        """Raise :class:`ContributionError` unless ``add(sender, chunk, values)`` is valid.

        ``finite=True`` says the caller already checked ``values`` for NaN/Inf.
        """
        if sender not in self._live:
            raise ContributionError(f"member {sender} is not a live sender of this part")
        if sender not in self._weights:
            raise ContributionError(f"member {sender} sent data before its weight")
        if not 0 <= chunk < self.num_chunks:
            raise ContributionError(f"chunk index {chunk} out of range 0..{self.num_chunks - 1}")
        if self._have[sender][chunk]:
            raise ContributionError(f"duplicate chunk {chunk} from member {sender}")
        start, end = self.plan.chunk_bounds(self.part, chunk)
        if values.dtype not in self._value_dtypes or values.shape != (end - start,):
            raise ContributionError(
                f"chunk {chunk} must be {self.dtype}[{end - start}], "
                f"got {values.dtype}{list(values.shape)}"
            )
        if not finite and not all_finite(values):
            raise ContributionError(f"chunk {chunk} holds NaN or Inf")

    def add(
        self,
        sender: int,
        chunk: int,
        values: np.ndarray,
        *,
        finite: bool = False,
        defer_check: bool = False,
    ) -> list[int]:
        """Take ``sender``'s copy of ``chunk``; return chunks that became final.

        ``finite=True`` skips the NaN/Inf check when the caller already made it (the
        codec's decoder, for codecs that check their output). ``defer_check=True`` lets
        the mean make it in the pass that reads the copy for the chunk's result (where
        the rule is the mean, and ``sender``'s weight is known and positive; otherwise
        at once): a copy found holding NaN/Inf is then left out of that result and its
        sender named in :attr:`rejected`. ``values`` is kept until the chunk's result is
        computed: the caller must not reuse its buffer for other data before then
        (decoded chunks are fresh arrays or views of one message; this member's own copy
        is its tensors, whose chunk is written only with that result).

        Raises:
            ContributionError: see :meth:`check`; nothing is accumulated then.
        """
        if self._released:
            raise ContributionError("the round is over")
        factors = self._factors
        deferred = (
            defer_check
            and not finite
            and not self._robust
            and factors is not None
            and factors.get(sender, 0.0) > 0.0
        )
        self.check(sender, chunk, values, finite=finite or deferred)
        self._have[sender][chunk] = True
        self._delivered[chunk] += 1
        if factors is None:
            self._pending.append((sender, chunk, values))
            return []
        self._take(factors[sender], sender, chunk, values, checked=not deferred)
        return self._finalise([chunk])

    def _take(
        self, weight: float, sender: int, chunk: int, values: np.ndarray, checked: bool = True
    ) -> None:
        """Hold (mean) or keep (robust) one copy with its bounded weight."""
        start, end = self.plan.chunk_bounds(self.part, chunk)
        if self._robust:
            rows = self._copies.get(chunk)
            if rows is None:
                n = len(self._row)
                rows = self._copies[chunk] = self._acc[n * start : n * end].reshape(n, end - start)
            rows[self._row[sender]] = values
            return
        if weight > 0.0:
            # Never written to: `values` may be a view of the caller's data or of a message.
            self._held.setdefault(chunk, []).append(HeldCopy(sender, values, weight, checked))
        else:
            if self._zero_acc is None:
                self._zero_acc = np.zeros(self.plan.part_size(self.part), dtype=self.dtype)
            self._zero_acc[start:end] += values
            self._zero_count[chunk] += 1

    def _resolve_weights(self) -> list[int]:
        """Once every live sender announced its weight: bound them, take the waiting chunks."""
        if self._factors is not None or not self._live <= self._weights.keys():
            return []
        if self._released:  # the buffer is no longer ours: take nothing into it
            return []
        # A rule robust to a minority of members must be robust to their weight claims
        # too: there a weight counts as at most the median, so members above it can
        # never outweigh the others (with 10 x the median, one member of four holds 10/13).
        bound = 1.0 if self._robust else self.weight_bound
        factors, self.weights_clipped = clip_weights(self._weights, bound)
        self._factors = factors
        pending, self._pending = self._pending, []
        for sender, chunk, values in pending:
            self._take(factors[sender], sender, chunk, values)
        return self._finalise(range(self.num_chunks))

    def drop(self, sender: int) -> list[int]:
        """Stop waiting for ``sender``; return chunks that became final. Idempotent."""
        if sender not in self._live:
            return []
        self._live.discard(sender)
        return self._resolve_weights() or self._finalise(range(self.num_chunks))

    def _finalise(self, candidates: Iterable[int]) -> list[int]:
        newly = []
        for chunk in candidates:
            if self._final[chunk]:
                continue
            if all(self._have[s][chunk] for s in self._live):
                self._final[chunk] = True
                newly.append(chunk)
        return newly

    def release(self) -> np.ndarray | None:
        """End this reducer and hand back its accumulator for reuse (``None`` when it has
        none); later :meth:`add` calls raise :class:`ContributionError`. Idempotent."""
        with self._combining_lock:
            if self._released:
                return None
            self._released = True
            busy = self._combining > 0
        acc, self._acc = self._acc, np.empty(0, dtype=self.dtype)
        self._held.clear()  # views of messages and of the caller's data: let them go
        # A combination still reading the copies in a worker: let the buffer go with it
        # rather than hand it to the next round.
        return acc if acc.size and not busy else None

    def contributors(self, chunk: int) -> int:
        """How many senders' copies the final value of ``chunk`` averages."""
        return int(self._delivered[chunk])

    def result(self, chunk: int) -> np.ndarray | None:
        """The combined values of a final ``chunk``, or ``None`` when nobody delivered it
        (taken once, as :meth:`aggregate`).

        Raises:
            ValueError: the chunk is not final yet, or (the mean) was taken already.
        """
        return self.aggregate(chunk)[0]

    def aggregate(self, chunk: int) -> tuple[np.ndarray | None, int]:
        """The combined values of a final ``chunk`` (``None``: nobody delivered it) and how
        many inputs the rule adjusted: copies rejected or clipped (centered-clip), values dropped
        (trimmed-mean), 0 for the mean. Every rule then lets the chunk's copies go, so a
        chunk's result is taken once.

        Raises:
            ValueError: the chunk is not final yet, or (the mean) was taken already.
        """
        if not self._final[chunk]:
            raise ValueError(f"chunk {chunk} is not final")
        if self._robust:
            return self._aggregate_robust(chunk)
        return self.mean(chunk)[0], 0

    def mean(self, chunk: int) -> tuple[np.ndarray | None, bool]:
        """The mean rule's result for a final ``chunk`` (``None``: nobody delivered it, or
        the reducer was released), a new array, and whether it was checked finite as it
        was written (``False``: not checked, or it holds NaN/Inf: the caller's codec
        checks it). A copy whose check was deferred and fails is left out (its sender
        named in :attr:`rejected`; :meth:`contributors` no longer counts it). Taken once:
        the copies held for the chunk are let go.

        Raises:
            ValueError: the chunk is not final yet, was taken already, or the rule is
                robust.
        """
        if not self._final[chunk]:
            raise ValueError(f"chunk {chunk} is not final")
        if self._robust:
            raise ValueError("mean() of a robust rule")
        if self._released:  # the held copies are gone
            return None, False
        if self._taken[chunk]:
            raise ValueError(f"chunk {chunk} was taken already")
        self._taken[chunk] = True
        start, end = self.plan.chunk_bounds(self.part, chunk)
        copies = self._held.pop(chunk, [])
        if copies:
            out = np.empty(end - start, dtype=self.dtype)
            finite = self._weighted_mean(copies, out)
            if not finite and not all(c.checked for c in copies):
                kept = self._reject_non_finite(chunk, copies)
                if len(kept) < len(copies):  # checked now: finite, or what is left overflowed
                    copies = kept
                    finite = bool(copies) and self._weighted_mean(copies, out)
            if copies:
                return out, finite
        if self._zero_count[chunk] > 0 and self._zero_acc is not None:
            return self._zero_acc[start:end] / self.dtype.type(self._zero_count[chunk]), False
        return None, False

    def _reject_non_finite(self, chunk: int, copies: list[HeldCopy]) -> list[HeldCopy]:
        """The copies of ``chunk`` without the unchecked ones that hold NaN/Inf, whose
        senders go to :attr:`rejected` (the slow path: only a non-finite mean takes it)."""
        kept = []
        for copy in copies:
            if copy.checked or all_finite(copy.values):
                kept.append(copy._replace(checked=True))
                continue
            self.rejected.setdefault(copy.sender, f"chunk {chunk} holds NaN or Inf")
            self._delivered[chunk] -= 1
        return kept

    def _weighted_mean(self, copies: list[HeldCopy], out: np.ndarray) -> bool:
        """``out = sum f_i x_i / sum f_i`` over ``copies`` in arrival order, every
        operation rounded in the reduction dtype as numpy rounds it. Returns whether
        ``out`` was checked and is finite (the compiled kernel checks in the same pass;
        numpy's path checks only when a copy is unchecked)."""
        t = self.dtype.type
        divisor = 0.0
        for copy in copies:  # in order, as the accumulation added them (not math.fsum)
            divisor += copy.factor
        weights = [float(t(copy.factor)) for copy in copies]
        d = float(t(divisor))
        finite = weighted_sum([copy.values for copy in copies], weights, d, out)
        if finite is not None:
            return finite
        np.multiply(copies[0].values, t(weights[0]), out=out)
        for copy, weight in zip(copies[1:], weights[1:], strict=True):
            out += copy.values * t(weight)
        np.divide(out, t(d), out=out)
        return not all(copy.checked for copy in copies) and all_finite(out)

    def _aggregate_robust(self, chunk: int) -> tuple[np.ndarray | None, int]:
        with self._combining_lock:
            if self._released:  # the copies' buffer may belong to the next round now
                return None, 0
            self._combining += 1
        try:
            rows = self._copies.pop(chunk, None)
            if rows is None or self._factors is None:
                return None, 0
            senders = [s for s in sorted(self._row) if self._have[s][chunk]]
            if len(senders) < len(self._row):  # someone was dropped before this chunk
                rows = rows[[self._row[s] for s in senders]]
            weights = np.array([self._factors[s] for s in senders], dtype=np.float64)
            rule = self.aggregation
            if rule.kind == CENTERED_CLIP:  # every rule's result is a new array
                return centered_clip(rows, weights, rule.tau, rule.iters, rule.reject)
            k = rule.trimmed_per_side(len(senders))
            return trimmed_mean(rows, weights, k), trimmed_values(len(senders), k, rows.shape[1])
        finally:
            with self._combining_lock:
                self._combining -= 1


def weighted_mean(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Reference ``sum w_i x_i / sum w_i`` in float64 (plain mean when all weights are 0)."""
    stacked = np.stack([np.asarray(a, dtype=np.float64) for a in arrays])
    w = np.asarray(weights, dtype=np.float64)
    out: np.ndarray = (
        stacked.mean(axis=0) if w.sum() == 0 else np.tensordot(w, stacked, axes=1) / w.sum()
    )
    return out
