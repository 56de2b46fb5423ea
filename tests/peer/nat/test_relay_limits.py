"""The relay's bounds (peer/nat/limits.py) by the book, and on loopback through a real relay:
connections per dialer range and per reserved peer, bytes per second per source."""

from __future__ import annotations

import asyncio

import pytest

from swarmavg.peer.nat.limits import ByteBucket, MiB, RelayBudget, RelayLimits, source_of
from swarmavg.peer.nat.relay import RelayRefused, RelayServer

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_connections_per_source_per_reservation_and_in_all() -> None:
    budget = RelayBudget(
        RelayLimits(
            max_connections=5, max_connections_per_source=2, max_connections_per_reservation=3
        )
    )
    a, b, c = source_of("203.0.113.5"), source_of("198.51.100.7"), source_of("192.0.2.9")
    assert budget.open(a, b"p1") is None
    assert budget.open(a, b"p1") is None
    refusal = budget.open(a, b"p2")
    assert refusal is not None
    assert "203.0.113.0/24" in refusal
    assert budget.open(b, b"p1") is None
    refusal = budget.open(c, b"p1")  # p1 has 3
    assert refusal is not None
    assert "relayed connections" in refusal
    assert budget.open(b, b"p2") is None
    assert budget.open(c, b"p2") is None  # 5 in all now
    refusal = budget.open(c, b"p3")
    assert refusal is not None
    assert "5 connections" in refusal
    assert budget.refused == 3
    budget.close(a, b"p1")
    assert budget.per_source(a) == 1
    assert budget.open(a, b"p3") is None  # a freed slot is usable again


def test_same_range_shares_one_budget() -> None:
    assert source_of("203.0.113.5") == source_of("203.0.113.200")
    assert source_of("203.0.113.5") != source_of("203.0.114.5")


def test_byte_bucket_pauses_a_source_over_its_rate() -> None:
    clock = Clock()
    budget = RelayBudget(
        RelayLimits(bytes_per_second_per_source=1 * MiB, bytes_per_second=0, burst_bytes=MiB),
        clock=clock,
    )
    a, b = source_of("203.0.113.5"), source_of("198.51.100.7")
    assert budget.charge(a, MiB) == 0.0  # the burst
    assert budget.charge(a, MiB) == pytest.approx(1.0)  # one second of debt
    assert budget.charge(b, MiB) == 0.0  # another source has its own bucket
    clock.now += 1.0
    assert budget.charge(a, 0) == pytest.approx(0.0)
    # A flood: whatever is sent, the pauses add up to (bytes - burst) / rate.
    waited = 0.0
    for _ in range(100):
        delay = budget.charge(a, 256 * 1024)
        waited += delay
        clock.now += delay
    assert waited == pytest.approx(100 * 256 * 1024 / MiB, rel=0.02)
    assert budget.relayed_bytes == 3 * MiB + 100 * 256 * 1024


def test_relay_wide_rate_bounds_many_sources() -> None:
    clock = Clock()
    budget = RelayBudget(
        RelayLimits(bytes_per_second_per_source=0, bytes_per_second=2 * MiB, burst_bytes=MiB),
        clock=clock,
    )
    delays = [budget.charge(source_of(f"198.51.{i}.1"), MiB) for i in range(8)]
    assert delays[:4] == [0.0] * 4  # the relay's burst is 4 x burst_bytes
    assert delays[-1] == pytest.approx(2.0)


def test_unlimited_rate_never_pauses() -> None:
    bucket = ByteBucket(0, MiB, 0.0)
    assert bucket.charge(10**12, 0.0) == 0.0


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        RelayLimits(max_connections=0)
    with pytest.raises(ValueError, match="burst"):
        RelayLimits(burst_bytes=10)


async def test_reservations_are_bounded_and_replaced() -> None:
    relay = RelayServer("127.0.0.1", "127.0.0.1", RelayLimits(max_reservations=2))
    try:
        first = await relay.reserve(b"a" * 20, 2)
        assert len(first.ports) == 2
        assert all(first.ports)
        again = await relay.reserve(b"a" * 20, 1)  # the same peer: replaces, not adds
        assert len(relay.reservations) == 1
        assert relay.reservations[b"a" * 20] is again
        await relay.reserve(b"b" * 20, 1)
        with pytest.raises(RelayRefused, match="2 reservations"):
            await relay.reserve(b"c" * 20, 1)
        with pytest.raises(RelayRefused, match=r"1\.\.2 ports"):
            await relay.reserve(b"d" * 20, 3)
        # The replaced reservation's ports are closed.
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", first.ports[1])
    finally:
        await relay.close()


async def test_dialers_over_the_per_source_limit_are_closed() -> None:
    relay = RelayServer("127.0.0.1", "127.0.0.1", RelayLimits(max_connections_per_source=2))
    try:
        reservation = await relay.reserve(b"a" * 20, 1)
        port = reservation.ports[0]
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        events = [await asyncio.wait_for(reservation.events.get(), 5) for _ in range(2)]
        assert {e.index for e in events} == {0}
        # The third connection from the same range gets no event and is closed unanswered.
        assert await asyncio.wait_for(conns[2][0].read(), 5) == b""
        assert reservation.events.empty()
        assert relay.budget.refused == 1
        for _, writer in conns:
            writer.close()
    finally:
        await relay.close()


async def test_a_peer_that_reserves_again_keeps_its_ports() -> None:
    """A reservation's stream ends at the relay's connection age; the peer reserves again at
    once and keeps its address. Another peer, or a later one, does not get the ports."""
    relay = RelayServer("127.0.0.1", "127.0.0.1", RelayLimits())
    try:
        first = await relay.reserve(b"a" * 20, 2)
        relay.detach(first)  # its stream ended
        again = await relay.reserve(b"a" * 20, 2)
        assert again is first
        assert again.linger is None
        relay.detach(again)
        other = await relay.reserve(b"a" * 20, 1)  # asks for other ports: a new reservation
        assert other is not first
        assert relay.reservations[b"a" * 20] is other
        assert not first.servers  # the old ports are closed
    finally:
        await relay.close()
