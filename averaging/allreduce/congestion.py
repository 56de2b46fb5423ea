"""TCP congestion control chosen per socket (``[allreduce] congestion_control``).

The kernel's default algorithm (``net.ipv4.tcp_congestion_control``) is a machine-wide
choice that a daemon often may not change (a container, a network namespace, a shared
host), yet it decides how the all-reduce's bulk streams behave on a link: BBR on a path
with deep FIFO queues and almost no propagation delay overfills the queues once its
minimum-RTT estimate expires on a reused connection (docs/benchmarks-testbed.md), where
CUBIC keeps the link full. ``setsockopt(IPPROTO_TCP, TCP_CONGESTION, name)`` picks the
algorithm for one socket, which needs no privilege for the algorithms listed in
``net.ipv4.tcp_allowed_congestion_control`` (and CAP_NET_ADMIN for the others).

A data-plane connection carries one stream after another, round after round, and BBR keeps
its state across them: its minimum-RTT estimate, re-measured while the receivers' queues
are full, says the path is as long as the queue, and the connection then keeps a queue's
worth more in flight than the path holds. On the test bed's links with no delay and a
50 ms queue, reused BBR connections retransmitted 4-6 % of their segments where fresh ones
retransmitted 0.1 %, and 64 MB rounds took 10.3 s against raw TCP's 8.7 s.
:func:`restart_congestion_control` therefore re-initialises a BBR socket's algorithm at the
start of each stream on a reused connection (switching it to ``reno`` and back, which runs
the algorithm's init): BBR starts again from the kernel's own minimum RTT of the connection
(a 5-minute window, kept across the switch) and its bandwidth probe, as a fresh connection
does, while the window and the connection stay (no handshake, no slow start from one
segment). The same rounds then took 8.8 s with 0.01 % retransmitted; at 50 and 200 ms
they were no slower (docs/benchmarks.md, "Restarting BBR on a reused connection").

On a long path the choice matters more than anywhere else (docs/benchmarks.md, "Congestion
control by path length"; 16 MB rounds, 4 hosts at 100 Mbit/s, every data-plane socket
given one algorithm, interleaved): at 200 ms of round trip BBR's rounds took 2.84 s
against CUBIC's **8.28 s**, at 100 ms 2.53 s against 2.78 s. Two things cost CUBIC there: a
data-plane connection idles between rounds longer than a retransmission timeout, and Linux
then restarts a CUBIC window from ten segments (``net.ipv4.tcp_slow_start_after_idle``, a
host-wide setting; 0.7-1.5 s of a 200 ms round, measured by flipping it); and where the
bottleneck's queue holds less than the path's bandwidth-delay product (50 ms of queue on a
200 ms path on the bed, as on many long paths), each loss cuts a window by 30 %, which CUBIC's
growth function takes seconds to rebuild. BBR keeps its window over idle periods and does
not take a loss for congestion. Most machines default to CUBIC, so a volunteer on a long
link would pay that unless told. Below about 75 ms neither algorithm won throughout (at
50 ms CUBIC's 16 MB rounds were faster, its 4 MB and 64 MB ones slower). Hence
:data:`AUTO`, the default: each connection takes :data:`LONG_PATH` once its minimum
round-trip time (the kernel's own windowed minimum, read when the connection is made and
at each later stream) reaches :data:`LONG_PATH_RTT`, where this process may use it (``bbr``
loaded and in ``net.ipv4.tcp_allowed_congestion_control``, or CAP_NET_ADMIN), and keeps
the kernel's default otherwise; a long path that cannot have it is logged once, with the
remedy.

:func:`check_congestion_control` tries the name on a throw-away socket, so a daemon refuses
a name the kernel would refuse at start, with the reason, instead of on its first round;
:func:`set_congestion_control` applies it to a live socket.
"""

from __future__ import annotations

import logging
import math
import socket
import struct
from pathlib import Path

__all__ = [
    "AUTO",
    "KERNEL",
    "LONG_PATH",
    "LONG_PATH_RTT",
    "CongestionControlError",
    "algorithm_for_path",
    "apply_for_path",
    "check_congestion_control",
    "check_name",
    "get_congestion_control",
    "path_min_rtt",
    "restart_congestion_control",
    "set_congestion_control",
]

log = logging.getLogger(__name__)

_MAX_NAME = 15
"""The kernel's TCP_CA_NAME_MAX is 16 bytes with the terminating NUL."""

_PROC = Path("/proc/sys/net/ipv4")

RESTARTED = frozenset({"bbr"})
"""Algorithms :func:`restart_congestion_control` re-initialises (CUBIC's state between
streams is its window, which a restart would only lose)."""
_INTERIM = "reno"
"""Built into every Linux kernel and always allowed: the algorithm a restart passes through."""

AUTO = "auto"
"""The setting's value that chooses per connection from the path's round-trip time."""
KERNEL = "kernel"
"""The setting's value that leaves every socket with the kernel's default algorithm."""
LONG_PATH = "bbr"
LONG_PATH_RTT = 0.075
"""Seconds of minimum round-trip time from which :data:`AUTO` takes :data:`LONG_PATH`: BBR
was faster at 100 and 200 ms, alike at 76 ms, and neither won throughout at 50 ms."""

_TCP_INFO_MIN_RTT = struct.Struct("=I")
_TCP_INFO_MIN_RTT_OFFSET = 148
"""``tcpi_min_rtt`` (microseconds) in Linux's ``struct tcp_info`` (since Linux 4.6); an
older kernel returns a shorter struct and :func:`path_min_rtt` says it does not know."""
_NO_SAMPLE = 0xFFFFFFFF


class CongestionControlError(ValueError):
    """A congestion control algorithm this kernel, or this process, cannot use."""


def check_name(name: str) -> None:
    """Raise :class:`CongestionControlError` unless ``name`` has the form of an algorithm
    name (1-15 printable ASCII characters without spaces), without asking the kernel."""
    if not (
        0 < len(name) <= _MAX_NAME and name.isascii() and name.isprintable() and " " not in name
    ):
        raise CongestionControlError(
            f"congestion_control {name!r}: an algorithm name of 1-{_MAX_NAME} ASCII "
            "characters, such as cubic, bbr or reno"
        )


def _proc_list(name: str) -> str:
    """A ``/proc/sys/net/ipv4`` list (``tcp_available_congestion_control``...), or ``?``."""
    try:
        return (_PROC / name).read_text().strip() or "?"
    except OSError:
        return "?"


def set_congestion_control(sock: socket.socket, name: str) -> None:
    """Make ``sock`` (a TCP socket, connected or not) use algorithm ``name``.

    Raises:
        CongestionControlError: the platform has no per-socket choice, or the kernel
            refused the name (not built in, module not loaded, or not allowed for this
            process); the message says which algorithms are available and allowed.
    """
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        raise CongestionControlError(
            f"congestion_control {name!r}: this platform has no per-socket TCP congestion "
            "control (TCP_CONGESTION is Linux's); leave the setting unset"
        )
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, name.encode("ascii"))
    except OSError as exc:
        raise CongestionControlError(
            f"congestion_control {name!r}: the kernel refused it ({exc.strerror or exc}); "
            f"available here: {_proc_list('tcp_available_congestion_control')}; allowed "
            f"without CAP_NET_ADMIN: {_proc_list('tcp_allowed_congestion_control')}"
        ) from None


def get_congestion_control(sock: socket.socket) -> str:
    """The algorithm ``sock`` uses now (``""`` where the platform cannot say)."""
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        return ""
    raw = sock.getsockopt(socket.IPPROTO_TCP, option, _MAX_NAME + 1)
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


def restart_congestion_control(sock: socket.socket) -> bool:
    """Re-initialise ``sock``'s algorithm if it is one of :data:`RESTARTED` (see the
    module's doc); return whether it did. Never raises: a socket the kernel will not switch
    keeps its algorithm and its state."""
    try:
        name = get_congestion_control(sock)
        if name not in RESTARTED:
            return False
        set_congestion_control(sock, _INTERIM)
        set_congestion_control(sock, name)  # allowed: the socket had it
    except (CongestionControlError, OSError):
        return False
    return True


def path_min_rtt(sock: socket.socket) -> float | None:
    """The kernel's minimum round-trip time of ``sock``'s connection, in seconds (the
    handshake gives the first sample); None where the platform or kernel cannot say or no
    sample was taken yet."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return None
    end = _TCP_INFO_MIN_RTT_OFFSET + _TCP_INFO_MIN_RTT.size
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, 256)
    except OSError:
        return None
    if len(info) < end:
        return None
    (micros,) = _TCP_INFO_MIN_RTT.unpack_from(info, _TCP_INFO_MIN_RTT_OFFSET)
    return None if micros in (0, _NO_SAMPLE) else micros / 1e6


def algorithm_for_path(min_rtt: float | None, default: str) -> str:
    """What :data:`AUTO` gives a connection whose minimum round-trip time is ``min_rtt``
    seconds (None: not known) on a machine whose default algorithm is ``default``."""
    if min_rtt is not None and math.isfinite(min_rtt) and min_rtt >= LONG_PATH_RTT:
        return LONG_PATH
    return default


def apply_for_path(sock: socket.socket, default: str, min_rtt: float | None = None) -> str:
    """Give ``sock`` the algorithm :data:`AUTO` chooses for its path (``default``: the one
    the socket had when it was made; ``min_rtt``: the path's minimum round-trip time in
    seconds, None reads it from the socket) and return the one it uses now. Never raises:
    an algorithm the kernel refuses leaves the socket's own (logged once per process, with
    the remedy, for the long-path algorithm), and one already in place is left as it is
    (:func:`restart_congestion_control` restarts BBR where a stream needs that)."""
    rtt = path_min_rtt(sock) if min_rtt is None else min_rtt
    wanted = algorithm_for_path(rtt, default)
    try:
        current = get_congestion_control(sock)
        if current == wanted:
            return current
        set_congestion_control(sock, wanted)
        return wanted
    except CongestionControlError as exc:
        if wanted == LONG_PATH:
            _warn_long_path_once(rtt, exc)
    except OSError:
        pass
    try:
        return get_congestion_control(sock)
    except OSError:
        return ""


_long_path_warned = False


def _warn_long_path_once(min_rtt: float | None, refusal: CongestionControlError) -> None:
    global _long_path_warned
    if _long_path_warned:
        return
    _long_path_warned = True
    log.warning(
        "a data-plane path has %.0f ms of round trip, but %s; long paths keep the kernel's "
        "default (with cubic, rounds about 3x slower measured at 200 ms: its window "
        "restarts after every pause between rounds and regrows slowly after a loss). Load "
        "it and allow it "
        "(`modprobe tcp_bbr`, and %s in net.ipv4.tcp_allowed_congestion_control) or give "
        "the daemon CAP_NET_ADMIN: docs/peer.md, 'Congestion control'",
        (min_rtt or 0.0) * 1000,
        refusal,
        LONG_PATH,
    )


def check_congestion_control(name: str) -> None:
    """Raise :class:`CongestionControlError` unless this process can give a TCP socket
    algorithm ``name`` (tried on a throw-away socket, in this network namespace).

    A name the kernel knows only as a loadable module is loaded by the kernel on this
    first use when the process may (CAP_NET_ADMIN); otherwise it is refused here.
    """
    check_name(name)
    if name in (AUTO, KERNEL):
        return  # nothing to refuse: AUTO falls back per connection (see apply_for_path)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        set_congestion_control(probe, name)
