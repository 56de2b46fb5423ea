"""Control endpoint rules: default paths, loopback only, stale vs live sockets."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmavg.peer.client.client import resolve_endpoint
from swarmavg.peer.client.endpoint import (
    ControlSocketInUseError,
    default_control_path,
    parse_control_endpoint,
    prepare_unix_socket,
    running_daemons,
)
from swarmavg.peer.client.errors import ValidationError


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def test_default_path_uses_xdg_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert default_control_path("myrun") == Path("/run/user/1234/swarmavg/myrun.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_control_path("myrun") == Path.home() / ".swarmavg" / "myrun.sock"


def test_parse_paths_and_loopback_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1")
    assert parse_control_endpoint(None, "r").path == Path("/run/user/1/swarmavg/r.sock")
    assert parse_control_endpoint("/tmp/a.sock").grpc_target() == "unix:/tmp/a.sock"
    assert parse_control_endpoint("unix:/tmp/b.sock").path == Path("/tmp/b.sock")
    tcp = parse_control_endpoint("127.0.0.1:5000")
    assert (tcp.path, tcp.host, tcp.port) == (None, "127.0.0.1", 5000)
    assert parse_control_endpoint("localhost:0").port == 0
    assert parse_control_endpoint("[::1]:7").host == "[::1]"


@pytest.mark.parametrize("text", ["0.0.0.0:5000", "[::]:5000", "10.1.2.3:80", "example.com:80"])
def test_public_endpoints_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="not local"):
        parse_control_endpoint(text)


def test_overlong_socket_path_is_rejected() -> None:
    with pytest.raises(ValueError, match="longer than"):
        parse_control_endpoint("/tmp/" + "x" * 200 + ".sock")


def test_stale_socket_is_removed_live_one_is_refused(short_dir: Path) -> None:
    path = short_dir / "sub" / "c.sock"
    prepare_unix_socket(path)  # creates the folder
    assert path.parent.is_dir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # bound but nobody listens: stale
    prepare_unix_socket(path)
    assert not path.exists()
    live = socket.socket(socket.AF_UNIX)
    try:
        live.bind(str(path))
        live.listen(1)
        with pytest.raises(ControlSocketInUseError, match="running swarmavg daemon"):
            prepare_unix_socket(path)
        assert path.exists()
    finally:
        live.close()


def test_regular_file_in_the_way(short_dir: Path) -> None:
    path = short_dir / "c.sock"
    path.write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        prepare_unix_socket(path)


class _Listener:
    """A real unix socket that accepts connections, as a daemon's control socket does."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def runtime_dir(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir))
    monkeypatch.delenv("SWARMAVG_CONTROL", raising=False)
    monkeypatch.delenv("SWARMAVG_RUN_ID", raising=False)
    return short_dir / "swarmavg"


def test_the_one_running_daemon_is_found_without_a_run_id(runtime_dir: Path) -> None:
    # `swarmavg peer --run-id my-run`, then `swarmavg status` / `connect()` with no flags.
    listener = _Listener(runtime_dir / "my-run.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(runtime_dir / "dead.sock"))  # bound, never listening: its daemon died
    stale.close()
    try:
        assert running_daemons() == {"my-run": runtime_dir / "my-run.sock"}
        assert resolve_endpoint(None).path == runtime_dir / "my-run.sock"
        # A named run always wins, even one that is not running.
        assert resolve_endpoint(None, "other").path == runtime_dir / "other.sock"
    finally:
        listener.close()


def test_several_running_daemons_are_listed_not_guessed(runtime_dir: Path) -> None:
    listeners = [_Listener(runtime_dir / f"{name}.sock") for name in ("alpha", "beta")]
    try:
        with pytest.raises(ValidationError, match=r"several.*alpha.*beta.*--run-id"):
            resolve_endpoint(None)
        assert resolve_endpoint(None, "beta").path == runtime_dir / "beta.sock"
    finally:
        for listener in listeners:
            listener.close()


def test_no_running_daemon_falls_back_to_the_default_run(runtime_dir: Path) -> None:
    assert running_daemons() == {}
    assert resolve_endpoint(None).path == runtime_dir / "default.sock"
