"""The authenticator's rules without a network: window, replay cache bound, what is signed."""

from __future__ import annotations

import pytest

from swarmavg.dht.auth import (
    AuthenticationError,
    Authenticator,
    message_digest,
    sign_request,
)
from swarmavg.dht.identity import HeaderError, Identity
from swarmavg.proto import common_pb2, dht_pb2

RUN = "run"
METHOD = "/swarmavg.v1.DHT/Store"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def signed(
    sender: Identity, receiver: Identity, at: float, key: bytes = b"k"
) -> tuple[common_pb2.RequestHeader, bytes]:
    request = dht_pb2.StoreRequest(records=[dht_pb2.Record(key=key)])
    digest = message_digest(request)
    return sign_request(sender, RUN, "h:1", receiver.peer_id, METHOD, digest, now=at), digest


def test_a_signed_request_passes_once_and_its_digest_binds_the_body() -> None:
    sender, receiver = Identity.generate(), Identity.generate()
    auth = Authenticator(receiver, RUN, window=10, clock=Clock(1000.0))
    header, digest = signed(sender, receiver, 1000.0)
    assert auth.check(header, METHOD, digest) == sender.peer_id
    with pytest.raises(AuthenticationError, match="replay"):
        auth.check(header, METHOD, digest)
    header, _ = signed(sender, receiver, 1000.0)
    _, other_digest = signed(sender, receiver, 1000.0, key=b"other")
    with pytest.raises(AuthenticationError, match="signature"):
        auth.check(header, METHOD, other_digest)
    with pytest.raises(AuthenticationError, match="method"):
        auth.check(header, "/swarmavg.v1.DHT/Find", digest)


@pytest.mark.parametrize("skew", [-10.5, 10.5, float("nan")])
def test_a_timestamp_outside_the_window_is_refused(skew: float) -> None:
    sender, receiver = Identity.generate(), Identity.generate()
    auth = Authenticator(receiver, RUN, window=10, clock=Clock(1000.0))
    header, digest = signed(sender, receiver, 1000.0 + skew)
    with pytest.raises(AuthenticationError, match="timestamp"):
        auth.check(header, METHOD, digest)


def test_the_run_check_stays_structural_and_does_not_name_the_run() -> None:
    sender, receiver = Identity.generate(), Identity.generate()
    auth = Authenticator(receiver, "secret-run", clock=Clock(1000.0))
    header, digest = signed(sender, receiver, 1000.0)
    with pytest.raises(HeaderError) as info:
        auth.check(header, METHOD, digest)
    assert not isinstance(info.value, AuthenticationError)
    assert "secret-run" not in str(info.value)


def test_the_replay_cache_is_bounded_and_eviction_lets_no_replay_through() -> None:
    sender, receiver = Identity.generate(), Identity.generate()
    clock = Clock(1000.0)
    auth = Authenticator(receiver, RUN, window=100, max_nonces=4, clock=clock)
    sent = []
    for i in range(10):
        header, digest = signed(sender, receiver, 1000.0 + i)
        clock.now = 1000.0 + i
        auth.check(header, METHOD, digest)
        sent.append((header, digest))
        assert len(auth) <= 4
    for header, digest in sent:  # evicted or remembered: refused either way
        with pytest.raises(AuthenticationError):
            auth.check(header, METHOD, digest)
    header, digest = signed(sender, receiver, 1010.0)  # a fresh one still passes
    assert auth.check(header, METHOD, digest) == sender.peer_id


def test_entries_leave_the_cache_with_the_window() -> None:
    sender, receiver = Identity.generate(), Identity.generate()
    clock = Clock(1000.0)
    auth = Authenticator(receiver, RUN, window=10, clock=clock)
    for _ in range(5):
        header, digest = signed(sender, receiver, 1000.0)
        auth.check(header, METHOD, digest)
    clock.now = 1011.0
    header, digest = signed(sender, receiver, 1011.0)
    auth.check(header, METHOD, digest)
    assert len(auth) == 1
