"""Signed ``JoinGroup`` answers: a leader's word on the stream, not the path's.

A follower's request is signed; the leader's answers (accepted, redirect, the formed group,
a rejection with ``taken``, disbanded) used to travel bare, so a relay or anyone on the path
could end a follower's round with a forged rejection (``JOIN_REJECT_SCHEMA_MISMATCH`` bans
the leader for the round) or send it to another "leader". A leader now signs each answer as
the answer to that request: the signature covers the answer, the request's nonce and the
answer's position on the stream (0 the first, 1 the final one), so an answer cannot be
altered, taken from another stream or replayed at another position. A follower that asked
for signed answers and knows its leader signs them (its signed declaration says so) takes
no unsigned or wrongly signed answer: it treats one as no answer (a transport failure,
retried after a pause), which is all a path that can drop messages could do anyway.
"""

from __future__ import annotations

from swarmavg.averaging.stubs import JOIN_GROUP
from swarmavg.dht.auth import Authenticator, RequestSigner, message_digest
from swarmavg.proto import averaging_pb2, common_pb2

FIRST, FINAL = 0, 1
"""Positions of an answer on a ``JoinGroup`` stream: every stream has at most two."""


def _digest(answer: averaging_pb2.JoinResponse, nonce: bytes, position: int) -> bytes:
    return message_digest(answer, bound_to=nonce + bytes([position]))


def sign_answer(
    signer: RequestSigner,
    request: common_pb2.RequestHeader,
    answer: averaging_pb2.JoinResponse,
    position: int,
) -> averaging_pb2.JoinResponse:
    """``answer`` signed (in place) as the ``position``-th answer to ``request``."""
    digest = _digest(answer, bytes(request.nonce), position)
    answer.header.CopyFrom(signer.sign_response(request, JOIN_GROUP, digest))
    return answer


def answer_fault(
    authenticator: Authenticator,
    request: common_pb2.RequestHeader,
    answer: averaging_pb2.JoinResponse,
    position: int,
    leader_id: bytes,
) -> str | None:
    """Why ``answer`` is not ``leader_id``'s ``position``-th answer to our ``request``
    (unsigned, altered, another stream's or position's, another signer's); ``None`` when
    it is."""
    if not answer.HasField("header"):
        return "the answer is not signed"
    digest = _digest(answer, bytes(request.nonce), position)
    try:
        authenticator.check_response(answer.header, JOIN_GROUP, digest, leader_id)
    except ValueError as error:  # HeaderError and AuthenticationError
        return str(error)
    return None
