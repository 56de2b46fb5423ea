"""Bounded member powers in the all-reduce, over real gRPC.

A member claiming an absurd bandwidth (1e9) used to reduce the whole vector (part sizes
``[0, 0, 0, N]``) and could then return any finite "average" with ``num_senders`` at or
above the group's size, and nothing was marked partial. Now its part is bounded
(``load_balancing.MAX_BANDWIDTH_RATIO``, ``MAX_SHARE_RATIO``), and a reply that claims more
senders than a reducer can have heard from makes the honest members distrust the whole
part: it keeps their local values, is reported in ``failed_parts``/``distrusted`` and the
result is partial. The rest of the vector is the honest members' exact mean.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest

from swarmavg.averaging.allreduce.keyed_stream import answer
from swarmavg.averaging.allreduce.load_balancing import MAX_SHARE_RATIO
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.allreduce.wire import Request, encode_response, sealed
from swarmavg.averaging.group import GroupInfo, Member, Mode
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.service import reduce_method_handler
from swarmavg.compression import CodecInfo, get_codec
from swarmavg.dht import ChannelPool, Identity
from swarmavg.dht.auth import RequestSigner
from tests.averaging.allreduce_peers import (
    RUN_ID,
    close_peers,
    make_group,
    run_group,
    start_peers,
)
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)

HONEST = 3
SIZE = 40_000
FORGED = 1e6
CODEC = get_codec("none")


def _forging_reducer(identity: Identity, num_senders: int) -> Any:
    """Answers every chunk at once with FORGED values, claiming ``num_senders`` senders.
    It is a member, so it keys each stream as an honest reducer does (its replies carry
    valid tags): what bounds it is the check of what it claims, not the MAC."""

    async def reduce(
        requests: AsyncIterator[Request], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        seal = None
        signer = RequestSigner(identity, RUN_ID, lambda: "")
        async for request in requests:
            if request.header is not None and request.stream_key:
                sender = bytes(request.header.peer_id)
                handshake, seal = answer(request, sender, signer)
                await context.write(handshake)
            if request.chunk is None or seal is None:
                continue
            values = np.full(request.chunk.size, FORGED, np.float32)
            payload = CODEC.encode_payload(values, CodecInfo())
            reply = encode_response(payload, request.chunk_index, num_senders)
            await context.write(sealed(reply, seal.outbound))

    return reduce


@pytest.mark.parametrize("claimed_senders", [HONEST + 2, 2**31])
async def test_inflated_bandwidth_then_a_forged_average_is_bounded_and_not_counted(
    grpc_servers: GrpcServerPool, channels: ChannelPool, claimed_senders: int
) -> None:
    claimant_identity = Identity.generate()

    def register(server: grpc.aio.Server, _: int) -> None:
        forger = _forging_reducer(claimant_identity, claimed_senders)
        handlers = {"Reduce": reduce_method_handler(forger)}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("swarmavg.v1.Averaging", handlers),)
        )

    peers = await start_peers(grpc_servers, HONEST)
    [claimant_address] = await grpc_servers.start(1, register)
    try:
        rng = np.random.default_rng(17)
        inputs = [[rng.standard_normal(SIZE).astype(np.float32)] for _ in range(HONEST + 1)]
        weights = [1.0, 2.0, 0.5, 1.0]
        honest_group = make_group(peers, inputs[0])
        claimant = Member(claimant_identity.peer_id, claimant_address, Mode.NODE, 1e9)
        group = GroupInfo(
            honest_group.group_id,
            (*honest_group.members, claimant),
            honest_group.schema_hash,
            honest_group.codec,
        )
        results = await run_group(
            [*peers, peers[0]], group, inputs, weights, channels, timeout=20, skip=[HONEST]
        )
        # The claimant never sends its own chunks: the honest reducers drop it, so their
        # parts are the honest members' mean.
        mean = weighted_mean([x[0] for x in inputs[:HONEST]], weights[:HONEST])
        honest = [r for r in results if r is not None]
        assert len(honest) == HONEST
        for i, r in enumerate(honest):
            assert isinstance(r, AveragingResult), r
            out, own = r.tensors[0], inputs[i][0]
            assert not (out == FORGED).any()  # nothing of the forgery is taken
            assert r.partial
            assert r.failed_parts == (HONEST,)
            assert "senders" in r.distrusted[HONEST]
            kept = out == own  # the claimant's part: this member's own values
            assert 0 < kept.sum() <= MAX_SHARE_RATIO * SIZE / (HONEST + 1) + 1
            assert r.local_fraction == pytest.approx(kept.sum() / SIZE, abs=1e-3)
            np.testing.assert_allclose(out[~kept], mean[~kept], rtol=1e-5, atol=1e-6)
            assert out.tobytes() != own.tobytes()
    finally:
        await close_peers(peers)
