"""Who may use a daemon's control endpoint: only the user who runs the daemon (issue 16).

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
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from swarmavg.peer.endpoint import ControlEndpoint, default_socket_dir

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
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


def read_token(endpoint: ControlEndpoint) -> str:
    """The token of the daemon at the TCP ``endpoint``, read from this user's token file.

    Raises:
        ControlAccessError: no token file for this port, or one other users can read or that
            another user owns.
    """
    path = token_path(endpoint)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ControlAccessError(
            f"no control token for {endpoint} in {path.parent}: the daemon there is not "
            "yours (a TCP control endpoint serves only the user who started the daemon)"
        ) from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ControlAccessError(f"the control token file {path} is not private to you")
        return file.read(4 * _TOKEN_BYTES).decode(errors="replace").strip()


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
    """The metadata a client sends with every call to ``endpoint`` (empty for unix sockets)."""
    if endpoint.path is not None:
        return ()
    return ((TOKEN_METADATA_KEY, read_token(endpoint)),)
