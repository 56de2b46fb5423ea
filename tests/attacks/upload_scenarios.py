"""Slow readers of a donor's state, shared by ``test_state_upload_slots.py`` and
``tests/attacks/attack_report.py``.

Nothing here imports the upload slots themselves, so the report can stage the attack
against older code too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from swarmavg.averaging.state.config import StateSharingConfig
from swarmavg.averaging.stubs import DOWNLOAD_STATE, download_state_method
from swarmavg.dht.auth import RequestSigner
from swarmavg.dht.identity import Identity
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import RUN_ID, Peer, fast_config

PATIENT = StateSharingConfig(  # no deadline cuts a slow reader within the test
    chunk_size=1 << 20, message_timeout=120.0, upload_timeout=300.0, max_uploads=8
)
CONFIG = fast_config(state=PATIENT)


def outsider() -> RequestSigner:
    """A fresh identity that is no peer of the swarm (it only signs requests)."""
    return RequestSigner(Identity.generate(), RUN_ID, lambda: "")


def everything(donor: Peer) -> averaging_pb2.StateRequest:
    manifest = donor.averager.state_sharer.published
    assert manifest is not None
    return averaging_pb2.StateRequest(root=manifest.root, chunk_hashes=manifest.chunk_hashes)


@contextlib.asynccontextmanager
async def slow_readers(
    donor: Peer, attacker: RequestSigner, count: int
) -> AsyncIterator[tuple[list[Any], list[averaging_pb2.StateResponse]]]:
    """``attacker`` opens ``count`` streams for every chunk, each on its own connection,
    and reads one message of each: yields the calls and their first answers. On exit the
    calls are cancelled and the channels closed."""
    channels: list[grpc.aio.Channel] = []
    calls: list[Any] = []
    firsts = []
    try:
        for _ in range(count):
            channel = grpc.aio.insecure_channel(
                donor.address, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            channels.append(channel)
            request = attacker.signed(everything(donor), donor.peer_id, DOWNLOAD_STATE)
            call = download_state_method(channel)(request, timeout=170)
            calls.append(call)
            firsts.append(await asyncio.wait_for(call.read(), 60))
        yield calls, firsts
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
