"""Dial-back rules (peer/nat/dialback.py): only the requester's observed IP, rate limited,
bounded in flight; and on loopback with real gRPC servers: a probe only counts when the
asker itself answers it."""

from __future__ import annotations

import socket

import grpc
import pytest

from swarmavg.dht.channels import ChannelPool
from swarmavg.peer.nat.dialback import (
    DialBackLimits,
    DialBackRefused,
    DialBackRules,
    Reach,
    TokenBook,
    check_reachability,
    dial_back,
)
from swarmavg.peer.nat.service import RelayService

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_target_is_the_observed_ip_never_a_named_host() -> None:
    rules = DialBackRules(DialBackLimits())
    assert rules.target("198.51.100.7", 31337) == "198.51.100.7:31337"
    assert rules.target("2001:db8::1", 80) == "[2001:db8::1]:80"
    for host, port in (("", 1), ("example.org", 1), ("0.0.0.0", 1), ("224.0.0.1", 1)):
        with pytest.raises(ValueError, match=r"observed|cannot dial back"):
            rules.target(host, port)
    for port in (0, 65536):
        with pytest.raises(ValueError, match="out of range"):
            rules.target("198.51.100.7", port)


def test_rate_per_source_and_in_all_and_in_flight() -> None:
    clock = Clock()
    rules = DialBackRules(
        DialBackLimits(rate=3, burst=3, per_source_rate=1, per_source_burst=2, max_in_flight=10),
        clock=clock,
    )
    assert rules.admit("198.51.100.7") is None
    assert rules.admit("198.51.100.8") is None  # same /24: shares the bucket
    refusal = rules.admit("198.51.100.9")
    assert refusal is not None
    assert "198.51.100.0/24" in refusal
    assert rules.admit("203.0.113.1") is None  # the relay-wide burst of 3 is now spent
    refusal = rules.admit("192.0.2.1")
    assert refusal is not None
    assert refusal.startswith("too many dial-backs;")
    clock.now += 1.0
    assert rules.admit("198.51.100.7") is None
    for _ in range(4):
        rules.done()
    assert rules.in_flight == 0

    bounded = DialBackRules(DialBackLimits(max_in_flight=1))
    assert bounded.admit("198.51.100.7") is None
    assert "in flight" in (bounded.admit("203.0.113.1") or "")
    bounded.done()
    assert bounded.admit("203.0.113.1") is None


def test_token_book_knows_only_live_tokens() -> None:
    book = TokenBook(max_tokens=2)
    a, b, c = book.issue(), book.issue(), book.issue()
    assert len(a) == 16
    assert not book.knows(a)
    assert book.knows(b)
    assert book.knows(c)
    book.retire(b)
    assert not book.knows(b)


async def _serve(service: RelayService) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    service.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _service(
    channels: ChannelPool, tokens: TokenBook, limits: DialBackLimits | None = None
) -> RelayService:
    return RelayService(
        channels, DialBackRules(limits or DialBackLimits(probe_timeout=2.0)), tokens,
        lambda: None, lambda: None, b"r" * 20,
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_reachable_when_the_asker_answers_its_own_probe() -> None:
    channels, public_channels = ChannelPool(), ChannelPool()  # two daemons, two pools
    public_tokens, asker_tokens = TokenBook(), TokenBook()
    public, public_port = await _serve(_service(public_channels, public_tokens))
    asker, asker_port = await _serve(_service(channels, asker_tokens))
    try:
        found = await check_reachability(
            channels, asker_tokens, [f"127.0.0.1:{public_port}"], asker_port
        )
        assert found.reach is Reach.PUBLIC
        assert found.observed_host == "127.0.0.1"
        assert found.public_peers == (f"127.0.0.1:{public_port}",)
        # Nothing listens on this port: the dial-back fails within its deadline.
        closed = await check_reachability(
            channels, asker_tokens, [f"127.0.0.1:{public_port}"], _free_port()
        )
        assert closed.reach is Reach.NATED
        assert "not reached" in closed.details[0]
        # A port where another peer answers (it did not issue the token): not reachable.
        other = await check_reachability(
            channels, asker_tokens, [f"127.0.0.1:{public_port}"], public_port
        )
        assert other.reach is Reach.NATED
        assert "NOT_FOUND" in other.details[0]
        # Nobody to ask: unknown, not NATed.
        nobody = await check_reachability(channels, asker_tokens, [f"127.0.0.1:{_free_port()}"], 1)
        assert nobody.reach is Reach.UNKNOWN
    finally:
        await public.stop(None)
        await asker.stop(None)
        await channels.close()
        await public_channels.close()


async def test_a_public_peer_past_the_rate_limit_is_not_taken_for_nated() -> None:
    # Many daemons of one host start at once: the public peer dials back the first and
    # refuses the next. The second is not reached, but nobody tried: unknown, not NATed.
    channels, public_channels = ChannelPool(), ChannelPool()
    public_tokens, asker_tokens = TokenBook(), TokenBook()
    limits = DialBackLimits(probe_timeout=2.0, per_source_burst=1, per_source_rate=0.001)
    public, public_port = await _serve(_service(public_channels, public_tokens, limits))
    asker, asker_port = await _serve(_service(channels, asker_tokens))
    try:
        address = [f"127.0.0.1:{public_port}"]
        first = await check_reachability(channels, asker_tokens, address, asker_port)
        assert first.reach is Reach.PUBLIC
        second = await check_reachability(channels, asker_tokens, address, asker_port)
        assert second.reach is Reach.UNKNOWN, second.details
        assert "RESOURCE_EXHAUSTED" in second.details[0]
    finally:
        await public.stop(None)
        await asker.stop(None)
        await channels.close()
        await public_channels.close()


async def test_refused_dial_backs_do_not_dial() -> None:
    channels = ChannelPool()
    rules = DialBackRules(DialBackLimits(per_source_burst=1, per_source_rate=0.001))
    try:
        first = await dial_back(rules, channels, "127.0.0.1", _free_port(), b"t" * 16)
        assert not first.reachable
        assert first.observed_host == "127.0.0.1"
        # Refusals are not answers ("not reached" would make a public asker think it is
        # behind NAT): they raise, and the service answers them with a status.
        with pytest.raises(DialBackRefused, match="too many dial-backs") as refused:
            await dial_back(rules, channels, "127.0.0.1", _free_port(), b"t" * 16)
        assert refused.value.status is grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(DialBackRefused, match="16 bytes") as bad_token:
            await dial_back(rules, channels, "127.0.0.2", 80, b"short")
        assert bad_token.value.status is grpc.StatusCode.INVALID_ARGUMENT
        assert rules.in_flight == 0
    finally:
        await channels.close()
