"""Binding a local control endpoint (``swarmavg peer``'s, and ``swarmavg dht``'s when given
``--control``): the socket's folder checks, the TCP token, the cleanup on stop.

A unix socket is private by its folder and mode (peer/client/control_access.py); a TCP endpoint is
reachable by every local user, so only callers that read the token file (mode 600, this
user's folder) get through.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

import grpc

from swarmavg.peer.client.control_access import (
    TokenInterceptor,
    check_private_folder,
    new_token,
    write_token_file,
)
from swarmavg.peer.client.endpoint import (
    ControlEndpoint,
    ControlSocketInUseError,
    default_control_path,
    parse_control_endpoint,
    prepare_unix_socket,
)
from swarmavg.peer.daemon.netutil import bind_problem

log = logging.getLogger(__name__)

SERVER_OPTIONS = [
    # The local control server's options (the public one uses dht.server_limits).
    # grpc enables SO_REUSEPORT by default, which would let a second daemon "bind" a port
    # that is in use and split its traffic with the first; a clear error is better.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 8 << 20),
]


class ControlBindError(RuntimeError):
    """The endpoint cannot be used; the message is one line meant for the user."""


MAX_SIBLING_SOCKETS = 64
"""How many ``<run-id>-N.sock`` a daemon tries when its run's default socket is taken."""


def prepare_endpoint(text: str | None, run_id: str) -> ControlEndpoint:
    """Parse ``text`` (None: the run's default socket) and check a socket's folder.

    Without ``text``, a default socket that a running daemon holds (a second peer of the
    same run on this machine, one per GPU) is not an error: the daemon takes the first free
    ``<run-id>-2.sock``, ``<run-id>-3.sock``, ... next to it and says so; its banner prints
    the ``SWARMAVG_CONTROL=...`` its trainers need. An endpoint given explicitly is used as
    given or refused.

    Raises:
        ControlBindError: a public TCP address, an over-long path, a folder others can
            write, or a socket in use by a live daemon (given explicitly, or all of the
            default socket's siblings).
    """
    try:
        endpoint = parse_control_endpoint(text, run_id)
        if endpoint.path is not None:
            check_private_folder_of(endpoint.path)
            if text:
                prepare_unix_socket(endpoint.path)
            else:
                endpoint = ControlEndpoint(path=_free_default_socket(endpoint.path, run_id))
    except (ValueError, OSError, RuntimeError) as exc:
        raise ControlBindError(str(exc)) from None
    return endpoint


def check_private_folder_of(path: Path) -> None:
    """Create ``path``'s folder (mode 700) when missing and check that it is private."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_folder(path.parent)


def _free_default_socket(default: Path, run_id: str) -> Path:
    """The run's default socket, or the first free sibling when another daemon holds it.

    A daemon claims a default socket's name with a lock on ``<socket>.lock`` that it holds
    until it stops (:func:`release_claim`, or its exit), before it binds the socket at the
    end of its start: daemons of one run started together (``swarmavg launch ... &``) would
    otherwise all find the same name free, and gRPC replaces a socket file when it binds.
    """
    if _claim(default):
        try:
            prepare_unix_socket(default)
            return default
        except ControlSocketInUseError as taken:  # a daemon that takes no lock (older)
            release_claim(default)
            first_error: Exception = taken
    else:
        first_error = ControlSocketInUseError(
            f"control socket {default} belongs to another swarmavg daemon that is starting "
            "or running; give this one another endpoint with --control"
        )
    for number in range(2, MAX_SIBLING_SOCKETS + 1):
        sibling = default_control_path(f"{run_id}-{number}")
        if not _claim(sibling):
            continue
        try:
            prepare_unix_socket(sibling)
        except ControlSocketInUseError:
            release_claim(sibling)
            continue
        log.info(
            "another daemon of run %r on this machine holds %s; this one's control socket is %s",
            run_id,
            default,
            sibling,
        )
        return sibling
    raise first_error


_claims: dict[Path, int] = {}
"""Default socket path -> the descriptor of its lock file, held by this process."""


def _claim(path: Path) -> bool:
    """Take the lock that claims the default socket ``path``; False when another daemon
    (of this process or another) holds it."""
    if path in _claims:
        return False
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _claims[path] = fd
    return True


def release_claim(path: Path | None) -> None:
    """Let go of this process's claim on the default socket ``path`` (idempotent). The lock
    file stays: removing it could let two daemons lock two files of one name."""
    fd = _claims.pop(path, None) if path is not None else None
    if fd is not None:
        os.close(fd)


class ControlServer:
    """A started control server on one endpoint; ``stop`` and ``remove_files`` clean up."""

    def __init__(self, server: grpc.aio.Server, endpoint: ControlEndpoint, token: Path | None):
        self.server = server
        self.endpoint = endpoint  # the bound endpoint (a TCP port 0 resolved)
        self.token_file = token

    async def stop(self, grace: float = 0.2) -> None:
        await self.server.stop(grace)

    def remove_files(self) -> None:
        """Unlink the socket and the token file (after the server stopped); release the
        socket's claim."""
        if self.endpoint.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.endpoint.path)
            release_claim(self.endpoint.path)
        if self.token_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.token_file.unlink()


async def start_control_server(
    endpoint: ControlEndpoint, register: Callable[[grpc.aio.Server], None]
) -> ControlServer:
    """Bind ``endpoint``, let ``register`` add the services, start.

    Raises:
        ControlBindError: the endpoint cannot be bound or the token file not written.
    """
    token = new_token() if endpoint.path is None else None
    if endpoint.path is None:
        problem = bind_problem(f"{endpoint.host}:{endpoint.port}")
        if problem is not None:
            raise ControlBindError(f"cannot bind the control endpoint {endpoint}: {problem}")
    server = grpc.aio.server(
        options=SERVER_OPTIONS,
        interceptors=[TokenInterceptor(token)] if token is not None else None,
    )
    register(server)
    try:
        port = server.add_insecure_port(endpoint.grpc_target())
    except RuntimeError:
        port = 0
    if port == 0:
        await server.stop(None)
        raise ControlBindError(f"cannot bind the control endpoint {endpoint}")
    token_file: Path | None = None
    if endpoint.path is None:
        assert token is not None
        endpoint = ControlEndpoint(host=endpoint.host, port=port)
        try:
            token_file = write_token_file(endpoint, token)
        except OSError as exc:
            await server.stop(None)
            raise ControlBindError(f"cannot write the control token: {exc}") from None
    else:
        os.chmod(endpoint.path, 0o600)
    await server.start()
    return ControlServer(server, endpoint, token_file)
