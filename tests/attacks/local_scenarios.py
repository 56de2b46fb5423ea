"""A daemon in its own process that can die as a crashed one does, and a listener that
takes its port: shared by ``test_local_endpoint.py`` and ``tests/attacks/attack_report.py``.

Nothing here imports what only the checked control endpoint has, so the report can stage
the attack against older code too.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

DAEMON = """
import asyncio
from swarmavg.peer import Peer, PeerConfig

async def main():
    config = PeerConfig(listen="127.0.0.1:0", control="127.0.0.1:0", run_id="t40")
    async with Peer(config) as peer:
        print(peer.control.port, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


class Impostor(grpc.GenericRpcHandler):
    """A listener that answers every call and keeps what it was sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        metadata = tuple(handler_call_details.invocation_metadata or ())
        self.calls.append((handler_call_details.method, metadata))

        async def answer(request: bytes, context: Any) -> bytes:
            return b""  # an empty message of any type

        return grpc.unary_unary_rpc_method_handler(answer)


@contextlib.asynccontextmanager
async def tcp_daemon(log: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """A daemon with a TCP control endpoint in a subprocess (its stderr in ``log``):
    yields the process and the endpoint's port; killed on exit if it still runs."""
    with log.open("wb") as stderr:
        daemon = await asyncio.create_subprocess_exec(
            sys.executable, "-c", DAEMON, stdout=asyncio.subprocess.PIPE, stderr=stderr
        )
        try:
            assert daemon.stdout is not None
            line = await asyncio.wait_for(daemon.stdout.readline(), timeout=120)
            assert line.strip().isdigit(), f"the daemon printed no port (its stderr: {log})"
            yield daemon, int(line)
        finally:
            if daemon.returncode is None:
                daemon.kill()
                await daemon.wait()


@contextlib.asynccontextmanager
async def impostor_on(endpoint: str) -> AsyncIterator[Impostor]:
    """An :class:`Impostor` listening on ``endpoint`` (a port just freed), until exit."""
    impostor = Impostor()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((impostor,))
    assert server.add_insecure_port(endpoint) == int(endpoint.rpartition(":")[2])
    await server.start()
    try:
        yield impostor
    finally:
        await server.stop(None)
