"""Slow readers holding every state-upload slot (low).

A donor serves at most ``max_uploads`` (8) download streams. Its per-message and
per-stream deadlines cut a reader that stops, but one that reads just fast
enough kept all 8: an outsider opening 8 ``DownloadState`` streams and reading slowly made
an honest load take 20.6 s (0.1 s without it). Now one identity holds at most 2 slots
and one address range at most half of them (averaging/state/slots.py), so an honest joiner
is served while the outsider sits at its limit.

The slow streams here never read past their first message and the deadlines are far
longer than the test, so nothing but the slot limits can let the honest joiner in.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from swarmavg.averaging.state.slots import PEER_SHARE, UploadSlots, range_share
from swarmavg.averaging.stubs import DOWNLOAD_STATE
from swarmavg.proto import averaging_pb2
from tests.attacks.upload_scenarios import CONFIG, PATIENT, everything, outsider, slow_readers
from tests.averaging.averager_swarm import AveragerSwarm, fast_config


@pytest.mark.timeout(180)
async def test_one_identity_cannot_hold_every_upload_slot() -> None:
    swarm = AveragerSwarm()
    try:
        donor = await swarm.add(CONFIG)
        control, joiner = await swarm.add(CONFIG), await swarm.add(CONFIG)
        tensors = [np.random.default_rng(1).standard_normal(8 << 20).astype(np.float32)]
        await donor.averager.publish_state(tensors, b"step=7")  # 32 MiB, 32 chunks
        sharer = donor.averager.state_sharer

        # control: nobody holds a slot, a joiner loads
        metadata, loaded = await control.averager.load_state(timeout=60)
        assert (metadata, loaded[0].tobytes() == tensors[0].tobytes()) == (b"step=7", True)

        # the attack: one identity opens 8 streams for every chunk and reads one message
        attacker = outsider()
        async with slow_readers(donor, attacker, 8) as (calls, firsts):
            held = [
                c for c, m in zip(calls, firsts, strict=True) if m.code == averaging_pb2.STATE_OK
            ]

            # the honest outcome: a fresh joiner loads everything while the attacker holds on
            metadata, loaded = await joiner.averager.load_state(timeout=60)
            assert metadata == b"step=7"
            assert loaded[0].tobytes() == tensors[0].tobytes()
            assert sharer.uploads_cut.value == 0  # no deadline let it in
            assert not any(call.done() for call in held)  # the slow streams are still open
            assert len(held) == PEER_SHARE == sharer.slots.holding(attacker.peer_id)
            busy = [m for m in firsts if m.code == averaging_pb2.STATE_BUSY]
            assert len(busy) == 8 - PEER_SHARE
            assert all("this peer holds" in m.detail for m in busy)
    finally:
        await swarm.close()


class Stream:
    """The donor's side of one ``DownloadState`` stream from a given source address: a
    slow reader never drains its first chunk; a normal one takes every message."""

    def __init__(self, source: str, slow: bool) -> None:
        self.source = source
        self.slow = slow
        self.messages: list[averaging_pb2.StateResponse] = []
        self.answered = asyncio.Event()

    def peer(self) -> str:
        return self.source

    async def write(self, message: averaging_pb2.StateResponse) -> None:
        self.messages.append(message)
        self.answered.set()
        if self.slow and message.code == averaging_pb2.STATE_OK:
            await asyncio.Event().wait()  # a reader that does not drain: blocks the writer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


@pytest.mark.timeout(120)
async def test_one_address_range_cannot_hold_every_upload_slot() -> None:
    """Ids are free: 8 identities from one /24 each open a stream. The range holds at most
    half of the slots; a joiner from another network is served meanwhile. (The
    donor's handler is driven directly: every socket of a test is on 127.0.0.1.)"""
    swarm = AveragerSwarm()
    slow: list[asyncio.Task[None]] = []
    try:
        donor = await swarm.add(fast_config(state=PATIENT))
        small = [np.arange(4 << 18, dtype=np.float32)]  # 4 MiB: 5 chunks with the header
        await donor.averager.publish_state(small, b"m")
        sharer = donor.averager.state_sharer
        chunks = len(everything(donor).chunk_hashes)

        async def download(source: str, slow: bool) -> Stream:
            stream = Stream(source, slow)
            request = outsider().signed(everything(donor), donor.peer_id, DOWNLOAD_STATE)
            await sharer.rpc_download_state(request, stream)  # type: ignore[arg-type]
            return stream

        # control: a joiner from 5.6.7.8 is served every chunk
        served = await asyncio.wait_for(download("ipv4:5.6.7.8:40000", slow=False), 30)
        assert [m.code for m in served.messages] == [averaging_pb2.STATE_OK] * chunks

        # the attack: 8 identities from 1.2.3.0/24, each a slow reader
        streams = [Stream(f"ipv4:1.2.3.{i}:40000", slow=True) for i in range(8)]
        for stream in streams:
            request = outsider().signed(everything(donor), donor.peer_id, DOWNLOAD_STATE)
            slow.append(asyncio.create_task(sharer.rpc_download_state(request, stream)))  # type: ignore[arg-type]
        await asyncio.wait_for(asyncio.gather(*(s.answered.wait() for s in streams)), 30)

        # the honest outcome: the other network is served while 1.2.3.0/24 is at its limit
        served = await asyncio.wait_for(download("ipv4:5.6.7.8:40001", slow=False), 30)
        assert [m.code for m in served.messages] == [averaging_pb2.STATE_OK] * chunks
        codes = [s.messages[0].code for s in streams]
        assert codes.count(averaging_pb2.STATE_OK) == range_share(PATIENT.max_uploads) == 4
        assert codes.count(averaging_pb2.STATE_BUSY) == 4
        assert all(
            "1.2.3.0/24" in s.messages[0].detail
            for s in streams
            if s.messages[0].code == averaging_pb2.STATE_BUSY
        )
        assert sharer.uploads.value == 4
        assert sharer.uploads_cut.value == 0
    finally:
        for task in slow:
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        await swarm.close()


@pytest.mark.timeout(30)
def test_slot_accounting() -> None:
    slots = UploadSlots(total=5, per_identity=2, per_range=2)
    assert slots.acquire(b"a", None) is None
    assert slots.acquire(b"a", None) is None
    assert "this peer" in (slots.acquire(b"a", None) or "")  # its share, not the total
    assert slots.acquire(b"b", "1.2.3.0/24") is None
    assert slots.acquire(b"c", "1.2.3.0/24") is None
    assert "1.2.3.0/24" in (slots.acquire(b"d", "1.2.3.0/24") or "")  # the range's share
    assert slots.acquire(b"d", "5.6.7.0/24") is None
    assert "all 5" in (slots.acquire(b"g", "8.8.8.0/24") or "")  # the total
    slots.release(b"a", None)
    assert slots.acquire(b"d", "5.6.7.0/24") is None  # d's second, in the slot a gave back
    assert slots.holding(b"d") == 2
    for who, net in ((b"a", None), (b"b", "1.2.3.0/24"), (b"c", "1.2.3.0/24")):
        slots.release(who, net)
    for _ in range(2):
        slots.release(b"d", "5.6.7.0/24")
    assert slots.held == 0
    assert slots.holding(b"a") == 0
    assert slots.acquire(b"e", "1.2.3.0/24") is None
    assert slots.acquire(b"f", "1.2.3.0/24") is None
    with pytest.raises(ValueError, match=">= 1"):
        UploadSlots(total=8, per_identity=0, per_range=4)
