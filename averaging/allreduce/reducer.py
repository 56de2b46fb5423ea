"""Weighted accumulation of one part, chunk by chunk (pure logic of the reducer side).

The reducer of part ``j`` receives every sender's copy of each chunk of part ``j`` and
keeps ``sum_i w_i x_i`` in a preallocated accumulator (float32, or float64 for float64
layouts). A chunk is *final* as soon as every sender that is still live has
delivered it; its average is ``sum w_i x_i / sum w_i`` over the senders that delivered
that chunk, so a dropped sender's weight is renormalised away only for the chunks it did
not deliver (docs/averaging.md, "Failures"). When every delivering sender has weight 0, the
chunk is the plain mean of their copies.

Errors in a contribution raise :class:`ContributionError` before anything is
accumulated; the caller then drops that sender.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from swarmavg.averaging.allreduce.partition import PartPlan
from swarmavg.compression.kernels import all_finite


class ContributionError(ValueError):
    """A sender's chunk is invalid (wrong index, size, dtype, a duplicate, NaN/Inf)."""


class PartReducer:
    """Accumulates the senders' chunks of one part and finalises chunks in any order.

    Not thread-safe: call it from one thread (the event loop, or one worker at a time).
    """

    def __init__(self, plan: PartPlan, part: int, dtype: np.dtype, senders: Iterable[int]):
        """Prepare an all-zero accumulator for ``part`` of ``plan``.

        Args:
            plan: the round's partition.
            part: which part this reducer owns.
            dtype: reduction dtype (float32 or float64).
            senders: group indices of every member expected to contribute.
        """
        self.plan = plan
        self.part = part
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError("reduction dtype must be float32 or float64")
        self.num_chunks = plan.num_chunks(part)
        self._acc = np.zeros(plan.part_size(part), dtype=self.dtype)
        self._zero_acc: np.ndarray | None = None  # plain sums from weight-0 senders
        self._weight_sum = np.zeros(self.num_chunks, dtype=np.float64)
        self._zero_count = np.zeros(self.num_chunks, dtype=np.int64)
        self._delivered = np.zeros(self.num_chunks, dtype=np.int64)  # copies per chunk
        self._have: dict[int, np.ndarray] = {s: np.zeros(self.num_chunks, bool) for s in senders}
        if not self._have:
            raise ValueError("a part needs at least one sender")
        self._live = set(self._have)
        self._weights: dict[int, float] = {}
        self._final = np.zeros(self.num_chunks, dtype=bool)

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

    def set_weight(self, sender: int, weight: float) -> None:
        """Record ``sender``'s weight; must precede its first :meth:`add`."""
        if sender not in self._live:
            raise ContributionError(f"member {sender} is not a live sender of this part")
        if sender in self._weights:
            raise ContributionError(f"member {sender} already announced its weight")
        if not (np.isfinite(weight) and weight >= 0.0):
            raise ContributionError(f"weight must be finite and >= 0, got {weight}")
        self._weights[sender] = float(weight)

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
        if values.dtype != self.dtype or values.shape != (end - start,):
            raise ContributionError(
                f"chunk {chunk} must be {self.dtype}[{end - start}], "
                f"got {values.dtype}{list(values.shape)}"
            )
        if not finite and not all_finite(values):
            raise ContributionError(f"chunk {chunk} holds NaN or Inf")

    def add(
        self, sender: int, chunk: int, values: np.ndarray, *, finite: bool = False
    ) -> list[int]:
        """Accumulate ``sender``'s copy of ``chunk``; return chunks that became final.

        ``finite=True`` skips the NaN/Inf check when the caller already made it (the
        codec's decoder, for codecs that check their output).

        Raises:
            ContributionError: see :meth:`check`; nothing is accumulated then.
        """
        self.check(sender, chunk, values, finite=finite)
        start, end = self.plan.chunk_bounds(self.part, chunk)
        weight = self._weights[sender]
        if weight > 0.0:
            target = self._acc[start:end]
            if self._weight_sum[chunk] == 0.0:
                np.multiply(values, self.dtype.type(weight), out=target)
            elif weight == 1.0:
                target += values
            else:  # never scale `values` in place: it may be a view of the caller's data
                target += values * self.dtype.type(weight)
            self._weight_sum[chunk] += weight
        else:
            if self._zero_acc is None:
                self._zero_acc = np.zeros_like(self._acc)
            self._zero_acc[start:end] += values
            self._zero_count[chunk] += 1
        self._have[sender][chunk] = True
        self._delivered[chunk] += 1
        return self._finalise([chunk])

    def drop(self, sender: int) -> list[int]:
        """Stop waiting for ``sender``; return chunks that became final. Idempotent."""
        if sender not in self._live:
            return []
        self._live.discard(sender)
        return self._finalise(range(self.num_chunks))

    def _finalise(self, candidates: Iterable[int]) -> list[int]:
        newly = []
        for chunk in candidates:
            if self._final[chunk]:
                continue
            if all(self._have[s][chunk] for s in self._live):
                self._final[chunk] = True
                newly.append(chunk)
        return newly

    def contributors(self, chunk: int) -> int:
        """How many senders' copies the final value of ``chunk`` averages."""
        return int(self._delivered[chunk])

    def result(self, chunk: int) -> np.ndarray | None:
        """The averaged values of a final ``chunk``, or ``None`` when nobody delivered it.

        Raises:
            ValueError: the chunk is not final yet.
        """
        if not self._final[chunk]:
            raise ValueError(f"chunk {chunk} is not final")
        start, end = self.plan.chunk_bounds(self.part, chunk)
        out: np.ndarray
        if self._weight_sum[chunk] > 0.0:
            out = self._acc[start:end] / self.dtype.type(self._weight_sum[chunk])
        elif self._zero_count[chunk] > 0 and self._zero_acc is not None:
            out = self._zero_acc[start:end] / self.dtype.type(self._zero_count[chunk])
        else:
            return None
        return out


def weighted_mean(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Reference ``sum w_i x_i / sum w_i`` in float64 (plain mean when all weights are 0)."""
    stacked = np.stack([np.asarray(a, dtype=np.float64) for a in arrays])
    w = np.asarray(weights, dtype=np.float64)
    out: np.ndarray = (
        stacked.mean(axis=0) if w.sum() == 0 else np.tensordot(w, stacked, axes=1) / w.sum()
    )
    return out
