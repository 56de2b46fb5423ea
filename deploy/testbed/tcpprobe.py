"""Raw TCP goodput probe run inside test bed hosts (standard library only; runs by path).

    python tcpprobe.py sink --bind ADDR [--connections N] [--timeout S]
        prints {"event": "ready", "port": P}; per connection {"event": "accepted", "peer": ...}
        and later {"event": "received", ...}: bytes, seconds from accept to EOF, and the peer
        address it came from.
    python tcpprobe.py send --to HOST:PORT --bytes N [--timeout S]
        prints {"event": "sent", "bytes": N, "seconds": S} or {"event": "error", ...} (exit 1).

Used by the test bed's own tests (rate limits, NAT) and by benchmarks/bandwidth.py to
measure what the shaped links carry without swarmavg in the way.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

BLOCK = 256 * 1024


def _emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _drain(
    conn: socket.socket, peer: tuple[str, int], timeout: float, lock: threading.Lock
) -> None:
    started = time.monotonic()
    total = 0
    conn.settimeout(timeout)
    try:
        with conn:
            while chunk := conn.recv(BLOCK):
                total += len(chunk)
        record: dict[str, object] = {"event": "received", "bytes": total}
    except OSError as exc:
        record = {"event": "error", "error": repr(exc), "bytes": total}
    record["seconds"] = time.monotonic() - started
    record["peer"] = f"{peer[0]}:{peer[1]}"
    with lock:
        _emit(record)


def sink(bind: str, port: int, connections: int, timeout: float) -> int:
    with socket.create_server((bind, port)) as server:
        server.settimeout(timeout)
        _emit({"event": "ready", "port": server.getsockname()[1]})
        lock = threading.Lock()
        threads = []
        for _ in range(connections):
            try:
                conn, peer = server.accept()
            except OSError as exc:
                _emit({"event": "error", "error": repr(exc)})
                break
            with lock:
                _emit({"event": "accepted", "peer": f"{peer[0]}:{peer[1]}"})
            thread = threading.Thread(target=_drain, args=(conn, peer, timeout, lock))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
    return 0


def send(target: str, size: int, timeout: float) -> int:
    host, _, port = target.rpartition(":")
    payload = memoryview(bytes(BLOCK))
    started = time.monotonic()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as conn:
            remaining = size
            while remaining > 0:
                step = min(remaining, BLOCK)
                conn.sendall(payload[:step])
                remaining -= step
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # the sink closes after reading everything: all bytes arrived
    except OSError as exc:
        _emit({"event": "error", "error": repr(exc), "seconds": time.monotonic() - started})
        return 1
    _emit({"event": "sent", "bytes": size, "seconds": time.monotonic() - started})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p_sink = commands.add_parser("sink")
    p_sink.add_argument("--bind", required=True)
    p_sink.add_argument("--port", type=int, default=0)
    p_sink.add_argument("--connections", type=int, default=1)
    p_sink.add_argument("--timeout", type=float, default=60.0)
    p_send = commands.add_parser("send")
    p_send.add_argument("--to", required=True)
    p_send.add_argument("--bytes", type=int, required=True)
    p_send.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.command == "sink":
        return sink(args.bind, args.port, args.connections, args.timeout)
    return send(args.to, args.bytes, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
