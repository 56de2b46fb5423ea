"""What TLS costs one stream (issue 16): plain TCP vs TLS 1.3 between asyncio endpoints.

One process, one event loop (uvloop, then asyncio's own): a sender writes ``--mb`` MB in
1 MiB writes to a ``BufferedProtocol`` receiver on loopback, as the data plane does, once over
plain TCP and once over mutual TLS 1.3 with a private run's credentials (made here); each
``--repeat`` times, taking turns. Also Python's ``ssl`` alone: encrypting and decrypting the
same bytes through memory BIOs (what asyncio's TLS is built on), no socket. Both ends share
one core, so the figures are per-core costs. Prints ONE JSON line (MB/s, medians).

    python benchmarks/tls_stream.py --mb 64 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from swarmavg.dht.credentials import (
    JoinRequest,
    init_run,
    invite,
    load_or_create_tls_key,
    load_peer_credentials,
    tls_key_path,
)
from swarmavg.dht.identity import Identity
from swarmavg.dht.tls import SERVER_HOSTNAME, PeerTLS

CHUNK = 1 << 20


def make_tls(folder: Path) -> PeerTLS:
    init_run("bench", folder / "authority.pem", folder / "run.toml")
    identity_path = folder / "m.key"
    identity = Identity.load_or_create(identity_path)
    request = JoinRequest.make(identity, load_or_create_tls_key(tls_key_path(identity_path)))
    _, credential = invite(folder / "authority.pem", folder / "run.toml", request.encode())
    (folder / "m.cred.pem").write_bytes(credential)
    credentials = load_peer_credentials(
        folder / "run.toml", folder / "m.cred.pem", identity, identity_path, "bench"
    )
    return PeerTLS(credentials)


class _Sink(asyncio.BufferedProtocol):
    def __init__(self, total: int, done: asyncio.Future[float]) -> None:
        self.buffer = bytearray(CHUNK)
        self.received = 0
        self.total = total
        self.done = done

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self.received >= self.total and not self.done.done():
            self.done.set_result(time.perf_counter())


class _Source(asyncio.Protocol):
    """The sender's side: ``writable`` is clear while the transport's buffer is full."""

    def __init__(self) -> None:
        self.writable = asyncio.Event()
        self.writable.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()


async def stream(total: int, tls: PeerTLS | None) -> float:
    """MB/s of one ``total``-byte stream over loopback."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[float] = loop.create_future()
    server_ssl = {"ssl": tls.server_context} if tls else {}
    server = await loop.create_server(lambda: _Sink(total, done), "127.0.0.1", 0, **server_ssl)
    port = server.sockets[0].getsockname()[1]
    client_ssl: dict[str, Any] = (
        {"ssl": tls.client_context, "server_hostname": SERVER_HOSTNAME} if tls else {}
    )
    transport, source = await loop.create_connection(_Source, "127.0.0.1", port, **client_ssl)
    transport.set_write_buffer_limits(high=4 * CHUNK)
    data = os.urandom(CHUNK)
    started = time.perf_counter()
    for _ in range(total // CHUNK):
        transport.write(data)
        await source.writable.wait()
    ended = await done
    transport.close()
    server.close()
    await server.wait_closed()
    return total / (ended - started) / 1e6


def memory_bio(total: int, tls: PeerTLS) -> tuple[float, str]:
    """MB/s of encrypting and decrypting ``total`` bytes through memory BIOs, and the
    cipher suite the handshake chose."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = tls.client_context.wrap_bio(c_in, c_out, server_hostname=SERVER_HOSTNAME)
    server = tls.server_context.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):  # the handshake, one flight at a time
        for end in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                end.do_handshake()
        if c_out.pending:
            s_in.write(c_out.read())
        if s_out.pending:
            c_in.write(s_out.read())
    data, buffer = os.urandom(CHUNK), bytearray(CHUNK)
    started = time.perf_counter()
    for _ in range(total // CHUNK):
        client.write(data)
        s_in.write(c_out.read())
        got = 0
        while got < CHUNK:
            got += server.read(CHUNK, buffer)
    rate = total / (time.perf_counter() - started) / 1e6
    cipher = client.cipher()
    return rate, cipher[0] if cipher else "none"


def loops() -> dict[str, Callable[[Coroutine[Any, Any, float]], float]]:
    found: dict[str, Callable[[Coroutine[Any, Any, float]], float]] = {}
    try:
        import uvloop

        found["uvloop"] = uvloop.run
    except ImportError:
        pass
    found["asyncio"] = asyncio.run
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    total = args.mb * CHUNK
    figures: dict[str, Any] = {
        "benchmark": "tls_stream",
        "mb": args.mb,
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "openssl": ssl.OPENSSL_VERSION,
    }
    with tempfile.TemporaryDirectory() as folder:
        tls = make_tls(Path(folder))
        for name, run in loops().items():
            samples: dict[str, list[float]] = {"plain": [], "tls": []}
            for _ in range(args.repeat):
                samples["plain"].append(run(stream(total, None)))
                samples["tls"].append(run(stream(total, tls)))
            figures[name] = {k: round(statistics.median(v)) for k, v in samples.items()}
            figures[name]["tls/plain"] = round(figures[name]["tls"] / figures[name]["plain"], 3)
        bio = [memory_bio(total, tls) for _ in range(args.repeat)]
        figures["ssl_memory_bio"] = round(statistics.median(rate for rate, _ in bio))
        figures["cipher"] = bio[0][1]
    figures["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
