"""Capture what crosses a test bed link, as tcpdump would, with no package to install.

    python capture.py --device eth0 --out FILE [--max-bytes N] [--seconds S]

Run it inside a host's namespace (``host.popen([sys.executable, capture.py, ...])``). It opens
an ``AF_PACKET`` raw socket on the device (both directions, every protocol; needs root, which
the test bed needs anyway), prints ``{"event": "ready"}``, and writes every frame to FILE in
the classic pcap format (tcpdump and Wireshark read it) until SIGTERM/SIGINT, ``--seconds`` or
``--max-bytes``. Then it prints ``{"event": "done", "frames": N, "bytes": B, "drops": D}``
(``drops``: frames the kernel dropped because the capture fell behind).

:func:`read_frames` reads such a file back. Used by tests/deploy/test_private_capture.py to
show that a private run's tensors never cross the wire in clear.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_STATISTICS = 6
SNAPLEN = 262_144  # GRO/TSO frames on veth reach 64 KiB; keep every byte of each
_PCAP_HEADER = struct.Struct("<IHHiIII")
_PCAP_RECORD = struct.Struct("<IIII")
_PCAP_MAGIC = 0xA1B2C3D4
_LINKTYPE_ETHERNET = 1


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def capture(device: str, out: Path, max_bytes: int, seconds: float) -> dict[str, Any]:
    """Capture frames on ``device`` into ``out`` until a signal, ``seconds`` or ``max_bytes``."""
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    try:
        # A large kernel buffer, so that a busy machine does not drop frames; FORCE works as
        # root past the sysctl cap.
        sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
        sock.bind((device, 0))
        sock.settimeout(0.1)
        frames = total = 0
        deadline = time.monotonic() + seconds
        with out.open("wb") as fh:
            fh.write(_PCAP_HEADER.pack(_PCAP_MAGIC, 2, 4, 0, 0, SNAPLEN, _LINKTYPE_ETHERNET))
            fh.flush()
            _emit({"event": "ready", "device": device})
            while not stop and time.monotonic() < deadline and total < max_bytes:
                try:
                    data = sock.recv(SNAPLEN)
                except TimeoutError:
                    continue
                except InterruptedError:
                    continue
                now = time.time()
                seconds_part = int(now)
                fh.write(
                    _PCAP_RECORD.pack(
                        seconds_part, int((now - seconds_part) * 1e6), len(data), len(data)
                    )
                )
                fh.write(data)
                frames += 1
                total += len(data)
        _, drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    finally:
        sock.close()
    return {"event": "done", "frames": frames, "bytes": total, "drops": drops}


def read_frames(path: Path) -> list[bytes]:
    """The frames of a pcap file written by :func:`capture`."""
    data = path.read_bytes()
    if len(data) < _PCAP_HEADER.size or _PCAP_HEADER.unpack_from(data)[0] != _PCAP_MAGIC:
        raise ValueError(f"{path} is not a pcap file of this tool")
    frames, pos = [], _PCAP_HEADER.size
    while pos + _PCAP_RECORD.size <= len(data):
        _, _, length, _ = _PCAP_RECORD.unpack_from(data, pos)
        pos += _PCAP_RECORD.size
        frames.append(data[pos : pos + length])
        pos += length
    return frames


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="eth0")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-bytes", type=int, default=256 << 20)
    parser.add_argument("--seconds", type=float, default=300.0)
    args = parser.parse_args(argv)
    _emit(capture(args.device, args.out, args.max_bytes, args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
