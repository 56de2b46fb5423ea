"""Progress inflation by self-reported samples (medium).

A progress record's ``samples`` and ``sps`` are whatever its daemon says: they used to be
capped only at ``2**53`` and summed, so one record claiming ``2**53`` samples ended every
epoch at once for every reader, and one claiming an absurd rate took the ETA to 0. Now each
daemon's records are summed into one figure (many subkeys of one identity count once) and
that figure counts for at most ``MAX_SHARE_RATIO`` times the lower median daemon's, or its
fair share of the target (averaging/run_records/progress.py, ``credit``).

Over real ``swarmavg peer`` daemons on 127.0.0.1 (the records signed by each daemon and
read back through the DHT): two honest trackers, then an attacker's daemon that writes
forged records under its own identity. Then the pure rule for the cases of many members.
"""

from __future__ import annotations

import math
from contextlib import ExitStack

import pytest

from swarmavg.averaging.run_records.progress import (
    MAX_EPOCH,
    MAX_SHARE_RATIO,
    GlobalProgress,
    PeerProgress,
    aggregate,
)
from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.peer import Client, connect
from tests.harness import ProcessPool
from tests.run_daemons import clients, start_run

pytestmark = pytest.mark.integration
__all__ = ["clients"]  # the fixture
RUN = "inflation"
TARGET = 4096
HONEST_SAMPLES = 100
HONEST_RATE = 10.0


def honest_tracker(client: Client) -> ProgressTracker:
    tracker = ProgressTracker(client, RUN, TARGET)
    tracker.samples = HONEST_SAMPLES
    tracker.meter.rate = HONEST_RATE
    return tracker


def sees_everyone(tracker: ProgressTracker, daemons: int) -> GlobalProgress:
    """Read until the records of ``daemons`` daemons are in (DHT stores are replicated
    asynchronously; the DHT's own call deadline bounds each read)."""
    for _ in range(200):
        progress = tracker.refresh()
        if len({p.peer_id for p in progress.peers}) >= daemons:
            return progress
    raise AssertionError(f"never saw {daemons} daemons' records")


@pytest.mark.timeout(120)
def test_one_member_cannot_end_the_epoch_or_zero_the_eta(
    swarmavg_processes: ProcessPool, clients: ExitStack
) -> None:
    honest_a, honest_b, attacker = (
        clients.enter_context(connect(d.control)) for d in start_run(swarmavg_processes, RUN, 3)
    )
    reader, other = honest_tracker(honest_a), honest_tracker(honest_b)
    assert other.report()

    # control: two honest daemons, 200 of 4096 samples, 20 samples/s
    control = sees_everyone(reader, 2)
    assert (control.samples, control.ready) == (2 * HONEST_SAMPLES, False)
    assert control.eta == pytest.approx((TARGET - 2 * HONEST_SAMPLES) / (2 * HONEST_RATE))

    # the attack: one identity, many subkeys (one tracker each), each record claiming the
    # most samples a record may hold and an absurd rate
    forgers = [ProgressTracker(attacker, RUN, TARGET) for _ in range(8)]
    for forger in forgers:
        forger.samples = MAX_EPOCH
        forger.meter.rate = 1e11
        assert forger.report()
    attacked = sees_everyone(reader, 3)
    attacker_id = forgers[0].peer_id
    assert not attacked.ready, "one member's records ended the epoch"
    assert attacker_id in attacked.capped
    # it counts for one daemon's fair share at most (the median here is an honest one's)
    most = max(MAX_SHARE_RATIO * HONEST_SAMPLES, TARGET / 3)
    assert attacked.samples <= 2 * HONEST_SAMPLES + most
    # and its rate for at most MAX_SHARE_RATIO honest rates: the ETA shrinks, not to 0
    rate_bound = 2 * HONEST_RATE + MAX_SHARE_RATIO * HONEST_RATE
    assert attacked.samples_per_second <= rate_bound
    assert attacked.eta >= (TARGET - attacked.samples) / rate_bound > 0

    # the honest members still end the epoch on their own samples (the cap is no stall)
    reader.samples = other.samples = TARGET // 2
    assert other.report()
    for _ in range(200):
        if reader.refresh().ready:
            break
    else:
        raise AssertionError("the honest members' own samples no longer end the epoch")


def rec(peer: str, samples: int, sps: float = HONEST_RATE) -> PeerProgress:
    return PeerProgress(peer, 0, samples, sps, 1000.0)


@pytest.mark.parametrize("honest", [1, 2, 3, 7])
def test_one_liar_among_many_members_is_bounded(honest: int) -> None:
    """However many honest daemons, one liar moves the epoch by at most its fair share or
    ``MAX_SHARE_RATIO`` medians; without it the honest sum is what counts."""
    records = [rec(f"h{i}", HONEST_SAMPLES) for i in range(honest)]
    control = aggregate(records, TARGET, now=1000.0, trusted="h0")
    attacked = aggregate([*records, rec("liar", MAX_EPOCH, 1e11)], TARGET, now=1000.0, trusted="h0")
    most = max(MAX_SHARE_RATIO * HONEST_SAMPLES, TARGET / (honest + 1))
    assert control.samples == honest * HONEST_SAMPLES
    assert attacked.samples <= control.samples + most
    assert not attacked.ready
    assert math.isfinite(attacked.eta)
    assert attacked.eta > 0
    assert attacked.capped == frozenset({"liar"})


def test_the_readers_own_daemon_and_a_fast_honest_member_still_count() -> None:
    # the reader's own processes are never capped, however far ahead of the others
    own = aggregate([rec("me", 3000), rec("b", 10)], TARGET, now=1000.0, trusted="me")
    assert own.samples == 3010
    assert not own.capped
    # an honest member four times the median counts in full
    fast = aggregate(
        [rec("me", 100), rec("b", 100), rec("c", 400, 40.0)], TARGET, now=1000.0, trusted="me"
    )
    assert fast.samples == 600
    assert not fast.capped
    # right after a global step: the others still at 0, one member a batch ahead counts
    # for its fair share
    fresh = aggregate([rec("me", 0), rec("b", 0), rec("c", 64)], TARGET, now=1000.0, trusted="me")
    assert fresh.samples == 64
