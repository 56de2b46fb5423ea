"""How long a data-plane server waits for a frame body: a pending stream's body at a fixed
pace, an admitted member's body for as long as its bytes keep coming (a slow honest link)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from swarmavg.averaging.allreduce import framing
from swarmavg.averaging.allreduce.admission import ByteBudget
from swarmavg.averaging.allreduce.framing import HEAD, MSG, BodyStalled, FrameProtocol

pytestmark = pytest.mark.timeout(30)

BODY = 64 * 1024


class _Transport(asyncio.Transport):
    """Just what a server-side FrameProtocol asks of its transport here."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("192.0.2.7", 40000) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def write(self, data: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def _receive(proto: FrameProtocol, data: bytes) -> None:
    """``data`` arriving from the socket, as the event loop hands it to the protocol."""
    while data:
        buffer = proto.get_buffer(len(data))
        n = min(len(buffer), len(data))
        buffer[:n] = data[:n]
        proto.buffer_updated(n)
        data = data[n:]


def _server(member: bool, member_host: bool | None = None) -> FrameProtocol:
    hosts = None if member_host is None else (lambda host: member_host and host == "192.0.2.7")
    proto = FrameProtocol(budget=ByteBudget(), admit=lambda p, host: True, member_host=hosts)
    proto.connection_made(_Transport())
    if member:
        proto.admitted(b"\x01" * 32)
    _receive(proto, HEAD.pack(BODY, MSG))  # a body of BODY bytes announced
    return proto


@pytest.fixture
def short_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed pace: 64 KiB within 0.11 s; a member's silence: 0.2 s."""
    monkeypatch.setattr(framing, "BODY_GRACE", 0.05)
    monkeypatch.setattr(framing, "MIN_BODY_RATE", 1024 * 1024)
    monkeypatch.setattr(framing, "MEMBER_BODY_SILENCE", 0.2)


async def _trickle(proto: FrameProtocol, seconds: float, every: float) -> None:
    """A byte every ``every`` seconds for ``seconds``: far below any fixed pace."""
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        _receive(proto, b"x")
        await asyncio.sleep(every)


async def test_a_members_body_may_be_slow_while_its_bytes_keep_coming(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(framing, "BODY_GRACE", 0.05)  # the pending pace, were it applied:
    monkeypatch.setattr(framing, "MIN_BODY_RATE", 1024 * 1024)  # 64 KiB within 0.11 s
    monkeypatch.setattr(framing, "MEMBER_BODY_SILENCE", 0.2)
    proto = _server(member=True)
    await _trickle(proto, seconds=1.0, every=0.05)  # 20 bytes a second
    assert proto.error is None
    await asyncio.sleep(0.5)  # then nothing: the silence cuts it
    assert isinstance(proto.error, BodyStalled)


async def test_a_members_body_that_stops_is_cut_after_the_silence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(framing, "MEMBER_BODY_SILENCE", 0.1)
    proto = _server(member=True)
    _receive(proto, b"x" * 1000)
    await asyncio.sleep(0.05)
    assert proto.error is None
    await asyncio.sleep(0.3)
    assert isinstance(proto.error, BodyStalled)


async def test_a_members_whole_body_is_delivered_and_disarms_the_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(framing, "MEMBER_BODY_SILENCE", 0.1)
    proto = _server(member=True)
    _receive(proto, b"x" * BODY)
    await asyncio.sleep(0.3)
    assert proto.error is None


async def test_a_pending_streams_body_keeps_the_fixed_pace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(framing, "BODY_GRACE", 0.05)
    monkeypatch.setattr(framing, "MIN_BODY_RATE", 1024 * 1024)  # 64 KiB: 0.11 s in all
    monkeypatch.setattr(framing, "MEMBER_BODY_SILENCE", 10.0)
    proto = _server(member=False)
    await _trickle(proto, seconds=0.5, every=0.02)  # bytes keep coming, too slowly
    assert isinstance(proto.error, BodyStalled)


@pytest.mark.parametrize("member_host", [True, False])
@pytest.mark.usefixtures("short_timers")
async def test_a_pending_body_from_a_members_host_is_held_to_the_members_rule(
    member_host: bool,
) -> None:
    """The first message of a resumed stream carries a chunk: from the host of a member of
    a round here it may arrive as slowly as that member's link allows; from anyone else it
    keeps the fixed pace."""
    proto = _server(member=False, member_host=member_host)
    await _trickle(proto, seconds=0.6, every=0.05)
    if member_host:
        assert proto.error is None
        await asyncio.sleep(0.6)  # then nothing: cut after the member's silence
    assert isinstance(proto.error, BodyStalled)


@pytest.mark.usefixtures("short_timers")
async def test_a_body_admitted_while_it_arrives_is_held_to_the_members_rule() -> None:
    proto = _server(member=False)
    _receive(proto, b"x" * 100)
    proto.admitted(b"\x01" * 32)  # the stream is a member's from now on
    await _trickle(proto, seconds=0.6, every=0.05)
    assert proto.error is None
