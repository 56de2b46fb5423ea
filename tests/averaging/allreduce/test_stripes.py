"""A sender's part over several streams to its reducer (stripes), at both ends.

With ``streams_per_reducer`` above 1 (1 by default: docs/benchmarks.md), once a reducer
said it takes them, a sender splits each part over that many data-plane connections,
stream ``k`` of ``K`` carrying the chunks whose index is ``k`` modulo ``K`` and bringing
back their averages.

Without a network: the stripe fields are signed, absent for one stream (the digest older
reducers check), and a reducer's word on how many it takes is covered by each reply's tag.
With real gRPC servers and data planes on 127.0.0.1: the first round to a reducer runs one
stream (nothing said yet), later rounds open ``streams_per_reducer`` connections per reducer
and end exact and bit-identical; a reducer that does not say so (an older one) keeps one, as
does the default;
hand-made striped streams from a member are served chunk by chunk on their own streams,
and streams of one sender that disagree are refused and drop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import NoReturn

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce import service as service_module
from swarmavg.averaging.allreduce.config import MAX_STREAMS_PER_SENDER, AllReduceConfig
from swarmavg.averaging.allreduce.keyed_stream import (
    SealingContext,
    SenderHandshake,
    StreamSeal,
    answer,
)
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.allreduce.round import stream_chunks
from swarmavg.averaging.allreduce.stream_mac import IntegrityError
from swarmavg.averaging.allreduce.wire import (
    OutgoingChunk,
    deserialize_reply,
    deserialize_request,
    encode_response,
    reduce_digest,
    serialize_pieces,
)
from swarmavg.averaging.group import Mode
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.stubs import REDUCE
from swarmavg.dht import Authenticator, ChannelPool, Identity, RequestSigner
from swarmavg.proto import averaging_pb2
from tests.averaging import allreduce_peers
from tests.averaging.allreduce.test_allreduce_hostile import HONEST, QUICK, Hostile
from tests.averaging.allreduce_peers import FAST, LocalPeer
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)

RUN = "stripes-run"
GROUP = b"s" * 16
# The stall detector at the package's default: these rounds have no silent sender, and a
# sender's later stripes open their own connections mid-round, whose handshakes on a loaded
# machine (the suite beside) outlasted FAST's 1 s pace once and cut all three senders.
STRIPED = dataclasses.replace(FAST, streams_per_reducer=4, min_stall=AllReduceConfig.min_stall)


# -- without a network --------------------------------------------------------------------


def test_one_stream_sends_no_stripe_fields_and_several_are_signed() -> None:
    sender, reducer = Identity.generate(), Identity.generate()
    signer = RequestSigner(sender, RUN, lambda: "")
    one = SenderHandshake(sender.peer_id, reducer.peer_id, GROUP, 1)
    first = deserialize_request(serialize_pieces(one.opening(signer, 1.0)))
    assert (first.stripe, first.stripes) == (0, 0)
    # What an older reducer checks: the digest of a stream without stripes is unchanged.
    assert reduce_digest(GROUP, 1, 1.0, 0, first.stream_key) == reduce_digest(
        GROUP, 1, 1.0, 0, first.stream_key, b"", 0, 0
    )

    striped = SenderHandshake(sender.peer_id, reducer.peer_id, GROUP, 1)
    first = deserialize_request(serialize_pieces(striped.opening(signer, 1.0, 2, 4)))
    assert (first.stripe, first.stripes) == (2, 4)
    assert first.names_round
    authenticator = Authenticator(reducer, RUN)
    signed = reduce_digest(GROUP, 1, 1.0, 0, first.stream_key, b"", 2, 4)
    assert first.header is not None
    assert authenticator.check(first.header, REDUCE, signed) == sender.peer_id
    # Another stripe than the one signed does not verify.
    other = reduce_digest(GROUP, 1, 1.0, 0, first.stream_key, b"", 1, 4)
    with pytest.raises(Exception, match="signature"):
        Authenticator(reducer, RUN).check(first.header, REDUCE, other)


def _keyed_stream() -> tuple[StreamSeal, StreamSeal]:
    """A full handshake's seals: the sender's, the reducer's."""
    sender, reducer = Identity.generate(), Identity.generate()
    handshake = SenderHandshake(sender.peer_id, reducer.peer_id, GROUP, 1)
    opening = deserialize_request(
        serialize_pieces(handshake.opening(RequestSigner(sender, RUN, lambda: ""), 1.0))
    )
    reply, seal = answer(opening, sender.peer_id, RequestSigner(reducer, RUN, lambda: ""))
    keys = handshake.accept(deserialize_reply(serialize_pieces(reply)), Authenticator(sender, RUN))
    return keys, seal


class _Written:
    """A reducer's stream context that keeps what is written."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []

    async def write(self, message: OutgoingChunk) -> None:
        self.messages.append(serialize_pieces(message))

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise AssertionError(details)


async def test_a_reducers_word_on_stripes_rides_under_each_replys_tag() -> None:
    keys, seal = _keyed_stream()
    written = _Written()
    sealing = SealingContext(written, seal.outbound, MAX_STREAMS_PER_SENDER)
    await sealing.write(encode_response(None, 3, 0))
    await sealing.end("done")
    for data in written.messages:  # an older sender skips the field; the tag covers it
        reply = deserialize_reply(data)
        assert reply.stripes == MAX_STREAMS_PER_SENDER
        keys.inbound.check(reply.covered, reply.mac)
    # Without a word (an older reducer): no field, and the sender reads 0.
    keys, seal = _keyed_stream()
    written = _Written()
    await SealingContext(written, seal.outbound).write(encode_response(None, 3, 0))
    reply = deserialize_reply(written.messages[0])
    assert reply.stripes == 0
    keys.inbound.check(reply.covered, reply.mac)


async def test_a_word_on_stripes_altered_on_the_path_fails_its_tag() -> None:
    keys, seal = _keyed_stream()
    written = _Written()
    await SealingContext(written, seal.outbound, 8).write(encode_response(None, 3, 0))
    tampered = bytearray(written.messages[0])
    at = tampered.rindex(bytes([10 << 3, 8]))  # ReduceResponse.stripes = 8
    tampered[at + 1] = 1
    forged = deserialize_reply(bytes(tampered))
    assert forged.stripes == 1
    with pytest.raises(IntegrityError):
        keys.inbound.check(forged.covered, forged.mac)


def test_stream_chunks_splits_a_part_among_its_streams() -> None:
    assert [stream_chunks(10, k, 4) for k in range(4)] == [3, 3, 2, 2]
    assert stream_chunks(3, 0, 1) == 3
    assert stream_chunks(3, 0, 0) == 3  # absent: one stream
    assert sum(stream_chunks(7, k, 7) for k in range(7)) == 7


def test_streams_per_reducer_is_bounded() -> None:
    assert AllReduceConfig().streams_per_reducer == 1  # off unless asked for
    with pytest.raises(ValueError, match="streams_per_reducer"):
        dataclasses.replace(FAST, streams_per_reducer=0)
    with pytest.raises(ValueError, match="streams_per_reducer"):
        dataclasses.replace(FAST, streams_per_reducer=MAX_STREAMS_PER_SENDER + 1)


# -- real rounds ---------------------------------------------------------------------------


def _opened(peers: list[LocalPeer]) -> list[int]:
    connectors = [p.service.data_connector for p in peers]
    return [c.opened if c is not None else 0 for c in connectors]


async def test_later_rounds_split_each_part_over_several_connections(
    grpc_servers: GrpcServerPool,
) -> None:
    peers = await allreduce_peers.start_peers(grpc_servers, 4, STRIPED, data_plane=True)
    channels = ChannelPool()
    try:
        await allreduce_peers.exact_round(peers, channels, seed=1)
        # Nothing said before: one stream, one connection to each reducer.
        assert _opened(peers) == [3, 3, 3, 3]
        for i, sender in enumerate(peers):
            for j, reducer in enumerate(peers):
                if i != j:
                    held = sender.service.resumptions.for_reducer(reducer.identity.peer_id)
                    assert held is not None
                    assert held.stripes == MAX_STREAMS_PER_SENDER
        before = _opened(peers)
        await allreduce_peers.exact_round(peers, channels, seed=2)
        # Four streams to each of 3 reducers: the idle connection and 3 new ones each.
        assert [after - b for after, b in zip(_opened(peers), before, strict=True)] == [9] * 4
        # The 12 connections idle between rounds and are reused: none opened.
        await allreduce_peers.exact_round(peers, channels, seed=3)
        assert [after - b for after, b in zip(_opened(peers), before, strict=True)] == [9] * 4
    finally:
        await channels.close()
        await allreduce_peers.close_peers(peers)


async def test_a_reducer_that_does_not_say_it_takes_stripes_keeps_one_stream(
    grpc_servers: GrpcServerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An older reducer: its replies carry no stripes field.
    monkeypatch.setattr(service_module, "MAX_STREAMS_PER_SENDER", 0)
    peers = await allreduce_peers.start_peers(grpc_servers, 3, STRIPED, data_plane=True)
    channels = ChannelPool()
    try:
        for seed in range(3):
            await allreduce_peers.exact_round(peers, channels, seed=seed)
        assert _opened(peers) == [2, 2, 2]  # one connection per reducer, reused
        held = peers[0].service.resumptions.for_reducer(peers[1].identity.peer_id)
        assert held is not None
        assert held.stripes == 1
    finally:
        await channels.close()
        await allreduce_peers.close_peers(peers)


async def test_one_stream_to_each_reducer_by_default(grpc_servers: GrpcServerPool) -> None:
    assert FAST.streams_per_reducer == 1
    peers = await allreduce_peers.start_peers(grpc_servers, 3, FAST, data_plane=True)
    channels = ChannelPool()
    try:
        for seed in range(3):
            await allreduce_peers.exact_round(peers, channels, seed=seed)
        assert _opened(peers) == [2, 2, 2]
    finally:
        await channels.close()
        await allreduce_peers.close_peers(peers)


# -- hand-made striped streams at a reducer -----------------------------------------------


async def _stream(
    channels: ChannelPool,
    address: str,
    messages: list[averaging_pb2.ReduceRequest],
    until: float,
) -> tuple[grpc.StatusCode, list[int]]:
    """Write ``messages`` and close; read the replies' chunk indices and the status."""
    call = channels.channel(address).stream_stream(
        "/swarmavg.v1.Averaging/Reduce",
        request_serializer=averaging_pb2.ReduceRequest.SerializeToString,
        response_deserializer=averaging_pb2.ReduceResponse.FromString,
    )(timeout=until - time.monotonic())

    async def write() -> None:
        for message in messages:
            await call.write(message)
        await call.done_writing()

    writer = asyncio.get_running_loop().create_task(write())
    chunks: list[int] = []
    try:
        while (reply := await call.read()) is not grpc.aio.EOF:
            chunks.append(reply.chunk_index)
    except grpc.aio.AioRpcError:
        pass
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.RpcError, asyncio.InvalidStateError):
            await writer
    return await call.code(), chunks


async def _with_a_striping_member(
    grpc_servers: GrpcServerPool,
    channels: ChannelPool,
    streams: list[tuple[int, int, list[int]]],
) -> tuple[list[list[tuple[grpc.StatusCode, list[int]]]], list[AveragingResult], np.ndarray]:
    """The honest members' round, with member ``HONEST`` (a client) sending its part to
    each honest reducer over hand-made ``streams``: (stripe, stripes, chunk indices)."""
    peers = await allreduce_peers.start_peers(grpc_servers, HONEST + 1, QUICK)
    try:
        rng = np.random.default_rng(3)
        inputs = [[rng.standard_normal(9000).astype(np.float32)] for _ in peers]
        weights = [1.0, 2.0, 0.5, 1.0]
        mean = weighted_mean([x[0] for x in inputs[:HONEST]], weights[:HONEST])
        group = allreduce_peers.make_group(peers, inputs[0], [Mode.NODE] * HONEST + [Mode.CLIENT])
        member = Hostile(group, peers[HONEST].identity, mean)
        until = time.monotonic() + 20

        async def part(p: int) -> list[tuple[grpc.StatusCode, list[int]]]:
            calls = []
            for stripe, stripes, chunks in streams:
                messages = [member.first(p, None, stripe=stripe, stripes=stripes)]
                messages += [member.chunk(p, c) for c in chunks]
                calls.append(_stream(channels, peers[p].address, messages, until))
            return list(await asyncio.gather(*calls))

        honest_run = allreduce_peers.run_group(
            peers, group, inputs, weights, channels, timeout=20, skip=[HONEST]
        )
        *codes, results = await asyncio.gather(*(part(p) for p in range(HONEST)), honest_run)
        honest = [r for r in results if r is not None]
        assert len(honest) == HONEST
        assert all(isinstance(r, AveragingResult) for r in honest), honest
        for r in honest:
            np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
        return codes, honest, mean  # type: ignore[return-value]
    finally:
        await allreduce_peers.close_peers(peers)


async def test_a_member_sending_over_two_streams_gets_each_average_on_its_own_stream(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    # Parts of 3000 elements in chunks of 1024: chunks 0 and 2 on stream 0, 1 on stream 1.
    codes, honest, _ = await _with_a_striping_member(
        grpc_servers, channels, [(0, 2, [0, 2]), (1, 2, [1])]
    )
    for per_part in codes:
        assert per_part == [(grpc.StatusCode.OK, [0, 2]), (grpc.StatusCode.OK, [1])]
    for r in honest:
        assert not r.partial, r.dropped
        assert HONEST not in r.dropped
        assert r.group_size == HONEST + 1


async def test_streams_of_one_sender_that_disagree_drop_it(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    codes, honest, _ = await _with_a_striping_member(
        grpc_servers, channels, [(0, 2, [0, 2]), (1, 3, [1])]
    )
    for per_part in codes:
        assert grpc.StatusCode.INVALID_ARGUMENT in [code for code, _ in per_part]
    for r in honest:
        assert "disagree" in r.dropped[HONEST] or "stream" in r.dropped[HONEST], r.dropped


async def test_a_second_stream_with_the_same_stripe_is_refused(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    codes, _, _ = await _with_a_striping_member(
        grpc_servers, channels, [(0, 2, [0, 2]), (0, 2, [0, 2]), (1, 2, [1])]
    )
    for per_part in codes:
        assert grpc.StatusCode.ALREADY_EXISTS in [code for code, _ in per_part]
