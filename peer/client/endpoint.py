"""Control endpoints: where a training process reaches its local daemon (docs/peer.md).

An endpoint is either a unix socket path or ``127.0.0.1:PORT`` (any loopback address).
It is never a public interface: the control service moves tensors and DHT writes for
whoever can connect, so only processes on this machine may reach it.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

DEFAULT_RUN_ID = "default"
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_UNIX_PATH_BYTES = 107
_TCP_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")
_LOOPBACK_NAMES = {"localhost"}


@dataclass(frozen=True)
class ControlEndpoint:
    """A parsed control endpoint.

    Attributes:
        path: the unix socket path, or ``None`` for a TCP endpoint.
        host: the loopback host for a TCP endpoint.
        port: the TCP port (0 before binding: pick a free one).
    """

    path: Path | None = None
    host: str = ""
    port: int = 0

    @property
    def is_unix(self) -> bool:
        return self.path is not None

    def grpc_target(self) -> str:
        """The target string for ``grpc.insecure_channel`` / ``add_insecure_port``."""
        if self.path is not None:
            return f"unix:{self.path}"
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return str(self.path) if self.path is not None else f"{self.host}:{self.port}"


def default_socket_dir() -> Path:
    """``$XDG_RUNTIME_DIR/swarmavg``, else ``~/.swarmavg``: where default sockets live."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "swarmavg" if runtime else Path.home() / ".swarmavg"


def default_control_path(run_id: str = DEFAULT_RUN_ID) -> Path:
    """``$XDG_RUNTIME_DIR/swarmavg/<run-id>.sock``, else ``~/.swarmavg/<run-id>.sock``."""
    if not run_id or "/" in run_id or run_id in {".", ".."}:
        raise ValueError(f"run id {run_id!r} cannot name a socket file")
    return default_socket_dir() / f"{run_id}.sock"


def running_daemons() -> dict[str, Path]:
    """The daemons of this user that listen on a default socket: run id -> socket path.

    Sockets whose daemon is gone (refused) are left out; nothing is removed.
    """
    folder = default_socket_dir()
    try:
        candidates = sorted(folder.glob("*.sock"))
    except OSError:
        return {}
    return {
        path.name[: -len(".sock")]: path
        for path in candidates
        if path.is_socket() and socket_is_live(path, timeout=0.5)
    }


def parse_control_endpoint(text: str | None, run_id: str = DEFAULT_RUN_ID) -> ControlEndpoint:
    """Parse a control endpoint; ``None`` or empty gives the default socket for ``run_id``.

    Raises:
        ValueError: a TCP endpoint on a non-loopback host (e.g. ``0.0.0.0``), a bad port,
            or a socket path longer than the kernel allows.
    """
    if not text:
        return _unix(default_control_path(run_id))
    if text.startswith("unix:"):
        return _unix(Path(text[len("unix:") :]))
    match = _TCP_RE.match(text)
    if match is not None and "/" not in text:
        host, port = match.group(1), int(match.group(2))
        if port > 65535:
            raise ValueError(f"control endpoint {text!r}: port {port} is out of range")
        if not _is_loopback(host):
            raise ValueError(
                f"control endpoint {text!r} is not local: the control service is only "
                "bound on a unix socket or a loopback address such as 127.0.0.1:PORT"
            )
        return ControlEndpoint(host=host, port=port)
    return _unix(Path(text))


def _unix(path: Path) -> ControlEndpoint:
    path = path.expanduser().absolute()
    if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
        raise ValueError(
            f"control socket path {str(path)!r} is longer than {MAX_UNIX_PATH_BYTES} bytes; "
            "choose a shorter --control path"
        )
    return ControlEndpoint(path=path)


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def socket_is_live(path: Path, timeout: float = 1.0) -> bool:
    """Whether a process accepts connections on the unix socket at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.fspath(path))
    except OSError as exc:
        # Refused / missing: nobody listens. A timeout means a wedged but live listener.
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK) and isinstance(
            exc, TimeoutError
        )
    else:
        return True
    finally:
        sock.close()


class ControlSocketInUseError(RuntimeError):
    """The control socket belongs to a daemon that is still running."""


def prepare_unix_socket(path: Path) -> None:
    """Make ``path`` ready to bind: create its folder (mode 700), remove a stale socket.

    Raises:
        ControlSocketInUseError: a live daemon listens there.
        FileExistsError: something that is not a socket is in the way.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not os.path.lexists(path):
        return
    if not path.is_socket():
        raise FileExistsError(f"control endpoint {path} exists and is not a socket")
    if socket_is_live(path):
        raise ControlSocketInUseError(
            f"control socket {path} belongs to a running swarmavg daemon; stop it first "
            "or give this one another endpoint with --control"
        )
    path.unlink(missing_ok=True)  # stale: its daemon died without cleaning up
