"""Small network helpers for the daemon: announce addresses and bind-error diagnosis."""

from __future__ import annotations

import errno
import os
import socket

from swarmavg.peer.daemon.config import parse_host_port

_WILDCARDS = {"0.0.0.0", "::", ""}


def primary_ip() -> str:
    """The address of the interface that routes to the outside, else ``127.0.0.1``.

    A UDP ``connect`` selects a route without sending anything.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect(("192.0.2.1", 9))  # TEST-NET-1 (RFC 5737): never actually contacted
        return str(sock.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        sock.close()


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def announce_address(listen: str, bound_port: int, announce: str | None) -> str:
    """The address other peers dial: ``announce`` if given, else the listen address with
    its real port, with a wildcard host replaced by this machine's primary address."""
    if announce:
        return announce
    host, _ = parse_host_port(listen, "listen", allow_port_zero=True)
    if host in _WILDCARDS:
        host = primary_ip()
    return format_host_port(host, bound_port)


def explain_bind_failure(address: str) -> str:
    """Why ``address`` cannot be bound, in words (probes with a plain socket)."""
    return bind_problem(address) or "the gRPC server could not bind it"


def bind_problem(address: str) -> str | None:
    """Why ``address`` cannot be bound, in words, or None when a plain socket binds it.

    Asked before a gRPC server binds: gRPC's C core writes its own failure to stderr
    (``add_port.cc:83] Failed to add port ...``) ahead of the daemon's one-line error.
    """
    host, port = parse_host_port(address, "listen", allow_port_zero=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as gRPC binds: a port that only lingers in TIME_WAIT (a daemon just restarted)
        # is free; one that a socket listens on is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"port {port} is already in use (another swarmavg peer?)"
        if exc.errno == errno.EACCES:
            return f"permission denied for port {port}"
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"{host} is not an address of this machine"
        return exc.strerror or os.strerror(exc.errno or 0)
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc}"
    finally:
        sock.close()
    return None
