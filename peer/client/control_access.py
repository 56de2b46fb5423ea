"""Who may use a daemon's control endpoint: only the user who runs the daemon.

The control service moves tensors and DHT writes and signs records as the daemon, so reaching
it must take what only the daemon's user has:

- **A unix socket** (the default) lives in a folder owned by the daemon's user that nobody else
  may write (:func:`check_private_folder`), and the socket itself has mode 600. A client refuses
  a socket that another user owns (:func:`check_socket_owner`), so a look-alike socket cannot
  collect a trainer's tensors.
- **A TCP loopback endpoint** (``127.0.0.1:PORT``) can be reached by every local user, so the
  daemon writes a random token to a file only its user can read (:func:`write_token_file`,
  in the same private folder as the default sockets) and refuses every call without it
  (:class:`TokenInterceptor`, UNAUTHENTICATED). The client reads the file and sends the token
  as call metadata (:func:`read_token`); a client of another user finds no file and gets a
  clear error.

  A port, unlike a socket file, has no owner to check, and any local user can listen on one
  that is free: the port of a daemon that exited, whose token file is still there. So the
  client authenticates the daemon before it sends anything: the token file also
  names the daemon's process, and :func:`check_listener` asks the kernel which sockets
  listen where the client would connect and refuses unless every one of them is a socket of
  that process (Linux: ``/proc/net/tcp``, ``/proc/net/tcp6`` and ``/proc/PID/fd``). An
  impostor's listener, another user's or this user's, is refused before the token or a
  tensor leaves the client. What stays open: the check is made when the client connects and
  again each time a call finds the daemon gone (peer/client/reconnect.py); a daemon replaced
  between two calls without one failing is not noticed, so the client reconnects to whoever
  listens next. On a system without ``/proc`` a TCP endpoint is refused (use the unix
  socket).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from swarmavg.peer.client.endpoint import ControlEndpoint, default_socket_dir

TOKEN_METADATA_KEY = "swarmavg-control-token"
_TOKEN_BYTES = 32


class ControlAccessError(PermissionError):
    """A control socket folder, socket or token file is not private to this user."""


def check_private_folder(folder: Path) -> None:
    """Raise :class:`ControlAccessError` unless ``folder`` is owned by this user and not
    writable by group or others (anyone who can write it could replace the socket)."""
    info = folder.stat()
    if info.st_uid != os.geteuid():
        raise ControlAccessError(
            f"the control socket folder {folder} belongs to another user (uid {info.st_uid}); "
            "give --control a path in a folder of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ControlAccessError(
            f"the control socket folder {folder} is writable by other users "
            f"(mode {stat.S_IMODE(info.st_mode):o}); run `chmod go-w {folder}` or give "
            "--control a path in a private folder"
        )


def check_socket_owner(path: Path) -> None:
    """Raise :class:`ControlAccessError` when the socket at ``path`` is another user's."""
    owner = path.stat().st_uid
    if owner != os.geteuid():
        raise ControlAccessError(
            f"the control socket {path} belongs to another user (uid {owner}), not to a daemon "
            "of yours; refusing to send it anything"
        )


def token_path(endpoint: ControlEndpoint) -> Path:
    """Where the daemon serving the TCP ``endpoint`` keeps its token."""
    return default_socket_dir() / f"tcp-{endpoint.port}.token"


def new_token() -> str:
    return secrets.token_hex(_TOKEN_BYTES)


def write_token_file(endpoint: ControlEndpoint, token: str) -> Path:
    """Write ``token`` (mode 600) for the bound TCP ``endpoint``; return the file's path.

    The second line is this process's id: the process that holds the listening socket, which
    clients check before they send anything (:func:`check_listener`).

    Raises:
        ControlAccessError: the folder is not private to this user.
        OSError: the file cannot be written.
    """
    path = token_path(endpoint)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_folder(path.parent)
    path.unlink(missing_ok=True)  # a stale token of a daemon that died on this port
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, f"{token}\n{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return path


def read_token(endpoint: ControlEndpoint) -> str:
    """The token of the daemon at the TCP ``endpoint``, read from this user's token file.

    Raises:
        ControlAccessError: no token file for this port, or one other users can read or that
            another user owns.
    """
    return read_token_file(endpoint)[0]


def read_token_file(endpoint: ControlEndpoint) -> tuple[str, int | None]:
    """(token, daemon process id) of the TCP ``endpoint``, from this user's token file; the
    process id is None in a file that names none (an older daemon).

    Raises:
        ControlAccessError: as :func:`read_token`.
    """
    path = token_path(endpoint)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ControlAccessError(
            f"no swarmavg control endpoint at {endpoint}: {what_listens(endpoint)}"
        ) from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ControlAccessError(f"the control token file {path} is not private to you")
        lines = file.read(4 * _TOKEN_BYTES).decode(errors="replace").split()
    token = lines[0] if lines else ""
    pid = int(lines[1]) if len(lines) > 1 and lines[1].isdigit() else None
    return token, pid


_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _proc_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words in the host's byte order, as hex."""
    raw = bytes.fromhex(hex_address)
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    return ipaddress.ip_address(struct.pack(f">{len(words)}I", *words))


def _listening_sockets(
    port: int,
) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(local address, socket inode) of every TCP socket listening on ``port`` here."""
    found = []
    for table in ("tcp", "tcp6"):
        try:
            text = Path("/proc/net", table).read_text()
        except FileNotFoundError:
            if table == "tcp":
                raise
            continue  # no IPv6
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            host, _, port_hex = fields[1].partition(":")
            if int(port_hex, 16) == port:
                found.append((_proc_address(host), int(fields[9])))
    return found


def _targets(endpoint: ControlEndpoint) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses a client connecting to ``endpoint`` may reach (a name: all of them)."""
    host = endpoint.host.strip("[]")
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        infos = socket.getaddrinfo(host, endpoint.port, type=socket.SOCK_STREAM)
        return {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}


def _reaches(
    listener: ipaddress.IPv4Address | ipaddress.IPv6Address,
    targets: set[ipaddress.IPv4Address | ipaddress.IPv6Address],
) -> bool:
    """Whether a socket listening on ``listener`` takes connections to any of ``targets``."""
    if listener in targets or listener.is_unspecified:  # a wildcard takes every address
        return True
    mapped = listener.ipv4_mapped if isinstance(listener, ipaddress.IPv6Address) else None
    return mapped is not None and mapped in targets


def what_listens(endpoint: ControlEndpoint) -> str:
    """What is at a TCP ``endpoint`` that has no control token of this user, in words:
    nothing, a swarmavg peer's public port, or another program (read from the kernel's
    socket tables; a process of another user is named as such)."""
    where = f"{endpoint.host}:{endpoint.port}"
    hint = (
        'give connect() the "control" endpoint of the daemon\'s ready line (by default a '
        "unix socket; `swarmavg status` finds it)"
    )
    try:
        listening = _listening_sockets(endpoint.port)
        reaching = {inode for address, inode in listening if _reaches(address, _targets(endpoint))}
    except (OSError, ValueError):
        return f"no control token of yours names it; {hint}"
    if not reaching:
        return f"nothing listens at {where}; {hint}"
    owner = _owner_command(reaching)
    if owner is None:
        return (
            f"another user's program listens at {where} (a TCP control endpoint serves only "
            f"the user who started the daemon); {hint}"
        )
    if _is_swarmavg(owner):
        return (
            f"{where} is a port of a swarmavg peer (its public --listen port, say), not its "
            f"control endpoint; {hint}"
        )
    shown = " ".join(owner)[:80]
    return f"{where} belongs to another program ({shown}), not to a swarmavg daemon; {hint}"


def _is_swarmavg(argv: list[str]) -> bool:
    """Whether a command line runs the ``swarmavg`` console script or its CLI module."""
    return any(Path(arg).name == "swarmavg" or arg.startswith("swarmavg.peer") for arg in argv[:3])


def _owner_command(inodes: set[int]) -> list[str] | None:
    """The command line of this user's process that holds one of the sockets ``inodes``,
    or None when none of this user's processes does."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        if _socket_inodes(int(entry.name)) & inodes:
            try:
                raw = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            return raw.decode(errors="replace").split("\0")
    return None


def _socket_inodes(pid: int) -> set[int]:
    """The sockets process ``pid`` holds, if it is this user's (else none)."""
    proc = Path("/proc", str(pid))
    try:
        if proc.stat().st_uid != os.geteuid():
            return set()
        fds = os.listdir(proc / "fd")
    except OSError:  # gone, or not ours to read
        return set()
    inodes = set()
    for fd in fds:
        try:
            link = os.readlink(proc / "fd" / fd)
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:[") and link.endswith("]"):
            inodes.add(int(link[8:-1]))
    return inodes


def check_listener(endpoint: ControlEndpoint, pid: int | None) -> None:
    """Raise :class:`ControlAccessError` unless every socket that listens where a client of
    the TCP ``endpoint`` would connect belongs to the daemon process ``pid`` (the one its
    token file names), and at least one does.

    The kernel's socket tables say who listens, before any byte is sent: a daemon that
    exited leaves its port free and its token file behind, and whoever listens on the port
    then must not get the token or the tensors.
    """
    where = f"{endpoint.host}:{endpoint.port}"
    if pid is None:
        raise ControlAccessError(
            f"the control token file for {where} names no daemon process (an older swarmavg "
            "wrote it); restart the daemon"
        )
    try:
        listening = _listening_sockets(endpoint.port)
    except OSError:
        raise ControlAccessError(
            f"cannot tell who listens at {where} on this system (no /proc/net/tcp), so the "
            "TCP control endpoint cannot be checked; use the daemon's unix socket"
        ) from None
    try:
        targets = _targets(endpoint)
    except (OSError, ValueError) as exc:
        raise ControlAccessError(f"cannot resolve the control endpoint {where}: {exc}") from None
    reaching = {inode for address, inode in listening if _reaches(address, targets)}
    if not reaching:
        raise ControlAccessError(
            f"nothing listens at {where}: the daemon that wrote its control token (process "
            f"{pid}) has exited"
        )
    if not reaching <= _socket_inodes(pid):
        raise ControlAccessError(
            f"the listener at {where} is not the daemon that wrote its control token "
            f"(process {pid}): that daemon has exited and another program took its port; "
            "refusing to send it the token or anything else"
        )


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses, with UNAUTHENTICATED, every control call that does not carry the token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        sent = next((v for k, v in metadata if k == TOKEN_METADATA_KEY), "")
        sent_bytes = sent.encode() if isinstance(sent, str) else bytes(sent)
        if handler is None or hmac.compare_digest(sent_bytes, self._token):
            return handler
        return _refusal(handler)


_REFUSED = (
    "this control endpoint needs the daemon's token (a file only the daemon's user can read); "
    "connect as that user"
)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only refuses the call."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

    async def refuse_stream(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
        yield  # pragma: no cover - abort raises

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codecs)
    return grpc.unary_unary_rpc_method_handler(refuse, **codecs)


def call_metadata(endpoint: ControlEndpoint) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every call to ``endpoint`` (empty for unix sockets),
    once the TCP listener proved to be the daemon that wrote the token (:func:`check_listener`).

    Raises:
        ControlAccessError: no token of this user for the endpoint, or another program
            listens there.
    """
    if endpoint.path is not None:
        return ()
    token, pid = read_token_file(endpoint)
    check_listener(endpoint, pid)
    return ((TOKEN_METADATA_KEY, token),)
