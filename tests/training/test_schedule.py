"""``local_steps="auto"``: the choice rules by hand, and their agreement (no daemon)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from swarmavg.averaging.training.schedule import (
    RoundTimer,
    StreamingSchedule,
    diloco_local_steps,
    streaming_schedule,
    swarm_ratio,
)


def test_diloco_h_is_the_smallest_whose_round_costs_at_most_the_overhead() -> None:
    # A round of 3 inner steps' time at 5% overhead: 3 / 0.05 = 60 inner steps.
    assert diloco_local_steps(3.0, overhead=0.05, bounds=(1, 1000)) == 60
    # 60 steps cost 3 / 63 < 5%; 59 would cost 3 / 62 > 5%... by the rule's own measure:
    h = diloco_local_steps(3.1, overhead=0.05, bounds=(1, 1000))
    assert h == 62
    assert 3.1 / h <= 0.05 < 3.1 / (h - 1)
    assert diloco_local_steps(0.5, overhead=0.1, bounds=(1, 1000)) == 5


def test_diloco_h_stays_within_its_bounds() -> None:
    assert diloco_local_steps(0.0, bounds=(10, 500)) == 10
    assert diloco_local_steps(0.01, bounds=(10, 500)) == 10
    assert diloco_local_steps(1e6, bounds=(10, 500)) == 500
    assert diloco_local_steps(math.inf, bounds=(10, 500)) == 500
    assert diloco_local_steps(math.nan, bounds=(10, 500)) == 10
    with pytest.raises(ValueError, match="bounds"):
        diloco_local_steps(1.0, bounds=(0, 5))
    with pytest.raises(ValueError, match="bounds"):
        diloco_local_steps(1.0, bounds=(6, 5))
    with pytest.raises(ValueError, match="overhead"):
        diloco_local_steps(1.0, overhead=0.0)


def test_streaming_overlap_covers_the_round_with_margin_and_the_period_exceeds_it() -> None:
    # A round of 2.2 inner steps, margin 1.5: overlap ceil(3.3) = 4, period 5, H = 4 * 5.
    assert streaming_schedule(2.2, 4, margin=1.5, bounds=(1, 1000)) == StreamingSchedule(20, 4)
    # A fast round: overlap 1, and the lowest H (rounded up to a multiple of F) sets it.
    assert streaming_schedule(0.1, 5, bounds=(50, 500)) == StreamingSchedule(50, 1)
    assert streaming_schedule(0.1, 4, bounds=(10, 500)) == StreamingSchedule(12, 1)
    for ratio in (0.0, 0.7, 3.0, 17.5, 60.0):
        s = streaming_schedule(ratio, 4, bounds=(8, 400))
        assert s.local_steps % 4 == 0
        assert 8 <= s.local_steps <= 400
        assert 1 <= s.overlap_steps < s.local_steps // 4
        assert s.overlap_steps >= 1.5 * ratio  # hidden: the round ends within the overlap


def test_streaming_schedule_at_its_upper_bound_overlaps_as_much_as_the_period_allows() -> None:
    s = streaming_schedule(1000.0, 4, bounds=(8, 100))
    assert s == StreamingSchedule(100, 24)
    s = streaming_schedule(math.inf, 5, bounds=(10, 52))  # largest multiple of 5 within 52
    assert s == StreamingSchedule(50, 9)
    with pytest.raises(ValueError, match="fragments"):
        streaming_schedule(1.0, 4, bounds=(1, 7))
    with pytest.raises(ValueError, match="margin"):
        streaming_schedule(1.0, 4, margin=0.0)


def test_the_timer_sends_nothing_until_it_has_timed_a_round_and_a_step() -> None:
    timer = RoundTimer()
    assert timer.ratio_pair() == (0.0, 0.0)
    timer.add_step(0.2)
    timer.add_step(0.4)
    assert timer.step_seconds == pytest.approx(0.3)
    assert timer.ratio_pair() == (0.0, 0.0)  # no round yet
    timer.add_round(0.9)
    assert timer.ratio_pair() == (pytest.approx(3.0), 1.0)
    timer.reset_steps()
    assert timer.ratio_pair() == (0.0, 0.0)  # no step of this outer step yet


def test_the_swarm_ratio_is_the_weighted_mean_over_the_members_that_measured_one() -> None:
    # Members (weight, ratio or None): the mean of the pairs is what every member gets.
    members = [(4.0, 2.0), (4.0, 6.0), (8.0, None)]
    total = sum(w for w, _ in members)
    weighted = sum(w * (r or 0.0) for w, r in members) / total
    known = sum(w * (r is not None) for w, r in members) / total
    assert swarm_ratio(weighted, known) == pytest.approx(4.0)
    assert swarm_ratio(0.0, 0.0) is None
    assert swarm_ratio(float(np.float32("nan")), 1.0) is None
    assert swarm_ratio(-1.0, 1.0) == 0.0
