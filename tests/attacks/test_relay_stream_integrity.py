"""A relay alters a public run's ``Reduce`` streams (low).

A relay splices a dialer's bytes to a NATed peer (peer/nat/splice.py); in a public run
nothing encrypts them, and only a stream's first message was signed, so a relay (like any
attacker on the path) could alter the chunks a sender streams and the averages a reducer
returns, and both ends used what it wrote. Streams are now keyed (averaging/allreduce/
keyed_stream.py): every message after the handshake carries a MAC under a key only the two
ends hold, and a message that fails it ends the stream and is not used.

Three real members (reducers, gRPC servers and data planes on 127.0.0.1); the data plane of
member 0 (or, over gRPC, its gRPC port) is reached through a relay that reads the frames it
splices (data-plane frames, or HTTP/2 frames) and, once armed, changes one thing in one
stream. The control relays the same round unchanged: every result
is the exact mean. Under attack every element of every result must be one the honest
protocol can give (the mean over all senders, the mean without the sender whose stream was
touched, or the member's own value for a part it kept): nothing the relay wrote is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import os
import struct
from typing import Any

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.wire import (
    deserialize_reply,
    deserialize_request,
    reduce_digest,
)
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.stubs import REDUCE
from swarmavg.compression import CodecInfo, get_codec
from swarmavg.dht import ChannelPool
from swarmavg.proto import averaging_pb2
from tests.attacks.test_reduce_slots import SourceRelay
from tests.averaging import allreduce_peers
from tests.averaging.allreduce_peers import FAST, LocalPeer
from tests.averaging.test_message_replay import opening, outcome
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(90)

MEMBERS = 3
RELAYED = 0  # the member whose data plane the relay stands in front of
SIZE = MEMBERS * 4 * 1024  # FAST's chunks are 4 KiB: 4 chunks of 1024 float32 per part
HEAD = struct.Struct("<IB")
MSG, CLOSE, STATUS = 1, 2, 3
NOT_FOUND, UNAUTHENTICATED = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
TAG_TRAILER = 18  # a keyed message's mac field (stream_mac.TRAILER_BYTES), absent on old peers


class Tamper(enum.Enum):
    """What the relay does to the second message of one stream."""

    ALTER_CHUNK = "alter one byte of a chunk the sender streams"
    ALTER_REPLY = "alter one byte of an average the reducer returns"
    REPLAY_CHUNK = "send a chunk twice"
    DROP_CHUNK = "drop a chunk, pass the rest"
    FORGE_END = "end the stream with a forged OK status instead of its first average"


def _flip_payload_byte(body: bytes, upstream: bool) -> bytes:
    """``body`` with the high byte of the first value of its payload changed (the value
    becomes 4 times larger or smaller)."""
    parsed: Any = deserialize_request(body) if upstream else deserialize_reply(body)
    assert not parsed.error, parsed.error
    assert parsed.payload is not None
    trailer = TAG_TRAILER if getattr(parsed, "mac", b"") else 0
    at = len(body) - trailer - len(parsed.payload) + 3
    return body[:at] + bytes([body[at] ^ 0x01]) + body[at + 1 :]


class FrameRelay(SourceRelay):
    """Splices connections to a data plane frame by frame; once :attr:`armed`, applies
    :attr:`tamper` to the second ``MSG`` of the first stream that reaches one (in the
    direction the tamper names), then relays everything unchanged again."""

    def __init__(self, port: int, tamper: Tamper) -> None:
        super().__init__(f"127.0.0.1:{port}", "127.0.0.1")
        self._port = port
        self.tamper = tamper
        self.armed = False
        self.done = False

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._port)
        tasks = [
            asyncio.ensure_future(self._pump(reader, up_writer, upstream=True)),
            asyncio.ensure_future(self._pump(up_reader, writer, upstream=False)),
        ]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)
        for w in (writer, up_writer):
            w.close()

    def _targets(self, upstream: bool) -> bool:
        wanted = self.tamper not in (Tamper.ALTER_REPLY, Tamper.FORGE_END)
        return self.armed and not self.done and upstream == wanted

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        messages = 0  # MSG frames of the current stream in this direction
        swallowing = False  # the rest of a stream whose end was forged: never delivered
        try:
            while True:
                head = await reader.readexactly(HEAD.size)
                length, kind = HEAD.unpack(head)
                body = await reader.readexactly(length)
                frames = [(kind, body)]
                if swallowing:
                    frames = []
                    swallowing = kind not in (CLOSE, STATUS)
                elif kind == MSG:
                    messages += 1
                    if messages == 2 and self._targets(upstream):
                        self.done = True
                        frames = self._tampered(body, upstream)
                        swallowing = self.tamper is Tamper.FORGE_END
                elif kind in (CLOSE, STATUS):
                    messages = 0
                for k, b in frames:
                    writer.write(HEAD.pack(len(b), k) + b)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            with contextlib.suppress(OSError, RuntimeError):
                writer.write_eof()

    def _tampered(self, body: bytes, upstream: bool) -> list[tuple[int, bytes]]:
        if self.tamper is Tamper.REPLAY_CHUNK:
            return [(MSG, body), (MSG, body)]
        if self.tamper is Tamper.DROP_CHUNK:
            return []
        if self.tamper is Tamper.FORGE_END:
            return [(STATUS, bytes((grpc.StatusCode.OK.value[0],)))]
        return [(MSG, _flip_payload_byte(body, upstream))]


class Http2Relay(FrameRelay):
    """Splices connections to a gRPC server HTTP/2 frame by frame; once :attr:`armed`,
    changes the low bit of 4 consecutive bytes in the middle of the first large ``DATA``
    frame (a chunk's or an average's payload, not a stream's small first message) going the
    way :attr:`tamper` names: one of them is the high byte of a value, which becomes 4 times
    larger or smaller."""

    PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    FRAME = struct.Struct(">3sB")  # length (24 bits), type; then flags and stream id
    DATA = 0

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        try:
            if upstream:
                writer.write(await reader.readexactly(len(self.PREFACE)))
            while True:
                head = await reader.readexactly(9)
                length, kind = self.FRAME.unpack(head[:4])
                body = bytearray(await reader.readexactly(int.from_bytes(length)))
                wanted = (self.tamper is Tamper.ALTER_CHUNK) == upstream
                large = kind == self.DATA and len(body) > 2048
                if large and wanted and self.armed and not self.done:
                    self.done = True
                    middle = len(body) // 2
                    for at in range(middle, middle + 4):
                        body[at] ^= 0x01
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            with contextlib.suppress(OSError, RuntimeError):
                writer.write_eof()


async def _round(peers: list[LocalPeer], channels: ChannelPool, seed: int) -> list[Any]:
    """One round; returns each member's (result, own input, exact mean, means without
    each sender)."""
    rng = np.random.default_rng(seed)
    inputs = [[rng.standard_normal(SIZE).astype(np.float32)] for _ in range(MEMBERS)]
    group = allreduce_peers.make_group(peers, inputs[0])
    results = await allreduce_peers.run_group(
        peers, group, inputs, [1.0] * MEMBERS, channels, timeout=30
    )
    values = np.stack([x[0] for x in inputs])
    means = [values.mean(axis=0)] + [
        np.delete(values, i, axis=0).mean(axis=0) for i in range(MEMBERS)
    ]
    out = []
    for result, own in zip(results, inputs, strict=True):
        assert isinstance(result, AveragingResult), result
        out.append((result, own[0], means))
    return out


def _possible(result: AveragingResult, own: np.ndarray, means: list[np.ndarray]) -> np.ndarray:
    """Which elements of ``result`` hold a value the honest protocol can give."""
    got = result.tensors[0]
    ok = np.isclose(got, own, rtol=1e-5, atol=1e-6)
    for mean in means:
        ok |= np.isclose(got, mean, rtol=1e-5, atol=1e-6)
    return ok


async def _control_then_attack(peers: list[LocalPeer], relay: FrameRelay, tamper: Tamper) -> None:
    """A round relayed unchanged (whole and exact), then one with the relay armed: no
    result holds what the relay wrote, and the MAC check said what it refused."""
    channels = ChannelPool()
    try:
        for result, _, means in await _round(peers, channels, seed=1):
            assert not result.partial, (result.dropped, result.failed_parts)
            np.testing.assert_allclose(result.tensors[0], means[0], rtol=1e-5, atol=1e-6)

        relay.armed = True
        outcome = await _round(peers, channels, seed=2)
        assert relay.done, "the relay never saw the message it was to change"
        for result, own, means in outcome:
            ok = _possible(result, own, means)
            assert ok.all(), (
                f"{tamper.value}: {int((~ok).sum())} element(s) hold what the relay wrote",
                result.partial,
                result.dropped,
            )
        # Refused by the MAC check, and said so: the reducer dropped the sender (a chunk)
        # or the sender distrusted the reducer's part (a reply); the result is partial.
        reasons = [
            reason
            for result, _, _ in outcome
            for reason in [*result.dropped.values(), *result.distrusted.values()]
        ]
        assert any("integrity check" in reason for reason in reasons), reasons
        assert any(result.partial for result, _, _ in outcome)
    finally:
        await channels.close()


ALTERATIONS = [t for t in Tamper if t is not Tamper.FORGE_END]


@pytest.mark.parametrize("tamper", ALTERATIONS, ids=[t.name.lower() for t in ALTERATIONS])
async def test_a_relay_cannot_alter_a_public_run_stream(
    grpc_servers: GrpcServerPool, tamper: Tamper
) -> None:
    peers = await allreduce_peers.start_peers(grpc_servers, MEMBERS, FAST, data_plane=True)
    relay = FrameRelay(peers[RELAYED].data_port, tamper)
    # What the group advertises for the reducer: the relay in front of its data plane.
    peers[RELAYED].data_port = int((await relay.start()).rpartition(":")[2])
    try:
        await _control_then_attack(peers, relay, tamper)
    finally:
        await relay.close()
        await allreduce_peers.close_peers(peers)


async def test_a_forged_end_is_a_stream_failure_reported_as_such(
    grpc_servers: GrpcServerPool,
) -> None:
    """The relay answers a sender with an ``OK`` status in place of the reducer's first
    average and swallows the rest of that stream. Nothing after the handshake is believed
    without its tag: the sender keeps its local values for the missing chunks and its result
    says that the stream ended with no end under its tag (before, the end was taken as the
    reducer's: a partial result that said nothing of why)."""
    peers = await allreduce_peers.start_peers(grpc_servers, MEMBERS, FAST, data_plane=True)
    relay = FrameRelay(peers[RELAYED].data_port, Tamper.FORGE_END)
    peers[RELAYED].data_port = int((await relay.start()).rpartition(":")[2])
    channels = ChannelPool()
    try:
        for result, _, _ in await _round(peers, channels, seed=1):
            assert not result.partial, (result.dropped, result.failed_parts)
            assert not getattr(result, "unconfirmed_ends", {})

        relay.armed = True
        outcome = await _round(peers, channels, seed=2)
        assert relay.done, "the relay never forged an end"
        for result, own, means in outcome:
            assert _possible(result, own, means).all()
        forged = [
            (index, result)
            for index, (result, _, _) in enumerate(outcome)
            if getattr(result, "unconfirmed_ends", {})
        ]
        assert len(forged) == 1, [getattr(r, "unconfirmed_ends", None) for r, _, _ in outcome]
        index, result = forged[0]
        assert index != RELAYED  # a sender to the relayed reducer
        assert list(result.unconfirmed_ends) == [RELAYED]
        assert "no end under its tag" in result.unconfirmed_ends[RELAYED]
        assert result.partial
        assert RELAYED in result.failed_parts
        assert not result.distrusted  # the averages it had are authentic: not refused
    finally:
        await channels.close()
        await relay.close()
        await allreduce_peers.close_peers(peers)


@pytest.mark.parametrize("tamper", [Tamper.ALTER_CHUNK, Tamper.ALTER_REPLY], ids=["chunk", "reply"])
async def test_a_relay_cannot_alter_a_public_run_stream_over_grpc(
    grpc_servers: GrpcServerPool, tamper: Tamper
) -> None:
    """The same over the gRPC ``Reduce`` method: a relay in front of the reducer's gRPC
    port that alters the bytes of an HTTP/2 ``DATA`` frame."""
    peers = await allreduce_peers.start_peers(grpc_servers, MEMBERS, FAST, data_plane=False)
    relay = Http2Relay(int(peers[RELAYED].address.rpartition(":")[2]), tamper)
    peers[RELAYED].address = await relay.start()  # what the group advertises
    try:
        await _control_then_attack(peers, relay, tamper)
    finally:
        await relay.close()
        await allreduce_peers.close_peers(peers)


async def test_unkeyed_streams_are_served_only_where_the_run_allows_them(
    grpc_servers: GrpcServerPool,
) -> None:
    """An older sender's signed first message carries no stream key: served as before by
    default, refused with ``keyed_streams_only``; a keyed first message carrying a chunk
    (the one message nothing would cover) is refused either way."""
    quick = dataclasses.replace(FAST, registration_wait=0.2)
    strict = dataclasses.replace(quick, keyed_streams_only=True)
    lenient_peers = await allreduce_peers.start_peers(grpc_servers, 2, quick)
    strict_peers = await allreduce_peers.start_peers(grpc_servers, 2, strict)
    channels = ChannelPool()
    try:
        for peers, expected in ((lenient_peers, NOT_FOUND), (strict_peers, UNAUTHENTICATED)):
            sender, reducer = peers
            unkeyed = opening(sender, reducer, os.urandom(16))
            code, details = await outcome(channels, reducer, unkeyed)
            assert code == expected, details  # NOT_FOUND: verified, no such round here

            keyed = averaging_pb2.ReduceRequest(
                group_id=os.urandom(16), part_index=0, weight=1.0, stream_key=bytes(32)
            )
            keyed.chunk.CopyFrom(get_codec("none").encode(np.ones(4, np.float32), CodecInfo()))
            digest = reduce_digest(keyed.group_id, 0, 1.0, 0, keyed.stream_key)
            keyed.header.CopyFrom(sender.signer.sign(reducer.identity.peer_id, REDUCE, digest))
            code, details = await outcome(channels, reducer, keyed)
            assert code == INVALID_ARGUMENT, details
            assert "carries no chunk" in details
    finally:
        await allreduce_peers.close_peers(lenient_peers + strict_peers)
        await channels.close()
