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

:func:`check_congestion_control` tries the name on a throw-away socket, so a daemon refuses
a name the kernel would refuse at start, with the reason, instead of on its first round;
:func:`set_congestion_control` applies it to a live socket.
"""

from __future__ import annotations

import socket
from pathlib import Path

__all__ = [
    "CongestionControlError",
    "check_congestion_control",
    "check_name",
    "get_congestion_control",
    "restart_congestion_control",
    "set_congestion_control",
]

_MAX_NAME = 15
"""The kernel's TCP_CA_NAME_MAX is 16 bytes with the terminating NUL."""

_PROC = Path("/proc/sys/net/ipv4")

RESTARTED = frozenset({"bbr"})
"""Algorithms :func:`restart_congestion_control` re-initialises (CUBIC's state between
streams is its window, which a restart would only lose)."""
_INTERIM = "reno"
"""Built into every Linux kernel and always allowed: the algorithm a restart passes through."""


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


def check_congestion_control(name: str) -> None:
    """Raise :class:`CongestionControlError` unless this process can give a TCP socket
    algorithm ``name`` (tried on a throw-away socket, in this network namespace).

    A name the kernel knows only as a loadable module is loaded by the kernel on this
    first use when the process may (CAP_NET_ADMIN); otherwise it is refused here.
    """
    check_name(name)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        set_congestion_control(probe, name)
