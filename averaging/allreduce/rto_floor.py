"""The retransmission timeout's floor of one data-plane socket (``TCP_RTO_MIN_US``).

Linux never lets a TCP retransmission timeout fall below ``net.ipv4.tcp_rto_min_us``
(200 ms by default): the timer is the smoothed RTT plus the larger of four mean deviations
and that floor. On a short path a lost tail segment that the fast-retransmit machinery
cannot repair then stalls its flow for at least 200 ms, and in a round the reducer waiting
for that chunk waits as long. The sysctl is host-wide (per network namespace) and a user
cannot be asked to change it; Linux 6.15 added the per-socket option ``TCP_RTO_MIN_US``,
which may only lower the floor (from two scheduler ticks, 8 ms at HZ=250, up to 200 ms).

Where the kernel does not know the option (older kernels, other systems) or refuses the
value, the socket keeps the kernel's floor: the option is an optimisation, never a
condition of a round. That is logged once, at debug level.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys

log = logging.getLogger(__name__)

__all__ = [
    "KERNEL_FLOOR_MS",
    "SHORT_PATH_FLOOR_MS",
    "SHORT_PATH_RTT_MS",
    "TCP_RTO_MIN_US",
    "apply_notsent_lowat",
    "apply_rto_floor",
    "connection_rtt_ms",
    "floor_for_rtt",
    "get_rto_min",
    "rto_min_us",
    "set_rto_min",
]

TCP_RTO_MIN_US = int(getattr(socket, "TCP_RTO_MIN_US", 45))
"""The option's number in Linux's ``include/uapi/linux/tcp.h`` (Python's socket module
does not name it before 3.14)."""

KERNEL_FLOOR_MS = 200.0
"""Linux's compiled-in floor (``TCP_RTO_MIN``): the default, and the most the option takes."""
_KERNEL_MAX_US = round(KERNEL_FLOOR_MS * 1000)

SHORT_PATH_RTT_MS = 10.0
"""A connection whose RTT at its HELLO is below this is on a short path (see
:func:`floor_for_rtt`)."""
SHORT_PATH_FLOOR_MS = 10.0
"""The floor :func:`floor_for_rtt` gives a short path's connection."""

_TCP_INFO_READ = 104  # bytes of struct tcp_info read: every kernel since 2.6 has the RTT
_TCPI_RTT_OFFSET = 68  # tcpi_rtt (u32, microseconds): after 8 u8 fields and 15 u32 ones
_TCPI_RTT = struct.Struct("=I")

_refusal_logged = False


def rto_min_us(milliseconds: float) -> int:
    """The option's value for a floor of ``milliseconds``: whole microseconds, at most the
    kernel's 200 ms (a larger floor is refused by the kernel, and is its default anyway).

    Raises:
        ValueError: ``milliseconds`` is not a positive finite number.
    """
    if not 0 < milliseconds < float("inf"):
        raise ValueError(f"an RTO floor must be a positive number of ms, not {milliseconds!r}")
    return max(1, min(round(milliseconds * 1000), _KERNEL_MAX_US))


def set_rto_min(sock: socket.socket, milliseconds: float) -> bool:
    """Lower ``sock``'s retransmission timeout floor to ``milliseconds``; return whether
    the kernel took it (``False``: the socket keeps the kernel's floor)."""
    global _refusal_logged
    if sys.platform != "linux":
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, rto_min_us(milliseconds))
    except OSError as exc:
        # ENOPROTOOPT before Linux 6.15, EINVAL for a floor under two ticks.
        if not _refusal_logged:
            _refusal_logged = True
            log.debug("data-plane sockets keep the kernel's RTO floor: %s", exc)
        return False
    return True


def get_rto_min(sock: socket.socket) -> float | None:
    """``sock``'s retransmission timeout floor in ms (whole scheduler ticks), or ``None``
    where the kernel cannot say."""
    if sys.platform != "linux":
        return None
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US) / 1000
    except OSError:
        return None


def floor_for_rtt(rtt_ms: float) -> float:
    """The floor a data-plane connection gets when none is configured, from its RTT in ms
    measured at its HELLO: 10 ms on a short path (RTT under 10 ms), else the kernel's.

    Why: on the 100 Mbit/s test bed at RTT 0, BBR on reused connections fills the 50 ms FIFO
    queues and loses tail segments that only a timeout repairs (13-25 per 64 MB round);
    with a 10 ms floor those cost tens of milliseconds instead of 200+, and rounds were
    faster in most interleaved pairs, though the timeouts became more frequent. On paths
    of 50 and 200 ms a lower floor measured no gain (a 10 ms one lost 4 of 6 pairs at RTT
    50): there the RTO is the RTT plus the floor and timeouts are rare, so the kernel's
    floor stays (docs/benchmarks.md, "Long links on the test bed").
    """
    return SHORT_PATH_FLOOR_MS if rtt_ms < SHORT_PATH_RTT_MS else KERNEL_FLOOR_MS


def apply_notsent_lowat(transport: asyncio.BaseTransport | None, nbytes: int | None) -> None:
    """``TCP_NOTSENT_LOWAT`` on the socket under a data-plane transport: the kernel keeps at
    most about ``nbytes`` of not yet sent data queued (the rest waits in the transport)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    option = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
    if sock is None or nbytes is None or sys.platform != "linux":
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, nbytes)
    except OSError as exc:
        log.debug("TCP_NOTSENT_LOWAT refused: %s", exc)


def connection_rtt_ms(sock: socket.socket) -> float | None:
    """The kernel's smoothed RTT of connected ``sock`` in ms (``tcp_info.tcpi_rtt``), or
    ``None`` where it cannot say."""
    if sys.platform != "linux":
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_READ)
    except OSError:
        return None
    if len(info) < _TCPI_RTT.size + _TCPI_RTT_OFFSET:
        return None
    (rtt_us,) = _TCPI_RTT.unpack_from(info, _TCPI_RTT_OFFSET)
    return float(rtt_us) / 1000


def apply_rto_floor(transport: asyncio.BaseTransport | None, fixed_ms: float | None) -> None:
    """Give the socket under a data-plane transport its RTO floor: ``fixed_ms``, or (None)
    :func:`floor_for_rtt` of the connection's RTT measured so far. Never raises the floor
    the socket already has (an operator's lower sysctl stays), and does nothing where the
    kernel cannot say or refuses."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return
    if fixed_ms is None:
        rtt = connection_rtt_ms(sock)
        if rtt is None:
            return
        wanted = floor_for_rtt(rtt)
    else:
        wanted = fixed_ms
    current = get_rto_min(sock)
    if current is None or wanted < current:
        set_rto_min(sock, wanted)
