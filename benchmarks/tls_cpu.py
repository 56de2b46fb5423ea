"""Where TLS's CPU goes on one loopback stream (issue 16): CPU seconds per GB, per path.

One process; every figure is the process's CPU time (``time.process_time``: every thread,
both ends of the stream) for ``--mb`` MiB sent in 1 MiB writes, divided by the bytes, so a
loaded machine inflates it far less than a rate in MB/s. Paths, each ``--repeat`` times,
taking turns:

- ``asyncio plain`` / ``asyncio tls``: one event loop (uvloop when importable), a
  transport writing to a ``BufferedProtocol``, as the data plane does; TLS 1.3 with a
  private run's credentials (made here), i.e. ``ssl.SSLObject`` over memory BIOs.
- ``threads plain`` / ``threads tls``: blocking sockets, a sender and a receiver thread;
  TLS through ``ssl.SSLSocket`` (OpenSSL reads and writes the socket itself: no memory BIO,
  no copy into a Python bytes object), ``sendall`` of 1 MiB, ``recv_into`` a 1 MiB buffer.
- ``memory bio``: ``SSLObject`` encrypt + decrypt through memory BIOs, no socket.
- ``aes-gcm``: ``cryptography``'s AES-256-GCM sealing and opening 16 KiB records (TLS's
  record size): the cipher alone, the floor of any TLS path.

Prints ONE JSON line.

    python benchmarks/tls_cpu.py --mb 256 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tls_stream import CHUNK, make_tls, memory_bio, stream

from swarmavg.dht.tls import SERVER_HOSTNAME, PeerTLS

RECORD = 16 << 10


def cpu_s_per_gb(run: Callable[[], Any], total: int) -> float:
    started = time.process_time()
    run()
    return (time.process_time() - started) / total * 1e9


def threads(total: int, tls: PeerTLS | None) -> None:
    """``total`` bytes from a sender thread to a receiver thread over blocking sockets."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    failure: list[BaseException] = []

    def receive() -> None:
        try:
            conn, _ = listener.accept()
            with conn:
                end = tls.server_context.wrap_socket(conn, server_side=True) if tls else conn
                buffer = memoryview(bytearray(CHUNK))
                got = 0
                while got < total:
                    n = end.recv_into(buffer)
                    if not n:
                        raise ConnectionError("closed early")
                    got += n
                end.sendall(b"k")  # the sender waits for this: every byte was decrypted
        except BaseException as e:  # reported by the caller
            failure.append(e)

    receiver = threading.Thread(target=receive)
    receiver.start()
    raw = socket.create_connection(("127.0.0.1", port), timeout=60)
    with raw:
        end = tls.client_context.wrap_socket(raw, server_hostname=SERVER_HOSTNAME) if tls else raw
        data = os.urandom(CHUNK)
        for _ in range(total // CHUNK):
            end.sendall(data)
        if end.recv(1) != b"k":
            raise ConnectionError("no acknowledgement")
    receiver.join(60)
    listener.close()
    if failure:
        raise failure[0]


def aes_gcm(total: int) -> None:
    cipher = AESGCM(AESGCM.generate_key(bit_length=256))
    nonce, record = os.urandom(12), os.urandom(RECORD)
    for _ in range(total // RECORD):
        cipher.decrypt(nonce, cipher.encrypt(nonce, record, None), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    total = args.mb * CHUNK
    try:
        import uvloop

        run_loop: Callable[[Any], Any] = uvloop.run
        loop_name = "uvloop"
    except ImportError:
        run_loop, loop_name = asyncio.run, "asyncio"
    figures: dict[str, Any] = {
        "benchmark": "tls_cpu",
        "mb": args.mb,
        "loop": loop_name,
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "openssl": ssl.OPENSSL_VERSION,
    }
    with tempfile.TemporaryDirectory() as folder:
        tls = make_tls(Path(folder))
        paths: dict[str, Callable[[], Any]] = {
            "asyncio plain": lambda: run_loop(stream(total, None)),
            "asyncio tls": lambda: run_loop(stream(total, tls)),
            "threads plain": lambda: threads(total, None),
            "threads tls": lambda: threads(total, tls),
            "memory bio": lambda: memory_bio(total, tls),
            "aes-gcm": lambda: aes_gcm(total),
        }
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeat):
            for name, path in paths.items():
                samples[name].append(cpu_s_per_gb(path, total))
    cpu = {name: round(statistics.median(v), 3) for name, v in samples.items()}
    figures["cpu_s_per_gb"] = cpu
    figures["samples"] = {name: [round(x, 3) for x in v] for name, v in samples.items()}
    figures["tls_extra_s_per_gb"] = {
        "asyncio": round(cpu["asyncio tls"] - cpu["asyncio plain"], 3),
        "threads": round(cpu["threads tls"] - cpu["threads plain"], 3),
    }
    figures["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
