"""The monitor's web dashboard: a small HTTP/1.1 server on asyncio (no framework).

Two resources: ``GET /`` is the page (:mod:`swarmavg.peer.monitor.page`, self-contained:
nothing is fetched from the internet), ``GET /data.json`` the run's history, which the page
polls. Every connection answers one request and closes. Requests are read with a deadline
and a size limit, answers written with a deadline, and at most :data:`MAX_CONNECTIONS`
connections are served at once, so a slow or hostile client holds nothing for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from swarmavg.peer.daemon.config import parse_host_port

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
"""Largest request line + headers accepted (a browser sends about 1 KiB)."""
READ_TIMEOUT = 10.0
"""Seconds a client has to send its request head."""
WRITE_TIMEOUT = 10.0
"""Seconds an answer may take to be written."""
MAX_CONNECTIONS = 64
"""Connections served at once; more are closed without an answer."""

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


class DashboardServer:
    """Serves ``page`` at ``/`` and ``data()`` (JSON) at ``/data.json`` on ``HOST:PORT``.

    ``start`` binds (``OSError`` when it cannot) and returns the bound address; ``stop`` is
    idempotent and closes every open connection.
    """

    def __init__(self, address: str, page: str, data: Callable[[], dict[str, Any]]) -> None:
        self.host, self.port = parse_host_port(address, "--http", allow_port_zero=True)
        self._page = page.encode()
        self._data = data
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    async def start(self) -> str:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=MAX_HEAD_BYTES
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return f"{self.host}:{self.port}"

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in list(self._writers):
            writer.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._writers.add(writer)
        try:
            status, kind, body, head_only = await self._answer(reader)
            header = (
                f"HTTP/1.1 {status} {REASONS[status]}\r\n"
                f"Content-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
                "Connection: close\r\n\r\n"
            ).encode()
            writer.write(header if head_only else header + body)
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            log.debug("dashboard: a connection ended early: %r", exc)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes, bool]:
        """``(status, content type, body, head only)`` for the request on ``reader``."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
        except (asyncio.LimitOverrunError, ValueError):
            return _text(400, "request head too large")
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _text(400, "expected an HTTP/1.x request line")
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return _text(405, f"{method} is not served here; use GET")
        head_only = method == "HEAD"
        if target in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", self._page, head_only
        if target == "/data.json":
            body = json.dumps(self._data(), allow_nan=False).encode()
            return 200, "application/json", body, head_only
        return _text(404, f"no such page {target!r}: try / or /data.json")


def _text(status: int, message: str) -> tuple[int, str, bytes, bool]:
    return status, "text/plain; charset=utf-8", (message + "\n").encode(), False
