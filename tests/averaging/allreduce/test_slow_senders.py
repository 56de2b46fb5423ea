"""Which senders are too slow against the part's others (averaging/allreduce/slow_senders.py),
as a pure rule on given instants (no clock)."""

from __future__ import annotations

import pytest

from swarmavg.averaging.allreduce.slow_senders import too_slow


def test_nobody_is_judged_before_the_median_other_is_done() -> None:
    first = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    # 4 remote senders: each has 3 others, of which 2 must be done (the median)
    assert too_slow(100.0, first, {1: 1.0}, senders=4) == {}
    slow = too_slow(100.0, first, {1: 1.0, 2: 2.0}, senders=4)
    assert sorted(slow) == [3, 4]
    assert "too slow" in slow[3]


def test_the_bound_is_factor_times_the_median_duration_from_each_first_chunk() -> None:
    first = {1: 0.0, 2: 0.5, 3: 1.0}
    finished = {1: 2.0, 2: 2.5}  # both took 2.0 s
    # sender 3 began at 1.0: it may take 8 x 2.0 = 16 s, until 17.0
    assert too_slow(17.0, first, finished, senders=3) == {}
    assert list(too_slow(17.01, first, finished, senders=3)) == [3]
    # a link at a quarter of the others' bandwidth (8 s) is far inside it
    assert too_slow(9.0, first, finished, senders=3, factor=4.5) == {}


def test_the_floor_holds_when_the_others_are_quick() -> None:
    first = {1: 0.0, 2: 0.0, 3: 0.0}
    finished = {1: 0.01, 2: 0.01}
    assert too_slow(0.9, first, finished, senders=3, floor=1.0) == {}
    assert list(too_slow(1.1, first, finished, senders=3, floor=1.0)) == [3]


def test_a_lone_remote_sender_is_never_judged() -> None:
    assert too_slow(1e6, {1: 0.0}, {}, senders=1) == {}


def test_senders_without_a_first_chunk_are_the_stall_detectors() -> None:
    assert too_slow(1e6, {1: 0.0, 2: 0.0}, {1: 1.0, 2: 1.0}, senders=3) == {}


def test_an_even_number_of_others_takes_the_upper_median() -> None:
    first = dict.fromkeys(range(1, 6), 0.0)
    # 5 senders: each has 4 others, of which 3 must be done; the third fastest counts
    assert too_slow(100.0, first, {1: 1.0, 2: 1.0}, senders=5) == {}
    finished = {1: 1.0, 2: 1.0, 3: 4.0}
    assert too_slow(8.5, first, finished, senders=5, factor=8.0) == {}
    assert sorted(too_slow(8.5, first, finished, senders=5, factor=2.0)) == [4, 5]


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="factor"):
        too_slow(0.0, {}, {}, senders=2, factor=1.0)
    with pytest.raises(ValueError, match="floor"):
        too_slow(0.0, {}, {}, senders=2, floor=-1.0)
