"""A relay alters what it carries (low).

A relay joins a dialer's connection to a NATed peer's byte for byte (peer/nat/splice.py). In a
public run a relay reads everything, and what it alters in a ``Reduce`` stream fails the
stream's MACs (test_relay_stream_integrity.py). In a private run the
claim is that a relay can neither read nor alter: TLS runs end to end through it, and the
dialer checks that the certificate is the peer it dialled. These tests check that claim on a
real data-plane stream through a splicing relay: the relay sees no plaintext, and a record it
alters ends the connection before anything reaches the reducer's handler. The control relays
the same stream unaltered: the reducer's own answer comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest

from swarmavg.averaging.allreduce.data_connector import DataConnector, DataStreamError
from swarmavg.averaging.allreduce.framing import MAGIC
from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.dht.auth import Authenticator
from swarmavg.peer.nat.splice import pump
from tests.attacks.test_reduce_slots import SourceRelay
from tests.private_runs import Authority

pytestmark = pytest.mark.timeout(60)

RUN = "secret-run"


class TamperingRelay(SourceRelay):
    """Splices each connection to ``port``; once :attr:`armed`, flips one bit in every
    chunk it forwards from the dialer. Keeps every byte it saw (both directions)."""

    def __init__(self, port: int) -> None:
        super().__init__(f"127.0.0.1:{port}", "127.0.0.1")
        self.port = port
        self.armed = False
        self.seen = bytearray()

    async def _tamper(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            self.seen += data
            if self.armed:
                data = data[:-1] + bytes([data[-1] ^ 0x01])
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _pump_down(self, reader: _Recording, writer: asyncio.StreamWriter) -> None:
        await pump(reader, writer)  # type: ignore[arg-type]  # duck-typed reader

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        tasks = [
            asyncio.ensure_future(self._tamper(reader, up_writer)),
            asyncio.ensure_future(self._pump_down(_Recording(up_reader, self.seen), writer)),
        ]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)
        for w in (writer, up_writer):
            w.close()


class _Recording:
    """A reader that notes what it reads (the reducer's side, for the plaintext check)."""

    def __init__(self, reader: asyncio.StreamReader, seen: bytearray) -> None:
        self._reader = reader
        self._seen = seen

    async def read(self, n: int) -> bytes:
        data = await self._reader.read(n)
        self._seen += data
        return data


async def stream_one_message(
    connector: DataConnector, port: int, peer_id: bytes
) -> grpc.StatusCode:
    """Open a stream to the reducer through the relay, send one (malformed) message, and
    return the status the stream ends with."""
    call = await connector.open("127.0.0.1", port, 10.0, peer_id=peer_id)
    assert call is not None
    try:
        return await _send(call)
    finally:
        call.cancel()


async def _send(call: object) -> grpc.StatusCode:
    await call.write(b"not a ReduceRequest")  # type: ignore[attr-defined]
    try:
        async with asyncio.timeout(10.0):
            await call.read()  # type: ignore[attr-defined]
    except DataStreamError as e:
        return e.code()
    raise AssertionError("the stream was not refused")


async def test_a_relay_cannot_read_or_alter_a_private_run_stream(tmp_path: Path) -> None:
    authority = Authority.create(tmp_path / "run", RUN)
    reducer_member, sender_member = authority.invite("reducer"), authority.invite("sender")
    reducer = AllReduceService(
        Authenticator(reducer_member.identity, RUN), tls=authority.tls(reducer_member)
    )
    port = await reducer.start_data_plane("127.0.0.1")
    relay = TamperingRelay(port)
    relay_port = int((await relay.start()).rpartition(":")[2])
    peer_id = reducer_member.identity.peer_id
    try:
        # Control: relayed unaltered, the message reaches the reducer, whose check of the
        # first message (it names no sender, not the TLS credential's) refuses it.
        connector = DataConnector(tls=authority.tls(sender_member))
        code = await stream_one_message(connector, relay_port, peer_id)
        assert code is grpc.StatusCode.PERMISSION_DENIED
        connector.close()
        # Attack: the relay flips a bit of what the sender writes after the handshake.
        connector = DataConnector(tls=authority.tls(sender_member))
        call = await connector.open("127.0.0.1", relay_port, 10.0, peer_id=peer_id)
        assert call is not None
        relay.armed = True
        try:
            # TLS refuses the altered record: the connection ends, the handler saw nothing.
            assert await _send(call) is grpc.StatusCode.UNAVAILABLE
        finally:
            call.cancel()
            connector.close()
        # And it never saw a plaintext byte of the data plane.
        assert MAGIC not in relay.seen
        assert b"not a ReduceRequest" not in relay.seen
    finally:
        await relay.close()
        with contextlib.suppress(Exception):
            await reducer.close()
