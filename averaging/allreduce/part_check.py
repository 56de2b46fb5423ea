"""A member's check of the averaged parts against its own values (pure logic, no I/O).

Only a part's reducer runs the aggregation rule, so a reducer can return any values for its
part that pass the form checks (index, size, codec, sender counts, finiteness): under
``mean`` and the robust rules alike. A member cannot recompute the part (it holds only its
own copy), but it holds its own copy of *every* part, and the honest parts of one round
are slices of the same members' vectors, averaged by the same rule. So the distance
between what came back for a part and this member's own values of it, in units of its
own values there, is about the same for every honest part, and a forged part stands out
against the others.

The check runs in rounds of a robust aggregation rule only. Under the mean a member needs
no reducer's part to do harm: what it sends moves every part of every member's result. A
run that admits strangers chooses a robust rule, and the check carries that rule's bound
to the reducers' answers; a run of the mean pays nothing for it.

For each part ``p`` whose averages came back, over the chunks that came back:

- ``deviation`` ``e_p = rms(result_p - own_p)``, the absolute distance,
- ``relative`` ``u_p = e_p / rms(own_p)``, the distance in units of this member's own
  values there: scale-free, so layers whose values differ by orders of magnitude compare.

Both, with the mean absolute distance and the share of zeros in this member's values, come
from five sums per chunk (:func:`~swarmavg.compression.kernels.check_sums`) that the data
path computes in the compiled pass that copies a chunk's averages where they go, reading
this member's values there before they are written over: the check reads no memory of
its own. The rms is ruled by a few values where they are heavy-tailed (Student-t with 2
degrees of freedom: honest parts 13x apart), the mean absolute distance is not (1.2x), so a
part the rms refuses is refused only if the mean absolute distances refuse it too.

A part is refused when its ``relative`` is more than ``factor`` times the median of the
other parts' (and more than :data:`RELATIVE_FLOOR`), in both measures. One honest case
fools the relative measure: a part where this member's own values are mostly exact zeros
(a sparse embedding slice its batch did not touch) while the others' are not. A part whose
own values are at least half zeros (counted only for a part that fails the first test) is
therefore refused only when its ``deviation`` is also more than ``factor`` times the other
parts' median.
An honest part is refused when the members' values there differ from each other far
more than everywhere else (one member's values 100x larger in one layer only), or when
this member's values are mostly zeros on a part whose values are far larger than the rest
of the vector's: it then keeps local values and the round is partial, the price of the
check.

What it bounds: a forged part is accepted only if its rms or its mean absolute distance
from this member's own values is within ``factor`` times the other parts' median distance
in units of the member's own values there (absolute units where those are mostly zeros):
a forgery spread over the part moves both measures alike; one concentrated on a few
values moves the rms most, and passes while its total absolute change stays within
``factor`` times the honest parts'. The reducer sees
each member's copy of its part and may answer each member differently, so that is the
bound per member, not a proof of honest averaging: a reducer that echoes each member's own
values back, or moves the part by less than ``factor`` honest spreads, is not detected.
With no other part to compare (a group of one reducer), nothing is refused. The member's
own part, reduced by itself, is trusted and serves as a reference: in a group of two it is
the only one. The other reducers' parts count in the median, so reducers that forge
together need half of the other parts to move it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from swarmavg.compression.kernels import check_copy

__all__ = [
    "DEFAULT_FACTOR",
    "MOSTLY_ZERO",
    "RELATIVE_FLOOR",
    "DeviationTally",
    "PartDeviation",
    "forged_parts",
    "mean_absolute_deviation",
]

DEFAULT_FACTOR = 8.0
"""How many median distances a part may be from this member's values. On simulated honest
rounds (``benchmarks/member_checks.py``: 2-8 members, parts of 6,000 elements and more,
layers whose scales differ by e^4 either way; Gaussian, Student-t with 2 and 3 degrees of
freedom, 99%-zero, shared-signal and nearly identical values, members whose scales differ by
a log-normal factor) the largest ratio of an honest part in rms was 1.84 (Student-t with 2
degrees of freedom, whose rms is ruled by a few values; 4.7 in parts of 2,000 elements); 8
leaves a margin over that. A part moved to -4 x the honest average of gradients with a
shared signal is refused, one at -2 x by 4% of the members."""

MOSTLY_ZERO = 0.5
"""Share of exact zeros in this member's values of a part above which its relative
distance means little (see the module docstring)."""

RELATIVE_FLOOR = 0.25
"""A part whose averages are within a quarter of this member's own values' rms is
always accepted: when the members' values nearly agree (parameters right after an
average), every part's distance is rounding or codec noise, whose ratios mean nothing."""


@dataclass(frozen=True)
class PartDeviation:
    """How far one part's averages are from this member's own values of it."""

    deviation: float
    """rms of ``result - own`` over the elements compared."""
    scale: float
    """rms of ``own`` over the same elements."""

    @property
    def relative(self) -> float:
        """``deviation / scale``; infinite when own values are all zero and the result is
        not, 0 when both are."""
        if self.scale > 0:
            return self.deviation / self.scale
        return math.inf if self.deviation > 0 else 0.0


class DeviationTally:
    """The sums of one part, chunk by chunk (the chunks of a part come back in any order
    and may be left out): enough for its deviation in rms and in mean absolute values and
    for the share of zeros in this member's values there, so the check reads no value
    again after a chunk was counted. Not thread-safe."""

    def __init__(self) -> None:
        self._sums = np.zeros(5, dtype=np.float64)
        self.elements = 0

    def add(self, result: np.ndarray, own: np.ndarray) -> None:
        """Count one chunk: its averaged values and this member's own values (1-D, same
        length, finite)."""
        if result.shape != own.shape or result.ndim != 1:
            raise ValueError("result and own values must be 1-D arrays of one length")
        self.add_sums(check_copy(result, own)[1], own.size)

    def add_sums(self, sums: np.ndarray, elements: int) -> None:
        """Count one chunk of ``elements`` values by its sums
        (:func:`~swarmavg.compression.kernels.check_sums`: the data path computes them as
        it copies the chunk's averages where they go)."""
        # float64 sums of exact float64 terms: where the result nearly equals our values
        # the differences are summed themselves, so nothing cancels
        self._sums += sums
        self.elements += elements

    def result(self) -> PartDeviation | None:
        """The part's deviation in rms, ``None`` when no chunk was counted."""
        if not self.elements:
            return None
        return PartDeviation(
            math.sqrt(self._sums[0] / self.elements), math.sqrt(self._sums[1] / self.elements)
        )

    def mean_absolute(self) -> PartDeviation:
        """The part's deviation in mean absolute values (``deviation`` = mean
        ``|result - own|``, ``scale`` = mean ``|own|``); zeros when nothing was counted."""
        if not self.elements:
            return PartDeviation(0.0, 0.0)
        return PartDeviation(
            float(self._sums[2]) / self.elements, float(self._sums[3]) / self.elements
        )

    def zeros(self) -> float:
        """The share of exact zeros in this member's values of the counted chunks."""
        if not self.elements:
            return 0.0
        return 1.0 - float(self._sums[4]) / self.elements


def mean_absolute_deviation(chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> PartDeviation:
    """A part's deviation in mean absolute values (``deviation`` = mean ``|result - own|``,
    ``scale`` = mean ``|own|``) over ``(result, own)`` chunk pairs; zeros when empty."""
    tally = DeviationTally()
    for result, own in chunks:
        tally.add(result, own)
    return tally.mean_absolute()


def _outliers(
    deviations: Mapping[int, PartDeviation],
    trusted: Collection[int],
    factor: float,
    zeros: Callable[[int], float],
) -> dict[int, str]:
    """The untrusted parts far from this member's values against the median of the others,
    in one measure."""
    refused: dict[int, str] = {}
    for part, mine in deviations.items():
        if part in trusted:
            continue
        others = [d for p, d in deviations.items() if p != part]
        if not others:
            continue
        absolute = float(np.median([d.deviation for d in others]))
        relative = float(np.median([d.relative for d in others]))
        if mine.relative <= max(factor * relative, RELATIVE_FLOOR):
            continue
        if mine.deviation <= factor * absolute and zeros(part) >= MOSTLY_ZERO:
            continue
        refused[part] = (
            f"{mine.relative:.3g} x this member's values away from them, against a median "
            f"of {relative:.3g} x over the other parts"
        )
    return refused


def forged_parts(
    deviations: Mapping[int, PartDeviation],
    trusted: Collection[int] = (),
    factor: float = DEFAULT_FACTOR,
    zeros: Callable[[int], float] = lambda part: 0.0,
    confirm: Callable[[Collection[int]], Mapping[int, PartDeviation]] | None = None,
) -> dict[int, str]:
    """The parts to refuse, with the reason: those far from this member's values against
    the median of every other part, in rms and then in mean absolute values (module
    docstring).

    Args:
        deviations: part index -> its rms deviation, for the parts whose averages came back.
        trusted: parts never refused (this member's own, which it reduced itself); they
            still count as references for the others.
        factor: median distances a part may be away (> 1).
        zeros: the share of exact zeros in this member's values of a part (0..1), asked
            only of the parts the relative test refuses.
        confirm: given the parts of ``deviations``, their deviations in mean absolute
            values (:func:`mean_absolute_deviation`); called only when some part is far off
            in rms. ``None``: the rms alone decides.
    """
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    refused = _outliers(deviations, trusted, factor, zeros)
    if not refused or confirm is None:
        return {p: f"rms {why}, beyond {factor:g} x" for p, why in refused.items()}
    absolute = _outliers(confirm(list(deviations)), trusted, factor, zeros)
    return {
        p: f"rms {why}; mean absolute {absolute[p]}; beyond {factor:g} x"
        for p, why in refused.items()
        if p in absolute
    }
