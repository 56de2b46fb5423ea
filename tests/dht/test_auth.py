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


def test_a_dropped_nonce_sets_a_horizon_for_its_own_sender_only() -> None:
    """One message stamped far ahead, then a flood; eviction refuses neither the
    honest sender nor a newcomer, and still no replay."""
    ahead, flooder, honest = Identity.generate(), Identity.generate(), Identity.generate()
    receiver = Identity.generate()
    clock = Clock(1000.0)
    auth = Authenticator(receiver, RUN, window=100, max_nonces=8, clock=clock)
    kept = [signed(honest, receiver, 1000.0)]
    auth.check(kept[0][0], METHOD, kept[0][1])
    header, digest = signed(ahead, receiver, 1099.0)
    auth.check(header, METHOD, digest)
    for i in range(30):  # the flooder's own dropped nonces only set its own horizon
        flood_header, flood_digest = signed(flooder, receiver, 1000.0 + i / 100)
        auth.check(flood_header, METHOD, flood_digest)
    assert len(auth) <= 8
    for sender in (honest, Identity.generate()):  # an established sender and a newcomer
        fresh, fresh_digest = signed(sender, receiver, 1000.0)
        assert auth.check(fresh, METHOD, fresh_digest) == sender.peer_id
    for old, old_digest in [*kept, (header, digest)]:
        with pytest.raises(AuthenticationError):
            auth.check(old, METHOD, old_digest)


def test_no_replay_passes_whatever_the_cache_dropped() -> None:
    """Many senders through a tiny cache (entries dropped, horizons kept, then folded into
    the keyed table): every accepted message stays refused while inside the window."""
    import random

    rng = random.Random(40)
    receiver = Identity.generate()
    clock = Clock(1000.0)
    auth = Authenticator(receiver, RUN, window=50, max_nonces=6, clock=clock)
    senders = [Identity.generate() for _ in range(40)]
    accepted: list[tuple[float, common_pb2.RequestHeader, bytes]] = []
    for step in range(600):
        clock.now = 1000.0 + step * 0.2
        header, digest = signed(rng.choice(senders), receiver, clock.now + rng.uniform(-50, 50))
        try:
            auth.check(header, METHOD, digest)
        except AuthenticationError:
            continue
        accepted.append((header.timestamp, header, digest))
        if step % 25 == 0:
            for stamp, old, old_digest in rng.sample(accepted, min(10, len(accepted))):
                with pytest.raises(AuthenticationError):
                    auth.check(old, METHOD, old_digest)
                assert stamp == old.timestamp
    assert auth.replays.folded > 0  # the test reached the keyed table


def test_verify_uses_no_nonce_and_a_refused_admission_remembers_none() -> None:
    from swarmavg.dht.auth import AdmissionError

    sender, receiver = Identity.generate(), Identity.generate()
    auth = Authenticator(receiver, RUN, window=10, clock=Clock(1000.0))
    header, digest = signed(sender, receiver, 1000.0)
    assert auth.verify(header, METHOD, digest) == sender.peer_id
    assert len(auth) == 0
    with pytest.raises(AdmissionError, match="slow down"):
        auth.check(header, METHOD, digest, admit=lambda peer_id: "slow down")
    assert len(auth) == 0
    assert auth.check(header, METHOD, digest, admit=lambda peer_id: None) == sender.peer_id
    with pytest.raises(AuthenticationError, match="replay"):
        auth.verify(header, METHOD, digest)
