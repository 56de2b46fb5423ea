"""Only the daemon's user reaches its control endpoint (docs/security.md).

A unix socket must live in a private folder and belong to this user; a TCP loopback endpoint
needs the token the daemon writes to a file only its user can read.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from swarmavg.peer import DaemonUnavailableError, Peer, PeerConfig, connect, connect_async
from swarmavg.peer.client.control_access import (
    TOKEN_METADATA_KEY,
    ControlAccessError,
    check_private_folder,
    read_token,
    token_path,
)
from swarmavg.peer.client.endpoint import ControlEndpoint
from swarmavg.peer.daemon.daemon import StartupError
from swarmavg.proto import control_pb2, control_pb2_grpc

pytestmark = pytest.mark.timeout(60)

_NOBODY = 65534


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


@pytest.fixture
def runtime_dir(sock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private XDG_RUNTIME_DIR, where the daemon keeps its TCP control token."""
    folder = sock_dir / "runtime"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    return folder


async def test_tcp_endpoint_serves_its_user_and_refuses_callers_without_the_token(
    runtime_dir: Path,
) -> None:
    config = PeerConfig(listen="127.0.0.1:0", control="127.0.0.1:0", run_id="tok")
    async with Peer(config) as peer:
        assert peer.control is not None
        assert peer.control.port
        token_file = token_path(peer.control)
        assert token_file.parent == runtime_dir / "swarmavg"
        assert token_file.stat().st_mode & 0o777 == 0o600

        async with await connect_async(str(peer.control)) as client:  # reads the token file
            result = await client.average(
                [np.ones(8, np.float32)], key="k", min_group_size=1, timeout=10
            )
            np.testing.assert_array_equal(result.tensors[0], np.ones(8, np.float32))

        async with grpc.aio.insecure_channel(peer.control.grpc_target()) as channel:
            stub = control_pb2_grpc.ControlStub(channel)  # type: ignore[no-untyped-call]
            for metadata in [(), ((TOKEN_METADATA_KEY, "0" * 64),)]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Status(control_pb2.StatusRequest(), timeout=5, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "token" in (refused.value.details() or "")
            # a streaming method is refused the same way
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.LoadState(control_pb2.LoadStateRequest(timeout=1), timeout=5):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not token_file.exists(), "the token file goes with the daemon"


def test_a_client_without_the_token_file_gets_a_clear_error(runtime_dir: Path) -> None:
    with socket.socket() as listener:  # some TCP listener that is not a daemon of ours
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(DaemonUnavailableError, match="belongs to another program") as info:
            connect(f"127.0.0.1:{port}", connect_timeout=2)
    assert f"no swarmavg control endpoint at 127.0.0.1:{port}" in str(info.value)
    assert "not yours" not in str(info.value)


def test_a_closed_port_is_named_as_nothing_listening(runtime_dir: Path) -> None:
    with socket.socket() as bound:  # bound, never listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        with pytest.raises(DaemonUnavailableError, match=f"nothing listens at 127.0.0.1:{port}"):
            connect(f"127.0.0.1:{port}", connect_timeout=2)


def test_a_token_file_others_can_read_is_refused(runtime_dir: Path) -> None:
    endpoint = ControlEndpoint(host="127.0.0.1", port=5)
    path = token_path(endpoint)
    path.parent.mkdir(mode=0o700)
    path.write_text("abc")
    path.chmod(0o644)
    with pytest.raises(ControlAccessError, match="not private"):
        read_token(endpoint)
    path.chmod(0o600)
    assert read_token(endpoint) == "abc"


async def test_a_socket_folder_others_can_write_is_refused(sock_dir: Path) -> None:
    shared = sock_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    config = PeerConfig(listen="127.0.0.1:0", control=str(shared / "a.sock"), run_id="perm")
    with pytest.raises(StartupError, match="writable by other users"):
        async with Peer(config):
            pass
    assert not (shared / "a.sock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a folder to another user")
def test_a_socket_folder_of_another_user_is_refused(sock_dir: Path) -> None:
    foreign = sock_dir / "foreign"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, _NOBODY, _NOBODY)
    with pytest.raises(ControlAccessError, match="belongs to another user"):
        check_private_folder(foreign)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a socket to another user")
def test_a_client_refuses_a_socket_of_another_user(sock_dir: Path) -> None:
    path = sock_dir / "impostor.sock"
    with socket.socket(socket.AF_UNIX) as impostor:
        impostor.bind(str(path))
        impostor.listen()
        os.chown(path, _NOBODY, _NOBODY)
        with pytest.raises(DaemonUnavailableError, match="belongs to another user"):
            connect(str(path), connect_timeout=2)


def test_a_socket_removed_while_it_is_checked_means_the_daemon_is_away(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon stopping under a trainer removes its socket at any moment, also between
    the client's looks at it: the client then finds the daemon away (and waits for its
    restart), instead of raising ``FileNotFoundError`` out of the training step (seen in
    CI, tests/integration/test_trainer_restart.py)."""
    from swarmavg.peer.client import client as client_module

    path = sock_dir / "c.sock"
    path.touch()
    checked = client_module.check_socket_owner

    def removed_meanwhile(socket_path: Path) -> None:
        socket_path.unlink()
        checked(socket_path)

    monkeypatch.setattr(client_module, "check_socket_owner", removed_meanwhile)
    with pytest.raises(DaemonUnavailableError, match="no socket file"):
        client_module._access(ControlEndpoint(path=path))
