"""Which senders of a part are too slow against the others (pure logic of the reducer side).

The stall detector (``ReducerRound._watchdog``) drops a sender that delivers nothing new
for ``stall_factor`` times its own mean interval between chunks. That patience follows the
sender itself, so a sender that paces its chunks just inside it is never dropped: it holds
every chunk of the part, and with it the whole group, for as long as it likes (a round of
0.9 s took 44.6 s). What bounds a sender has to come from outside it: the round's other
senders of the same part send the same number of chunks of the same size to the same
reducer.

So a part's remote senders are timed from their first chunk to their last. Once more than
half of a sender's others are done, the median of the others' durations is known (the upper
one when they are even in number: the others not done yet are slower still), and a sender
still not done ``factor`` times that long after its own first chunk (and at least
``floor``) is too slow: the reducer drops it as it drops a stalled sender. An honest
sender on a link at a quarter of the others' bandwidth takes about 4 times as long, half
the default factor.

What it bounds: a sender that trickles delays the part by at most ``max(factor x the
median sender's duration, floor)`` after its first chunk, and the wait for a first chunk is
the stall detector's (twice ``min_stall``). With a single remote sender (a group of two)
there is nothing to compare and only the stall detector applies; senders that are half of
a part's senders can make the median as slow as themselves.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["DEFAULT_FACTOR", "too_slow"]

DEFAULT_FACTOR = 8.0
"""Times the median sender's duration that a sender may take (see the module docstring)."""


def too_slow(
    now: float,
    first_chunk: Mapping[int, float],
    finished: Mapping[int, float],
    senders: int,
    factor: float = DEFAULT_FACTOR,
    floor: float = 0.0,
) -> dict[int, str]:
    """The senders still delivering that are too slow against the others, with the reason.

    Args:
        now: the current time, on the clock of the other arguments.
        first_chunk: sender -> when its first chunk arrived (senders that delivered one).
        finished: sender -> when its last chunk arrived (senders that delivered every one).
        senders: the part's remote senders at the round's start (dropped ones included):
            more than half of a sender's others must be done before it is judged.
        factor: how many times the median duration a sender may take (> 1).
        floor: the least time any sender is given after its first chunk (>= 0).
    """
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    if floor < 0:
        raise ValueError(f"floor must be >= 0, got {floor}")
    durations = sorted(finished[s] - first_chunk[s] for s in finished if s in first_chunk)
    needed = (senders - 1) // 2 + 1  # the upper median of a sender's others
    if len(durations) < needed:
        return {}
    median = durations[needed - 1]
    bound = max(factor * median, floor)
    slow = {}
    for sender, first in first_chunk.items():
        if sender in finished:
            continue
        taken = now - first
        if taken > bound:
            slow[sender] = (
                f"too slow: {taken:.1f}s since its first chunk, against {median:.2f}s for "
                f"the median sender (bound {bound:.1f}s)"
            )
    return slow
