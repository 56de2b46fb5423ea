"""A hostile reducer's replies are refused: its part keeps local values, the rest is exact.

The hostile member is a ``NODE`` of the group whose server answers every chunk the honest
members send it with a forged reply (NaN, wrong size, duplicate, out of range, garbage,
a flood of tiny fields) and never sends anything itself, so the honest reducers drop it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.allreduce.wire import (
    OutgoingChunk,
    Request,
    encode_response,
    serialize_pieces,
)
from swarmavg.averaging.group import GroupInfo, Member, Mode
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.service import reduce_method_handler
from swarmavg.compression import CodecInfo, get_codec
from swarmavg.dht import ChannelPool, Identity
from swarmavg.proto import averaging_pb2
from tests.averaging.allreduce_peers import (
    FAST,
    close_peers,
    make_group,
    run_group,
    start_peers,
)
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)

HONEST = 3
CODEC = get_codec("none")
# The honest senders wait max(3 x min_stall, registration_wait) for a reply of the hostile
# reducer they can use before they keep its part local, the path under test: 1.5 s here
# rather than FAST's 3 s. A reducer waits 2 x min_stall (1 s) for an honest sender's first
# chunk, far longer than the senders of this one process take.
QUICK = dataclasses.replace(FAST, min_stall=0.5, registration_wait=1.5)


def _encoded(values: np.ndarray, index: int, senders: int = HONEST) -> bytes:
    return serialize_pieces(
        encode_response(CODEC.encode_payload(values, CodecInfo()), index, senders)
    )


def _nan(request: Request, size: int) -> list[bytes]:
    values = np.zeros(size, np.float32)
    wire = bytearray(_encoded(values, request.chunk_index))
    wire[-4:] = np.array([np.nan], np.float32).tobytes()  # codecs refuse to encode NaN
    return [bytes(wire)]


FORGERIES: dict[str, Callable[[Request, int], list[bytes]]] = {
    "nan": _nan,
    "wrong-size": lambda r, n: [_encoded(np.zeros(n + 1, np.float32), r.chunk_index)],
    "wrong-dtype": lambda r, n: [_encoded(np.zeros(n, np.float64), r.chunk_index)],
    # The first reply echoes the sender's own values (a reducer's data cannot be checked,
    # only its form), the duplicate is refused.
    "twice": lambda r, n: (
        [_encoded(np.frombuffer(r.payload or b"", np.float32), r.chunk_index)] * 2
    ),
    "out-of-range": lambda r, n: [_encoded(np.zeros(n, np.float32), 10**6)],
    "garbage": lambda r, n: [b"\xff" * 64],
    "field-flood": lambda r, n: [b"\x78\x00" * (1 << 20)],
    "other-codec": lambda r, n: [
        averaging_pb2.ReduceResponse(
            chunk=get_codec("float16").encode(np.zeros(n, np.float32)),
            chunk_index=r.chunk_index,
            num_senders=HONEST,
        ).SerializeToString()
    ],
}


def _hostile_reducer(forge: Callable[[Request, int], list[bytes]]) -> Any:
    async def reduce(
        requests: AsyncIterator[Request], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        async for request in requests:
            if request.chunk is None:
                continue
            for reply in forge(request, request.chunk.size):
                await context.write(OutgoingChunk((reply,), len(reply)))

    return reduce


def _registering(forge: Callable[[Request, int], list[bytes]]) -> Any:
    """A server registration whose ``Reduce`` answers every chunk with ``forge``'s replies."""

    def register(server: grpc.aio.Server, _: int) -> None:
        handlers = {"Reduce": reduce_method_handler(_hostile_reducer(forge))}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("swarmavg.v1.Averaging", handlers),)
        )

    return register


def _with_hostile(honest_group: GroupInfo, hostile_address: str) -> GroupInfo:
    """``honest_group`` with a last member, the hostile reducer at ``hostile_address``."""
    hostile = Member(Identity.generate().peer_id, hostile_address, Mode.NODE, 1.0)
    return GroupInfo(
        honest_group.group_id,
        (*honest_group.members, hostile),
        honest_group.schema_hash,
        honest_group.codec,
    )


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("forgery", list(FORGERIES))
async def test_hostile_reducer_leaves_its_part_local(
    grpc_servers: GrpcServerPool, channels: ChannelPool, forgery: str, in_place: bool
) -> None:
    """In place (the daemon's shared memory), a forged reply must not clobber the local
    values it would have replaced: they are checked whole before anything is written."""
    peers = await start_peers(grpc_servers, HONEST, QUICK)
    [hostile_address] = await grpc_servers.start(1, _registering(FORGERIES[forgery]))
    try:
        rng = np.random.default_rng(11)
        inputs = [[rng.standard_normal(9000).astype(np.float32)] for _ in range(HONEST + 1)]
        originals = [[t.copy() for t in ts] for ts in inputs]
        outs = [inputs[i] if in_place else None for i in range(HONEST + 1)]
        weights = [1.0, 2.0, 0.5, 1.0]
        group = _with_hostile(make_group(peers, inputs[0]), hostile_address)
        started = time.monotonic()
        results = await run_group(
            [*peers, peers[0]],
            group,
            inputs,
            weights,
            channels,
            timeout=20,
            skip=[HONEST],
            outs=outs,
        )
        assert time.monotonic() - started < 20 + 2
        mean = weighted_mean([x[0] for x in originals[:HONEST]], weights[:HONEST])
        honest = [r for r in results if r is not None]
        assert len(honest) == HONEST
        for i, r in enumerate(honest):
            assert isinstance(r, AveragingResult), r
            assert r.partial
            assert r.failed_parts == (HONEST,)
            out, own = r.tensors[0], originals[i][0]
            if in_place:
                assert np.shares_memory(out, inputs[i][0])  # averaged where the inputs were
            kept = out == own  # the hostile part: this member's own values
            assert kept.sum() >= 9000 // (HONEST + 1) - 1
            np.testing.assert_allclose(out[~kept], mean[~kept], rtol=1e-5, atol=1e-6)
            assert np.isfinite(out).all()
    finally:
        await close_peers(peers)


def _blockwise_reply(request: Request, size: int, damage: str) -> list[bytes]:
    """An uint8-blockwise reply of zeros, damaged after encoding (a NaN block scale: the
    payload's last float32; or cut short)."""
    encoded = get_codec("uint8-blockwise").encode_payload(np.ones(size, np.float32), CodecInfo())
    wire = bytearray(serialize_pieces(encode_response(encoded, request.chunk_index, HONEST)))
    if damage == "nan-scale":
        wire[-4:] = np.array([np.nan], np.float32).tobytes()
    else:  # "short": the payload loses its last scale (the header still declares it)
        del wire[-4:]
    return [bytes(wire)]


@pytest.mark.parametrize("damage", ["nan-scale", "short"])
async def test_a_codec_that_decodes_cleanly_into_the_result_keeps_local_values(
    grpc_servers: GrpcServerPool, channels: ChannelPool, damage: str
) -> None:
    """uint8-blockwise decodes replies straight into the result in place (it checks the
    whole payload before writing): a damaged reply leaves this member's values as they
    were, bit for bit."""
    assert get_codec("uint8-blockwise").decodes_into_cleanly
    peers = await start_peers(grpc_servers, HONEST, QUICK)
    forge = _registering(lambda r, n: _blockwise_reply(r, n, damage))
    [hostile_address] = await grpc_servers.start(1, forge)
    try:
        rng = np.random.default_rng(12)
        inputs = [[rng.standard_normal(9000).astype(np.float32)] for _ in range(HONEST + 1)]
        originals = [[t.copy() for t in ts] for ts in inputs]
        blockwise = make_group(peers, inputs[0], codec="uint8-blockwise")
        group = _with_hostile(blockwise, hostile_address)
        results = await run_group(
            [*peers, peers[0]],
            group,
            inputs,
            [1.0] * (HONEST + 1),
            channels,
            timeout=20,
            skip=[HONEST],
            outs=list(inputs),
        )
        honest = [r for r in results if r is not None]
        assert len(honest) == HONEST
        sizes = part_sizes(group.members, 9000)
        part = slice(sum(sizes[:HONEST]), sum(sizes[: HONEST + 1]))  # the hostile's
        for i, r in enumerate(honest):
            assert isinstance(r, AveragingResult), r
            assert r.failed_parts == (HONEST,)
            assert np.shares_memory(r.tensors[0], inputs[i][0])
            assert r.tensors[0][part].tobytes() == originals[i][0][part].tobytes()
            assert np.isfinite(r.tensors[0]).all()
    finally:
        await close_peers(peers)
