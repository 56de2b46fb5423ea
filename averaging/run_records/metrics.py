"""User metrics in progress records (loss, accuracy, ...): names and values a trainer
reports through its optimizer (``opt.report_metrics(loss=0.31)``) and ``swarmavg peers``
shows beside each peer.

A record travels to every peer of the run and every DHT node that stores it checks it
(averaging/protocol_keys.py), so the map is small and plain: at most
:data:`MAX_METRICS` entries, names of at most :data:`MAX_NAME_CHARS` characters from
``[A-Za-z0-9_./-]``, finite numbers. A record whose map breaks these rules is malformed as a
whole: honest writers check their metrics before they store them (:func:`check_metrics`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

MAX_METRICS = 8
"""Entries a progress record's metrics map may hold."""
MAX_NAME_CHARS = 32
"""Characters a metric's name may have."""
_NAME = re.compile(rf"[A-Za-z0-9_./-]{{1,{MAX_NAME_CHARS}}}")

Metrics = tuple[tuple[str, float], ...]
"""Metrics as an immutable, name-sorted tuple of ``(name, value)`` pairs."""


def check_metrics(metrics: Mapping[str, object]) -> Metrics:
    """Validate metrics a trainer reports; return them sorted by name.

    Raises:
        ValueError: too many entries, a bad name, or a value that is not a finite number
            (the message names the entry).
    """
    if len(metrics) > MAX_METRICS:
        raise ValueError(
            f"at most {MAX_METRICS} metrics per progress record, got {len(metrics)}: "
            f"{sorted(metrics)}"
        )
    checked: list[tuple[str, float]] = []
    for name, value in metrics.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"metric name {name!r} must be 1-{MAX_NAME_CHARS} characters of "
                "letters, digits, '_', '.', '/', '-'"
            )
        number = _number(value)
        if number is None:
            raise ValueError(f"metric {name!r} must be a finite number, got {value!r}")
        checked.append((name, number))
    return tuple(sorted(checked))


def parse_metrics(raw: object) -> Metrics | None:
    """Metrics read from another peer's record; None when they break the rules."""
    if not isinstance(raw, Mapping):
        return None
    try:
        return check_metrics(raw)
    except ValueError:
        return None


def _number(value: object) -> float | None:
    # Tensors and numpy scalars reach here from training loops (``loss.item()`` forgotten):
    # anything that converts to a float exactly once is taken, bools and strings are not.
    if isinstance(value, bool | str | bytes):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a multi-element tensor
        return None
    return number if math.isfinite(number) else None
