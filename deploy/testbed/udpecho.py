"""UDP echo probe run inside test bed hosts (standard library only; runs by path).

    python udpecho.py serve --bind ADDR [--idle S]
        prints {"event": "ready", "port": P}, then echoes every datagram back to its sender
        until nothing came for ``--idle`` seconds.
    python udpecho.py probe --to HOST:PORT --count N --interval S [--linger S]
        sends N numbered datagrams, one every S seconds, collects the echoes until
        ``--linger`` seconds after the last one left or until every probe is answered, and
        prints {"event": "done", "rtt_ms": [...]} with one round-trip time per probe
        (null: no echo came).

The test bed's own tests measure a link's delay, jitter and loss with it: a ping that needs
no ICMP tools on the machine and that can send many probes cheaply.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import socket
import struct
import sys
import threading
import time

_PROBE = struct.Struct("!Id")  # sequence number, send time (CLOCK_MONOTONIC)
_WARM_UP = 0xFFFFFFFF
_SO_RCVBUFFORCE = 33  # Linux; not named in Python's socket module
_RECEIVE_BUFFER = 16 << 20
_PAD = b"\0" * 36  # a 64-byte datagram in all (with the 20 + 8 bytes of IP and UDP)


def _emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _roomy_receive_buffer(sock: socket.socket) -> None:
    """Room for seconds of probes while this process waits for a CPU: a probe dropped in
    a full socket buffer would count as lost on the link. SO_RCVBUFFORCE (root) passes
    ``net.core.rmem_max``; elsewhere the plain option takes what the limit allows."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, _RECEIVE_BUFFER)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)


def serve(bind: str, idle: float) -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _roomy_receive_buffer(sock)
    sock.bind((bind, 0))
    sock.settimeout(idle)
    _emit({"event": "ready", "port": sock.getsockname()[1]})
    try:
        while True:
            data, peer = sock.recvfrom(2048)
            sock.sendto(data, peer)
    except TimeoutError:
        return 0
    finally:
        sock.close()


def warm_up(sock: socket.socket, deadline_s: float = 30.0) -> None:
    """Send a marker until its echo comes back: both hosts then know each other's MAC
    address, so no measured probe waits for ARP (whose own frames a lossy link may drop,
    holding probes back for a second)."""
    marker = _PROBE.pack(_WARM_UP, 0.0) + _PAD
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # a full buffer while ARP is pending: try again
            sock.send(marker)
        wait_until = time.monotonic() + 0.5
        while time.monotonic() < wait_until:
            try:
                data = sock.recv(2048)
            except TimeoutError:
                continue
            if _PROBE.unpack_from(data)[0] == _WARM_UP:
                return
    raise TimeoutError(f"no echo within {deadline_s} s")


def probe(target: str, count: int, interval: float, linger: float) -> int:
    host, port = target.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _roomy_receive_buffer(sock)
    sock.connect((host, int(port)))
    sock.settimeout(0.1)
    warm_up(sock)
    rtts: list[float | None] = [None] * count
    arrival_order: list[int] = []
    sending_done = threading.Event()

    def receive() -> None:
        deadline: float | None = None
        # Every probe answered: nothing is left to wait for, so the linger (the time
        # allowed for late echoes) only runs while some echo is missing.
        while len(arrival_order) < count and (deadline is None or time.monotonic() < deadline):
            if deadline is None and sending_done.is_set():
                deadline = time.monotonic() + linger
            try:
                data = sock.recv(2048)
            except TimeoutError:
                continue
            now = time.monotonic()
            seq, sent_at = _PROBE.unpack_from(data)
            if 0 <= seq < count and rtts[seq] is None:
                rtts[seq] = (now - sent_at) * 1000
                arrival_order.append(seq)

    receiver = threading.Thread(target=receive)
    receiver.start()
    unsent = 0
    try:
        start = time.monotonic()
        for seq in range(count):
            # Paced against the start, not the previous send: a late wake-up does not
            # stretch the run, it sends the next probe at once.
            pause = start + seq * interval - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                sock.send(_PROBE.pack(seq, time.monotonic()) + _PAD)
            except OSError:  # the send buffer stayed full: never reached the link
                unsent += 1
    finally:
        sending_done.set()
        receiver.join()
        sock.close()
    reordered = sum(1 for a, b in itertools.pairwise(arrival_order) if b < a)
    _emit({"event": "done", "rtt_ms": rtts, "reordered": reordered, "unsent": unsent})
    return 0


def _raise_priority() -> None:
    """Run ahead of ordinary processes where allowed (root): on a busy machine a probe that
    waits for a CPU adds that wait to the round-trip times it reports."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, -10)


def main() -> int:
    _raise_priority()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    server = sub.add_parser("serve")
    server.add_argument("--bind", required=True)
    server.add_argument("--idle", type=float, default=30.0)
    client = sub.add_parser("probe")
    client.add_argument("--to", required=True)
    client.add_argument("--count", type=int, required=True)
    client.add_argument("--interval", type=float, required=True)
    client.add_argument("--linger", type=float, default=2.0)
    args = parser.parse_args()
    if args.mode == "serve":
        return serve(args.bind, args.idle)
    return probe(args.to, args.count, args.interval, args.linger)


if __name__ == "__main__":
    sys.exit(main())
