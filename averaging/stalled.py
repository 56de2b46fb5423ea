"""Ending a server stream whose client stopped reading.

Neither ``grpc.aio``'s ``context.write`` nor ``context.abort`` has a deadline: a client that
stops reading makes a write wait for ever, and the error status that would end the stream
queues behind the unread messages, so ``abort`` waits for ever too. A handler that gave up
on such a client must still return, so that what it holds (a round's replies, a donor's
upload slot) is freed at once. gRPC then ends the call itself, at the client's
deadline or when the connection reaches its age limit (:mod:`swarmavg.dht.server_limits`).
"""

from __future__ import annotations

import asyncio
from typing import NoReturn, Protocol

import grpc

__all__ = ["STATUS_WAIT", "Abortable", "StalledReader", "abort_stalled"]

STATUS_WAIT = 1.0
"""Seconds an error status may take to leave, behind the unread messages."""


class StalledReader(Exception):
    """The client of a server stream stopped reading; the handler gives up on it without
    a status (raised out of the handler when even the status cannot be written)."""


class Abortable(Protocol):
    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn: ...


async def abort_stalled(context: Abortable, code: grpc.StatusCode, reason: str) -> NoReturn:
    """End the stream with ``code`` if the status leaves within :data:`STATUS_WAIT`, else
    raise :class:`StalledReader`; never returns."""
    try:
        async with asyncio.timeout(STATUS_WAIT):
            await context.abort(code, reason)
    except TimeoutError:
        raise StalledReader(reason) from None
    raise RuntimeError("context.abort returned")
