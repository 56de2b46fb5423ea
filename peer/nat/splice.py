"""Joining two TCP connections byte for byte (the relay's splice and the NATed peer's
back-connection both use it). Bytes are copied as they are: TLS and signed messages pass
through unread and unaltered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

CHUNK = 256 * 1024


async def pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    charge: Callable[[int], float] | None = None,
) -> int:
    """Copy ``reader`` to ``writer`` until EOF, then half-close ``writer``; return the bytes
    copied. ``charge(n)`` returns seconds to pause before reading more (a byte budget)."""
    total = 0
    while True:
        data = await reader.read(CHUNK)
        if not data:
            break
        writer.write(data)
        await writer.drain()
        total += len(data)
        if charge is not None:
            delay = charge(len(data))
            if delay > 0:
                await asyncio.sleep(delay)
    if writer.can_write_eof():
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()
    return total


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    charge: Callable[[int], float] | None = None,
) -> int:
    """Copy both ways until both directions ended (or one failed); close both; return the
    bytes copied in all."""
    tasks = [
        asyncio.ensure_future(pump(a[0], b[1], charge)),
        asyncio.ensure_future(pump(b[0], a[1], charge)),
    ]
    total = 0
    try:
        for done in asyncio.as_completed(tasks):
            try:
                total += await done
            except (OSError, asyncio.IncompleteReadError):
                break  # one side reset: the other direction has nowhere to go
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, OSError, asyncio.IncompleteReadError):
                await task
        for writer in (a[1], b[1]):
            writer.close()
        for writer in (a[1], b[1]):
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()
    return total
