"""Signed ``JoinGroup`` answers (averaging/matchmaking/answers.py): pure checks."""

from __future__ import annotations

import time

from swarmavg.averaging.matchmaking.answers import FINAL, FIRST, answer_fault, sign_answer
from swarmavg.averaging.matchmaking.declarations import decode_declaration
from swarmavg.averaging.stubs import JOIN_GROUP
from swarmavg.dht.auth import Authenticator, RequestSigner, message_digest
from swarmavg.dht.identity import Identity
from swarmavg.dht.records import owner_suffix
from swarmavg.proto import averaging_pb2
from tests.dht.test_key_classes import declaration

RUN = "test"


def _parties() -> tuple[RequestSigner, Authenticator, RequestSigner, Authenticator]:
    leader, follower = Identity.generate(), Identity.generate()
    return (
        RequestSigner(leader, RUN, lambda: "127.0.0.1:1"),
        Authenticator(leader, RUN),
        RequestSigner(follower, RUN, lambda: "127.0.0.1:2"),
        Authenticator(follower, RUN),
    )


def _request(signer: RequestSigner, leader_id: bytes) -> averaging_pb2.JoinRequest:
    request = averaging_pb2.JoinRequest(key="run.k.0b", signed_answers=True)
    request.header.CopyFrom(signer.sign(leader_id, JOIN_GROUP, message_digest(request)))
    return request


def _accepted(leader_id: bytes) -> averaging_pb2.JoinResponse:
    return averaging_pb2.JoinResponse(
        code=averaging_pb2.JOIN_ACCEPTED, leader_id=leader_id, deadline=time.time() + 5
    )


def test_a_leaders_answer_verifies_at_its_position_on_its_stream_only() -> None:
    leader, _, follower, checks = _parties()
    request = _request(follower, leader.peer_id)
    answer = sign_answer(leader, request.header, _accepted(leader.peer_id), FIRST)
    assert answer_fault(checks, request.header, answer, FIRST, leader.peer_id) is None

    # Replayed as the stream's final answer, or onto another request's stream.
    assert answer_fault(checks, request.header, answer, FINAL, leader.peer_id) is not None
    other = _request(follower, leader.peer_id)
    assert answer_fault(checks, other.header, answer, FIRST, leader.peer_id) is not None
    # Signed by someone else than the leader asked.
    assert answer_fault(checks, request.header, answer, FIRST, follower.peer_id) is not None


def test_an_altered_or_unsigned_answer_fails() -> None:
    leader, _, follower, checks = _parties()
    request = _request(follower, leader.peer_id)
    answer = sign_answer(leader, request.header, _accepted(leader.peer_id), FIRST)
    for change in (
        lambda a: setattr(a, "code", averaging_pb2.JOIN_REJECT_SCHEMA_MISMATCH),
        lambda a: a.taken.append(bytes(20)),
        lambda a: setattr(a, "deadline", a.deadline + 1),
        lambda a: a.ClearField("header"),
    ):
        forged = averaging_pb2.JoinResponse()
        forged.CopyFrom(answer)
        change(forged)
        assert answer_fault(checks, request.header, forged, FIRST, leader.peer_id) is not None


def test_a_declaration_says_whether_its_peer_signs_answers() -> None:
    """Decoded as encoded; an older peer's declaration (no field) does not sign; a field
    of another type makes the declaration malformed."""
    peer_id = Identity.generate().peer_id
    subkey = owner_suffix(peer_id)
    encoded = declaration(peer_id)
    assert encoded["sa"] is False
    signing = decode_declaration(subkey, {**encoded, "sa": True})
    assert signing is not None
    assert signing.signs_answers
    older = decode_declaration(subkey, {k: v for k, v in encoded.items() if k != "sa"})
    assert older is not None
    assert not older.signs_answers
    assert decode_declaration(subkey, {**encoded, "sa": 1}) is None
