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

A formed group's answer also carries the members' signed requests as the leader received
them (``member_requests``): each repeats its sender's declaration under the sender's own
signature, so a member checks every entry of the group without reading the DHT
(:func:`forwarded_sender`), and the leader's own entry is its word in the signed answer.
"""

from __future__ import annotations

from swarmavg.averaging.stubs import JOIN_GROUP
from swarmavg.dht.auth import (
    NONCE_BYTES,
    Authenticator,
    RequestSigner,
    message_digest,
    signed_payload,
)
from swarmavg.dht.identity import HeaderError, verify_header, verify_signature
from swarmavg.proto import averaging_pb2, common_pb2

FIRST, FINAL = 0, 1
"""Positions of an answer on a ``JoinGroup`` stream: every stream has at most two."""
MAX_FORWARDED_BYTES = 256 * 1024
"""The most bytes of members' requests a formed group's answer carries (user data may
make them large); beyond, the members read the declarations as before."""


def forwarded_requests(
    requests: list[averaging_pb2.JoinRequest],
) -> list[averaging_pb2.JoinRequest]:
    """The members' requests a formed group's answer carries: all, or none when they
    would pass :data:`MAX_FORWARDED_BYTES`."""
    if sum(r.ByteSize() for r in requests) > MAX_FORWARDED_BYTES:
        return []
    return requests


def forwarded_sender(
    request: averaging_pb2.JoinRequest, leader_id: bytes, run_id: str, now: float, window: float
) -> bytes | None:
    """The sender of a ``JoinGroup`` request a leader forwarded, when its signature
    verifies as a request to that leader stamped within ``window`` of ``now``; else
    ``None``. No replay cache: the request is evidence of what its sender declared under
    the request's key (which the caller checks), not a request to us."""
    header = request.header
    try:
        sender = verify_header(header, run_id)
    except HeaderError:
        return None
    if (
        header.method != JOIN_GROUP
        or header.receiver_id != leader_id
        or len(header.nonce) != NONCE_BYTES
        or not abs(header.timestamp - now) <= window
    ):
        return None
    payload = signed_payload(header, message_digest(request), response=False)
    if not verify_signature(header.public_key, header.signature, payload):
        return None
    return sender


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
