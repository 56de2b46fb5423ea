"""A slow sender holds a round (medium).

A reducer dropped a sender that delivered nothing for ``stall_factor`` times its own mean
interval between chunks (at least ``min_stall``): a patience that follows the sender's own
pace, so a member that paced its chunks just inside it was never dropped, and every chunk
of every part waited for it (a round took 44.6 s against 0.9 s). Now a sender still
delivering ``slow_sender_factor`` times as long after its first chunk as the part's median
sender took is dropped (averaging/allreduce/slow_senders.py), while an honest member on a
link at a quarter of the others' bandwidth is not.

The members are real (real reducers and ``Reduce`` streams over gRPC on 127.0.0.1); a
member's link is paced by a wrapper around its real streams that waits before each write
(the same sender code, the same messages, later).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.allreduce import streams
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging import allreduce_peers
from tests.averaging.allreduce_peers import FAST, LocalPeer
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(90)

MEMBERS = 4
ATTACKER = MEMBERS - 1
CHUNKS_PER_PART = 12
SIZE = MEMBERS * CHUNKS_PER_PART * 1024  # FAST's chunks are 4 KiB: 1024 float32
TRICKLE = 0.9 * FAST.min_stall
"""The attacker's interval between chunks: inside the stall detector's patience (which is
at least ``min_stall``) however long it goes on."""


class PacedCall:
    """A member's real ``Reduce`` stream whose chunk writes wait ``interval`` first (a slow
    link, or a member that trickles on purpose); counts the messages written. The opening
    message goes at once: delayed too, the first chunk came two intervals after the round
    began, and on a loaded machine past the stall detector's first-chunk patience (twice
    ``min_stall``), which then dropped the trickler before the rule under test could."""

    def __init__(self, call: Any, interval: float, written: list[int]) -> None:
        self._call = call
        self._interval = interval
        self._written = written
        self._opened = False

    async def write(self, message: bytes) -> None:
        if self._opened:
            await asyncio.sleep(self._interval)
        self._opened = True
        await self._call.write(message)
        self._written[0] += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


@pytest.fixture
def pace(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[int, float], list[int]]:
    """Member index -> seconds between its chunks; and the attacker's chunks written."""
    intervals: dict[int, float] = {}
    written = [0]
    open_call = streams.PartStreams._open_call

    async def paced_open_call(self: Any, part: int, address: str) -> Any:
        call = await open_call(self, part, address)
        interval = intervals.get(self.my_index)
        if interval is None:
            return call
        counter = written if self.my_index == ATTACKER else [0]
        return PacedCall(call, interval, counter)

    monkeypatch.setattr(streams.PartStreams, "_open_call", paced_open_call)
    return intervals, written


async def _round(
    peers: list[LocalPeer], channels: ChannelPool, seed: int, written: list[int]
) -> tuple[list[AveragingResult], int, float]:
    """One round of every member: the honest members' results, how many chunks the
    attacker had written when the last of them had its result, and how long after the
    round began that was (a benchmark reports it; the tests compare counts)."""
    rng = np.random.default_rng(seed)
    inputs = [[rng.standard_normal(SIZE).astype(np.float32)] for _ in range(MEMBERS)]
    group = allreduce_peers.make_group(peers, inputs[0])
    weights = [1.0] * MEMBERS
    began = time.monotonic()
    # The honest members and the attacker as two calls of the same round, so that the
    # honest members' end can be seen while the attacker still sends.
    attacker = asyncio.ensure_future(
        allreduce_peers.run_group(
            peers, group, inputs, weights, channels, timeout=60, skip=range(ATTACKER)
        )
    )
    try:
        results = await allreduce_peers.run_group(
            peers, group, inputs, weights, channels, timeout=60, skip=[ATTACKER]
        )
        seen, ended = written[0], time.monotonic() - began
    finally:
        await attacker
    honest = []
    for result in results[:ATTACKER]:
        assert isinstance(result, AveragingResult), result
        honest.append(result)
    return honest, seen, ended


async def test_a_member_that_trickles_is_dropped(
    grpc_servers: GrpcServerPool, pace: tuple[dict[int, float], list[int]]
) -> None:
    intervals, written = pace
    peers = await allreduce_peers.start_peers(grpc_servers, MEMBERS, FAST, data_plane=False)
    channels = ChannelPool()
    try:
        # Control: nobody trickles; the round is whole.
        control, _, _ = await _round(peers, channels, seed=1, written=written)
        for result in control:
            assert not result.partial, (result.dropped, result.failed_parts)

        intervals[ATTACKER] = TRICKLE
        honest, seen, _ = await _round(peers, channels, seed=2, written=written)
        chunks = (MEMBERS - 1) * CHUNKS_PER_PART  # the attacker's, to the three others
        for result in honest:
            assert result.partial
            assert ATTACKER in result.dropped, result.dropped
            assert "too slow" in result.dropped[ATTACKER]
        # Every honest member had its result before the attacker sent half its chunks.
        assert seen < chunks / 2, (seen, chunks)
        assert written[0] <= chunks
    finally:
        await channels.close()
        await allreduce_peers.close_peers(peers)


async def test_an_honest_member_on_a_slower_link_is_kept(
    grpc_servers: GrpcServerPool, pace: tuple[dict[int, float], list[int]]
) -> None:
    """Every member's link paced (so that durations are the links', not the loop's), one
    at a quarter of the others' pace: its chunks all arrive, nobody is dropped."""
    intervals, _ = pace
    peers = await allreduce_peers.start_peers(grpc_servers, MEMBERS, FAST, data_plane=False)
    channels = ChannelPool()
    try:
        fast = FAST.min_stall / CHUNKS_PER_PART  # the slow one's part takes 4 x min_stall
        intervals.update(dict.fromkeys(range(MEMBERS), fast))
        intervals[ATTACKER] = 4 * fast
        honest, _, _ = await _round(peers, channels, seed=3, written=[0])
        for result in honest:
            assert not result.partial, (result.dropped, result.failed_parts)
            assert result.dropped == {}
    finally:
        await channels.close()
        await allreduce_peers.close_peers(peers)
