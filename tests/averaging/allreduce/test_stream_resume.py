"""Resumed keyed streams: a later stream between two peers keyed without a handshake.

Without a network: both ends derive the same resumed key, the ticket is covered by the
first message's signature, and a ticket the reducer does not hold finds nothing. With real
gRPC servers and data planes on 127.0.0.1: rounds after the first resume (no new full
handshake), and a reducer that lost its secrets (a restart) refuses the resumed streams,
which the senders open again with a full handshake: every round whole and exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.averaging.allreduce.keyed_stream import SenderHandshake, answer, resume
from swarmavg.averaging.allreduce.stream_mac import IntegrityError
from swarmavg.averaging.allreduce.stream_resume import ResumptionCache
from swarmavg.averaging.allreduce.wire import (
    deserialize_reply,
    deserialize_request,
    encode_request,
    encode_response,
    reduce_digest,
    sealed,
    serialize_pieces,
)
from swarmavg.compression import CodecInfo, get_codec
from swarmavg.dht import Authenticator, ChannelPool, Identity, RequestSigner
from swarmavg.dht.identity import HeaderError
from tests.averaging import allreduce_peers
from tests.averaging.allreduce_peers import FAST, LocalPeer
from tests.harness import GrpcServerPool

RUN = "resume-run"
GROUP = b"r" * 16


def _payload(value: float) -> object:
    return get_codec("none").encode_payload(np.full(256, value, np.float32), CodecInfo())


def test_both_ends_derive_the_resumed_key_and_the_ticket_is_signed() -> None:
    sender, reducer = Identity.generate(), Identity.generate()
    sender_signer = RequestSigner(sender, RUN, lambda: "")
    # A full handshake first: both ends get the same resumption.
    full = SenderHandshake(sender.peer_id, reducer.peer_id, GROUP, 1)
    opening = deserialize_request(serialize_pieces(full.opening(sender_signer, 1.0)))
    reply, reducer_seal = answer(opening, sender.peer_id, RequestSigner(reducer, RUN, lambda: ""))
    sender_seal = full.accept(
        deserialize_reply(serialize_pieces(reply)), Authenticator(sender, RUN)
    )
    assert sender_seal.resumption is not None
    assert reducer_seal.resumption is not None
    assert sender_seal.resumption.ticket == reducer_seal.resumption.ticket
    assert sender_seal.resumption.secret == reducer_seal.resumption.secret

    cache = ResumptionCache()
    cache.remember_sender(sender.peer_id, reducer_seal.resumption)
    # A later stream resumes: its first message names the ticket, under the signature.
    later = SenderHandshake(sender.peer_id, reducer.peer_id, b"s" * 16, 2, sender_seal.resumption)
    first = deserialize_request(serialize_pieces(later.opening(sender_signer, 1.0)))
    assert first.resume == sender_seal.resumption.ticket
    checker = Authenticator(reducer, RUN)
    assert first.header is not None
    with pytest.raises(HeaderError):  # the digest without the ticket: not what was signed
        checker.check(first.header, first.header.method, reduce_digest(b"s" * 16, 2, 1.0, 0))
    digest = reduce_digest(b"s" * 16, 2, 1.0, 0, first.stream_key, first.resume)
    assert checker.check(first.header, first.header.method, digest) == sender.peer_id
    held = cache.for_sender(sender.peer_id, first.resume)
    assert held is not None
    assert cache.for_sender(sender.peer_id, b"x" * 16) is None  # another ticket
    assert cache.for_sender(reducer.peer_id, first.resume) is None  # another sender

    at_sender = later.resumed_seal()
    at_reducer = resume(first, sender.peer_id, reducer.peer_id, held)
    assert at_sender.resumption is None  # a resumed stream leaves no new secret
    chunk = deserialize_request(
        serialize_pieces(sealed(encode_request(_payload(1.0), 0), at_sender.outbound))  # type: ignore[arg-type]
    )
    at_reducer.inbound.check(chunk.covered, chunk.mac)
    average = deserialize_reply(
        serialize_pieces(sealed(encode_response(_payload(0.5), 0, 2), at_reducer.outbound))  # type: ignore[arg-type]
    )
    at_sender.inbound.check(average.covered, average.mac)
    # Another stream resuming with the same secret has another key (the stream's own
    # signed nonce and key are in it): its tags do not verify here.
    other = SenderHandshake(sender.peer_id, reducer.peer_id, b"s" * 16, 2, sender_seal.resumption)
    other.opening(sender_signer, 1.0)
    forged = deserialize_request(
        serialize_pieces(sealed(encode_request(_payload(1.0), 1), other.resumed_seal().outbound))  # type: ignore[arg-type]
    )
    with pytest.raises(IntegrityError):
        at_reducer.inbound.check(forged.covered, forged.mac)


def _tickets(peers: list[LocalPeer]) -> dict[tuple[int, int], bytes | None]:
    """The ticket each peer would resume with to each other peer (None: none held)."""
    out: dict[tuple[int, int], bytes | None] = {}
    for i, sender in enumerate(peers):
        for j, reducer in enumerate(peers):
            if i != j:
                held = sender.service.resumptions.for_reducer(reducer.identity.peer_id)
                out[i, j] = held.ticket if held is not None else None
    return out


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
async def test_later_rounds_resume_and_a_reducer_that_lost_its_secrets_is_handshaken_again(
    grpc_servers: GrpcServerPool, data_plane: bool
) -> None:
    peers = await allreduce_peers.start_peers(grpc_servers, 3, FAST, data_plane=data_plane)
    channels = ChannelPool()
    try:
        await allreduce_peers.exact_round(peers, channels, seed=1)
        first = _tickets(peers)
        assert all(ticket is not None for ticket in first.values()), first

        await allreduce_peers.exact_round(peers, channels, seed=2)
        assert _tickets(peers) == first  # resumed: no full handshake made a new secret

        peers[0].service.resumptions = ResumptionCache()  # reducer 0 restarted
        await allreduce_peers.exact_round(peers, channels, seed=3)
        third = _tickets(peers)
        for (i, j), ticket in third.items():
            if 0 in (i, j):
                # Reducer 0 refused the others' tickets, and its own as a sender are gone:
                # full handshakes again, new secrets.
                assert ticket is not None
                assert ticket != first[i, j]
            else:
                assert ticket == first[i, j]
    finally:
        await channels.close()
        await allreduce_peers.close_peers(peers)
