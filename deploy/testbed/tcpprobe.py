"""Raw TCP goodput probe run inside test bed hosts (standard library only; runs by path).

    python tcpprobe.py sink --bind ADDR [--connections N] [--timeout S] [--congestion-control C]
        prints {"event": "ready", "port": P}; per connection {"event": "accepted", "peer": ...}
        and later {"event": "received", ...}: bytes, seconds from accept to EOF, and the peer
        address it came from.
    python tcpprobe.py send --to HOST:PORT [--to HOST:PORT ...] --bytes N [--timeout S]
        [--congestion-control C] [--in-turn]
        sends N bytes to every target at once (``--in-turn``: to one target after another,
        each once the last one's bytes all arrived); prints {"event": "sent", "bytes": total,
        "seconds": S} or {"event": "error", ...} (exit 1).

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


def _set_congestion_control(sock: socket.socket, name: str | None) -> None:
    """TCP congestion control ``name`` for ``sock`` (None: the kernel's default). Set on a
    listening socket, accepted connections inherit it."""
    if name is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())


def _emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _drain(
    conn: socket.socket, peer: tuple[str, int], timeout: float, lock: threading.Lock
) -> None:
    started = time.monotonic()
    total = 0
    conn.settimeout(timeout)
    with conn:
        try:
            while chunk := conn.recv(BLOCK):
                total += len(chunk)
            record: dict[str, object] = {"event": "received", "bytes": total}
        except OSError as exc:
            record = {"event": "error", "error": repr(exc), "bytes": total}
        # Timed before the close: the close is what tells the sender that every byte
        # arrived, and an in-turn sender then connects to its next sink at once, whose
        # accept must not be timed before this end.
        ended = time.monotonic()
    record["seconds"] = ended - started
    # CLOCK_MONOTONIC is one clock for every process on the machine, so the test process
    # can line up transfers measured by different sinks.
    record["started_at"] = started
    record["ended_at"] = ended
    record["peer"] = f"{peer[0]}:{peer[1]}"
    with lock:
        _emit(record)


def sink(
    bind: str, port: int, connections: int, timeout: float, congestion: str | None = None
) -> int:
    with socket.create_server((bind, port)) as server:
        _set_congestion_control(server, congestion)
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


def _send_one(target: str, size: int, timeout: float, congestion: str | None) -> str | None:
    """Send ``size`` bytes to ``target``; None on success, else the error."""
    host, _, port = target.rpartition(":")
    payload = memoryview(bytes(BLOCK))
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as conn:
            _set_congestion_control(conn, congestion)
            remaining = size
            while remaining > 0:
                step = min(remaining, BLOCK)
                conn.sendall(payload[:step])
                remaining -= step
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # the sink closes after reading everything: all bytes arrived
    except OSError as exc:
        return repr(exc)
    return None


def send(
    targets: list[str],
    size: int,
    timeout: float,
    congestion: str | None = None,
    in_turn: bool = False,
) -> int:
    """Send ``size`` bytes to every target at once, one connection (thread) each; with
    ``in_turn``, to one target after another in the order given."""
    started = time.monotonic()
    errors: dict[str, str] = {}

    def one(target: str) -> None:
        error = _send_one(target, size, timeout, congestion)
        if error is not None:
            errors[target] = error

    if in_turn:
        for target in targets:
            one(target)
    else:
        threads = [threading.Thread(target=one, args=(target,)) for target in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    seconds = time.monotonic() - started
    if errors:
        _emit({"event": "error", "error": "; ".join(errors.values()), "seconds": seconds})
        return 1
    _emit({"event": "sent", "bytes": size * len(targets), "seconds": seconds})
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
    p_send.add_argument("--to", required=True, action="append", help="repeatable")
    p_send.add_argument("--bytes", type=int, required=True)
    p_send.add_argument("--timeout", type=float, default=60.0)
    p_send.add_argument("--in-turn", action="store_true", help="one target after another")
    for sub in (p_sink, p_send):
        sub.add_argument("--congestion-control", default=None, help="TCP_CONGESTION name")
    args = parser.parse_args(argv)
    if args.command == "sink":
        return sink(args.bind, args.port, args.connections, args.timeout, args.congestion_control)
    return send(args.to, args.bytes, args.timeout, args.congestion_control, args.in_turn)


if __name__ == "__main__":
    sys.exit(main())
