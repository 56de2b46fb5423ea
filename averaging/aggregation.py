"""Aggregation rules by name: how a reducer combines its senders' copies of a chunk.

A group agrees on one rule, as it agrees on a codec (docs/averaging.md, "Aggregation"):

- ``mean`` (the default): ``sum w_i x_i / sum w_i``, accumulated as chunks arrive.
- ``centered-clip[:tau=T,iters=K,reject=R]``: CenteredClip (Karimireddy et al. 2021), applied per
  chunk as BTARD's ButterflyClip applies it per part (Gorbunov et al. 2022, "Secure
  distributed training at scale", section 3). ``tau`` is *relative*: the clip radius of a
  chunk is ``tau`` times the median distance of the senders' copies from their
  coordinate-wise median. An absolute radius would have to follow the scale of the
  gradients through training and the chunk size the codec picks, which no user can tune
  for a public run; a relative one is the same number at every step. Copies farther than
  ``reject`` median distances from the median get no weight at all (``reject=0``: none
  is rejected): a clipped copy still pulls the estimate by its radius over the honest
  members, at every step and always the same way, while honest copies of one chunk sit at
  about the same distance from the median (the noise of a batch), so an attacker beyond a
  few times that distance is told apart and dropped; one inside it is clipped as before.
- ``trimmed-mean[:trim=F]``: per coordinate, drop the ``floor(F * n)`` largest and
  smallest of the ``n`` copies, then the weighted mean of the rest (Yin et al. 2018).

Names take parameters the way codec names do (``"centered-clip:tau=1.0,iters=5"``,
parsed by :func:`swarmavg.compression.registry.parse_spec`). :func:`parse_aggregation`
returns the rule with every parameter explicit, and its :attr:`Aggregation.name` is the
canonical spelling that travels in matchmaking, so ``"centered-clip"`` and
``"centered-clip:iters=5,tau=1,reject=3"`` are the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarmavg.compression.registry import parse_spec

MEAN = "mean"
CENTERED_CLIP = "centered-clip"
TRIMMED_MEAN = "trimmed-mean"
KNOWN_AGGREGATIONS = (MEAN, CENTERED_CLIP, TRIMMED_MEAN)
MAX_AGGREGATION_CHARS = 64
"""Longest aggregation spec accepted from a caller or a peer."""
MAX_CLIP_ITERATIONS = 100

DEFAULT_TAU = 1.0
"""Clip radius in median distances from the median. An outlier clipped to radius ``r``
still pulls the estimate by about ``r / n_honest`` (the fixed point of the iteration), so
the radius is the attacker's budget: with one trainer of four sending -10 x its gradients
on digits and no rejection (``reject=0``), ``tau=2`` cost 8 points of accuracy and
``tau=1`` about 2 (simulated) to 3.7 (the 90-step benchmark); below 1 the honest copies
are clipped too and little more is gained (``benchmarks/byzantine.py``)."""
DEFAULT_ITERS = 5
DEFAULT_REJECT = 3.0
"""Rejection radius in median distances from the median. With one trainer of four sending
-10 x its gradients on digits, clipping alone left the honest trainers 3-4 points below a
clean run; rejecting beyond 3 (or 2, or 5) brings them within 0.6, where the three honest
trainers alone are 0.5 below; with no attacker it changes nothing measurable
(docs/benchmarks.md, "Training"). Must be 0 (off) or at least 1: at
most half the copies can be farther than the median distance, so an honest majority is
never rejected by count (attackers placed at the median could still shrink the median
distance and have some honest copies rejected, never all)."""
DEFAULT_TRIM = 0.25
"""Trims one copy per side from 4 to 7 senders, two from 8: the smallest fraction that
removes one attacker in a group of 4 (``floor(0.2 * 4)`` would trim nothing)."""

_PARAMETERS = {MEAN: (), CENTERED_CLIP: ("tau", "iters", "reject"), TRIMMED_MEAN: ("trim",)}
_KNOWN_RULES = ", ".join(  # for error messages
    kind + (f" ({', '.join(params)})" if params else "") for kind, params in _PARAMETERS.items()
)


@dataclass(frozen=True)
class Aggregation:
    """One aggregation rule with its parameters, checked.

    Attributes:
        kind: ``"mean"``, ``"centered-clip"`` or ``"trimmed-mean"``.
        tau: CenteredClip's clip radius, in median distances from the median (> 0).
        iters: CenteredClip's most iterations (1..100); it stops early once an iteration
            clips nothing at a fixed point.
        reject: CenteredClip's rejection radius, in median distances from the median:
            copies beyond it get no weight (0: none rejected; else at least 1).
        trim: the trimmed mean's fraction dropped on each side, in [0, 0.5).
    """

    kind: str = MEAN
    tau: float = DEFAULT_TAU
    iters: int = DEFAULT_ITERS
    reject: float = DEFAULT_REJECT
    trim: float = DEFAULT_TRIM

    def __post_init__(self) -> None:
        if self.kind not in KNOWN_AGGREGATIONS:
            raise ValueError(
                f"unknown aggregation {self.kind!r}; known: {', '.join(KNOWN_AGGREGATIONS)}"
            )
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"centered-clip tau must be a finite number > 0, got {self.tau!r}")
        if not 1 <= self.iters <= MAX_CLIP_ITERATIONS:
            raise ValueError(
                f"centered-clip iters must be in 1..{MAX_CLIP_ITERATIONS}, got {self.iters!r}"
            )
        if not (self.reject == 0.0 or (math.isfinite(self.reject) and self.reject >= 1.0)):
            raise ValueError(
                f"centered-clip reject must be 0 (off) or a finite number >= 1, got {self.reject!r}"
            )
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"trimmed-mean trim must be in [0, 0.5), got {self.trim!r}")

    @property
    def robust(self) -> bool:
        """Whether the reducer must hold every sender's copy of a chunk before combining."""
        return self.kind != MEAN

    @property
    def name(self) -> str:
        """The canonical spec: every parameter explicit, in a fixed order."""
        if self.kind == CENTERED_CLIP:
            return f"{CENTERED_CLIP}:tau={self.tau!r},iters={self.iters},reject={self.reject!r}"
        if self.kind == TRIMMED_MEAN:
            return f"{TRIMMED_MEAN}:trim={self.trim!r}"
        return MEAN

    def trimmed_per_side(self, senders: int) -> int:
        """``k = floor(trim * n)``: copies the trimmed mean drops per side and coordinate."""
        return math.floor(self.trim * senders)


def parse_aggregation(spec: object) -> Aggregation:
    """The rule ``spec`` names (``"mean"``, ``"centered-clip:tau=1.0,iters=5"``, ...).

    Raises:
        ValueError: not a string, unknown name, unknown or bad parameters; the message
            lists the known names and the parameters the rule takes.
    """
    if not isinstance(spec, str) or not spec or len(spec) > MAX_AGGREGATION_CHARS:
        raise ValueError(
            f"aggregation must be a name such as 'mean'; known: {_KNOWN_RULES}; got {spec!r}"
        )
    kind, params = parse_spec(spec, what="aggregation")
    if kind not in _PARAMETERS:
        raise ValueError(f"unknown aggregation {kind!r}; known: {_KNOWN_RULES}")
    unknown = sorted(set(params) - set(_PARAMETERS[kind]))
    if unknown:
        takes = ", ".join(_PARAMETERS[kind]) or "no parameters"
        raise ValueError(f"aggregation {kind!r} takes {takes}, not {', '.join(unknown)}")
    values: dict[str, float | int] = {}
    for key, value in params.items():
        if isinstance(value, str):
            raise ValueError(f"aggregation parameter {key}={value!r} is not a number")
        if key == "iters" and not isinstance(value, int):
            raise ValueError(f"centered-clip iters must be an integer, got {value!r}")
        # + 0.0: -0.0 is a valid 0 and must not spell another canonical name
        values[key] = float(value) + 0.0 if key in ("tau", "reject", "trim") else value
    return Aggregation(kind=kind, **values)  # type: ignore[arg-type]


def canonical_aggregation(spec: object) -> str:
    """:attr:`Aggregation.name` of ``spec``; ``ValueError`` as :func:`parse_aggregation`."""
    return parse_aggregation(spec).name
