"""A member that starts its round after the others' first streams reached it.

Members of a group learn that it formed at different times: a follower checks the
leader's member list against declarations it reads from the DHT first, which on a busy
swarm takes seconds. A reducer's service holds an early stream only ``registration_wait``
for its round, then refuses it (NOT_FOUND). At 256 peers (benchmarks/scale.py) a group's
senders took that refusal as final for the 3 members that came 3-8 s late, and all 16
members ended with partial results. A sender now asks again, within the patience it gives
any reducer, and the late member's part is averaged like the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import numpy as np
import pytest

from swarmavg.averaging.allreduce.runner import run_allreduce
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import FAST, close_peers, make_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("allreduce_transport")]

N = 3
LATE = 2
SIZE = 3000
# The late member's service refuses early streams after 0.2 s; senders wait up to
# 3 x min_stall = 6 s for a reducer, far longer than the late member takes to start.
CONFIG = dataclasses.replace(FAST, registration_wait=0.2, min_stall=2.0)


class _Refused(logging.Handler):
    """Sets ``event`` when a sender logs that the late member refused its stream."""

    def __init__(self, address: str, event: asyncio.Event) -> None:
        super().__init__(logging.INFO)
        self.address = address
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if self.address in text and ("NOT_FOUND" in text or "not started" in text):
            self.event.set()


async def test_a_member_that_starts_late_still_gets_and_gives_its_part(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    peers = await start_peers(grpc_servers, N, CONFIG)
    inputs = [[np.full(SIZE, float(i + 1), np.float32)] for i in range(N)]
    group = make_group(peers, inputs[0])
    refused = asyncio.Event()
    handler = _Refused(peers[LATE].address, refused)
    streams_log = logging.getLogger("swarmavg.averaging.allreduce.streams")
    level = streams_log.level
    streams_log.setLevel(logging.INFO)
    streams_log.addHandler(handler)
    deadline = time.monotonic() + 30.0

    async def one(i: int) -> AveragingResult:
        if i == LATE:
            # The late member starts only once an early stream to it was refused.
            await refused.wait()
        index = group.index_of(peers[i].identity.peer_id)
        assert index is not None
        return await run_allreduce(
            group,
            index,
            inputs[i],
            1.0,
            deadline=deadline,
            service=peers[i].service,
            channels=channels,
            signer=peers[i].signer,
        )

    try:
        results = await asyncio.gather(*(one(i) for i in range(N)))
    finally:
        streams_log.removeHandler(handler)
        streams_log.setLevel(level)
        await close_peers(peers)
    expected = np.full(SIZE, 2.0, np.float32)  # (1 + 2 + 3) / 3
    for result in results:
        assert not result.partial, result.local_fraction
        np.testing.assert_array_equal(result.tensors[0], expected)
