"""A relay forges a leader's ``JoinGroup`` answer (low).

A follower's ``JoinGroup`` request is signed, but the leader's answers on the stream used to
travel bare: a relay in front of a NATed leader (or anyone on the path) could rewrite
``JOIN_ACCEPTED`` into a rejection. ``JOIN_REJECT_SCHEMA_MISMATCH`` makes the follower ban
that leader for the round, so neither peer averaged (the follower saw another "schema", the
leader waited for a follower that never came back). Answers are now signed by the leader,
bound to the request's nonce and their position on the stream (averaging/matchmaking/
answers.py): an altered or unsigned answer is no answer, and the follower asks again.

Two real peers (DHT, gRPC servers on 127.0.0.1); the leader (first in leader order) is
reached through a relay that splices HTTP/2 frames and, once armed, changes the leader's
first answer: one byte of it (the code), or the whole message replaced by an unsigned
rejection. The control relays everything unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import struct

import numpy as np
import pytest

from swarmavg.averaging.matchmaking.config import MatchmakingEvent
from swarmavg.averaging.result import AveragingResult
from swarmavg.proto import averaging_pb2
from tests.attacks.test_relay_stream_integrity import FrameRelay, Tamper
from tests.averaging.averager_swarm import averager_swarm, fast_config, ranked

pytestmark = pytest.mark.timeout(90)

FRAME = struct.Struct(">3sB")  # an HTTP/2 frame's length (24 bits) and type
DATA = 0
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class Forgery(enum.Enum):
    NONE = "relay unchanged (the control)"
    ALTER_CODE = "turn JOIN_ACCEPTED into JOIN_REJECT_SCHEMA_MISMATCH, one byte"
    UNSIGNED_REJECTION = "replace the answer with an unsigned JOIN_REJECT_SCHEMA_MISMATCH"


class AnswerRelay(FrameRelay):
    """Splices connections to a gRPC server HTTP/2 frame by frame (the frame relay's
    splicing, with its own pump); forges the first ``JOIN_ACCEPTED`` answer of
    ``leader_id`` that goes back to a dialer."""

    def __init__(self, port: int, leader_id: bytes, forgery: Forgery) -> None:
        super().__init__(port, Tamper.ALTER_REPLY)  # the tamper is ours: ``forgery``
        self.forgery = forgery
        # A gRPC message's prefix (uncompressed, 4-byte length), then code 1 and the id.
        self._accepted = b"\x08\x01\x12\x14" + leader_id

    def _forged(self, body: bytes) -> bytes:
        if self.forgery is Forgery.ALTER_CODE:
            at = 5 + 1  # the code's value
            return body[:at] + bytes([averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH]) + body[at + 1 :]
        forged = averaging_pb2.JoinResponse(
            code=averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH,
            leader_id=body[9:29],
            detail="different tensor schema",
        ).SerializeToString()
        return b"\x00" + len(forged).to_bytes(4, "big") + forged

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        try:
            if upstream:
                writer.write(await reader.readexactly(len(PREFACE)))
            while True:
                head = await reader.readexactly(9)
                length, kind = FRAME.unpack(head[:4])
                body = await reader.readexactly(int.from_bytes(length))
                if (
                    not upstream
                    and kind == DATA
                    and self.forgery is not Forgery.NONE
                    and not self.done
                    and body[5:29] == self._accepted
                ):
                    self.done = True
                    body = self._forged(body)
                    head = len(body).to_bytes(3, "big") + head[3:]
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            with contextlib.suppress(OSError, RuntimeError):
                writer.write_eof()


@pytest.mark.parametrize("forgery", list(Forgery), ids=[f.name.lower() for f in Forgery])
async def test_a_relay_cannot_forge_a_leaders_answer(forgery: Forgery) -> None:
    async with averager_swarm(2, fast_config(matchmaking_time=3.0)) as swarm:
        leader, follower = ranked(swarm.peers, "k")
        port = int(leader.address.rpartition(":")[2])
        relay = AnswerRelay(port, leader.peer_id, forgery)
        # The leader is reached through the relay only: what it declares (a NATed peer's
        # relayed address).
        leader.averager.relocate(await relay.start(), leader.averager.data_port)
        try:
            leading = asyncio.ensure_future(
                leader.averager.average([np.ones(1000, np.float32)], "k", timeout=20)
            )
            # The follower declares after the leader, so it asks the leader (through the
            # relay) rather than being called by it.
            await swarm.wait_for(
                lambda: any(e[0] is MatchmakingEvent.DECLARED for e in leader.events)
            )
            following = follower.averager.average([np.zeros(1000, np.float32)], "k", timeout=20)
            results = await asyncio.gather(leading, following, return_exceptions=True)
        finally:
            await relay.close()
        if forgery is not Forgery.NONE:
            assert relay.done, "the relay never saw the answer to forge: the test proves nothing"
        ok = [r for r in results if isinstance(r, AveragingResult)]
        assert len(ok) == 2, results
        assert {r.group_size for r in ok} == {2}
        assert len({r.group_id for r in ok}) == 1
        assert not any(r.partial for r in ok)
