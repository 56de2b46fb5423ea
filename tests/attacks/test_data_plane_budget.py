"""Data-plane byte budget taken before authentication (high).

A data-plane frame header declares its body's length and the server reserves that many
bytes of its budget before it reads the body. Every byte of it was reserved on the word of
whoever connected: 256 MiB in all, 64 MiB per host, and a body that never came held its
bytes as long as the connection stayed idle (120 s). Five addresses that each open
connections and send one 4 MiB header per connection took the whole budget; an honest
round's streams to that reducer then waited, unread, and the round ended partial.

Now a stream's bytes count against the small pending pool of its connection's address
range until its signed first message verified and its sender is a member of a round here
(averaging/allreduce/admission.py, framing.py); ranges that keep the pending pool full are
evicted for one that holds less, a pending body that waits too long is refused with
``RESOURCE_EXHAUSTED`` (its sender then uses gRPC), and a stalled body is cut at the pace of
a live sender.

The attacker's connections come from 127.0.1.1 ... 127.0.5.1, five /24 networks other than
the honest members' 127.0.0.0/24, and the reducer counts loopback ranges
(``limit_local_ranges``). The control is the same round without the attack.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import struct
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.framing import MAGIC
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import (
    FAST,
    LocalPeer,
    close_peers,
    make_group,
    run_group,
    start_peers,
)
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(120)

ATTACKERS = [f"127.0.{i}.1" for i in range(1, 6)]
"""Five networks of the attacker: /24s other than the honest members' 127.0.0.0/24."""
PER_ADDRESS = 48  # connections per attacker address: 240 of the reducer's 256
HONEST = 4
HELLO = struct.pack("<IB", len(MAGIC), 0) + MAGIC
STALLED_HEADER = struct.pack("<IB", 4 << 20, 1)  # a MSG frame of 4 MiB, never sent


def allreduce_config(**settings: Any) -> AllReduceConfig:
    """``FAST`` with ``settings``, leaving out those the code under test does not have."""
    names = {f.name for f in dataclasses.fields(AllReduceConfig)}
    return dataclasses.replace(FAST, **{k: v for k, v in settings.items() if k in names})


CONFIG = allreduce_config(chunk_bytes=1 << 20, limit_local_ranges=True)


async def hold_header(port: int, source: str) -> asyncio.StreamWriter:
    """One connection from ``source``, past the HELLO exchange and then one 4 MiB frame
    header whose body never comes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(HELLO)
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        await asyncio.wait_for(reader.readexactly(len(HELLO)), 10.0)
    writer.write(STALLED_HEADER)
    return writer


async def hold_headers(port: int, source: str, count: int) -> list[asyncio.StreamWriter]:
    """``count`` connections from ``source`` at once, each holding a stalled header. At
    once, as an attacker would: one after another, those the server leaves unanswered
    while its pending pool is full wait out its pending deadline each in turn."""
    return list(await asyncio.gather(*(hold_header(port, source) for _ in range(count))))


async def honest_round(
    peers: list[LocalPeer], channels: ChannelPool, seed: int
) -> list[AveragingResult]:
    """One round of every member (2 MiB each, 1 MiB chunks); each result is checked
    against the exact mean."""
    rng = np.random.default_rng(seed)
    inputs = [[rng.standard_normal(1 << 19).astype(np.float32)] for _ in peers]
    group = make_group(peers, inputs[0])
    results = await run_group(peers, group, inputs, [1.0] * len(peers), channels, timeout=40)
    mean = weighted_mean([x[0] for x in inputs], [1.0] * len(peers))
    checked: list[AveragingResult] = []
    for r in results:
        assert isinstance(r, AveragingResult), r
        assert r.failed_parts == (), r.errors
        assert not r.partial, r.errors
        np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
        checked.append(r)
    return checked


async def test_stalled_headers_from_five_networks_leave_the_round_whole(
    grpc_servers: GrpcServerPool,
) -> None:
    """Control: a whole round. Attack: five networks hold 240 stalled 4 MiB headers at
    the reducer of part 0 while the same members run another round; it must end whole
    too. Before, the headers held the whole budget (256 MiB) and the honest senders'
    bodies waited unread until their reducer gave them up: the round ended partial."""
    peers = await start_peers(grpc_servers, HONEST, CONFIG, data_plane=True)
    target = peers[0]
    writers: list[asyncio.StreamWriter] = []
    channels = ChannelPool()
    try:
        await honest_round(peers, channels, seed=1)  # control

        for source in ATTACKERS:
            writers += await hold_headers(target.data_port, source, PER_ADDRESS)
        budget = target.service.data_plane_budget
        assert budget is not None
        await asyncio.wait_for(budget.wait_until(lambda b: b.held >= 16 << 20), 30.0)

        await honest_round(peers, channels, seed=2)
        # Whatever the attack holds now, it is the pending pool's share, not the budget.
        assert budget.held <= 32 << 20
    finally:
        for writer in writers:
            writer.close()
        await channels.close()
        await close_peers(peers)
