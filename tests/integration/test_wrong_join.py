"""A wrong ``--join`` fails soon, with one line that says what is at that address; real
``swarmavg peer`` processes against a closed port, a silent listener and a web server.

Each run's deadline is far below the ``--bootstrap-timeout`` it is given (except for the
silent port, which can only be told apart by waiting): a daemon that kept retrying would
time out here, which is the behaviour these tests exclude.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import ProcessPool
from tests.integration.test_peer_processes import run_cli
from tests.private_runs import Authority

pytestmark = pytest.mark.integration

RUN_DEADLINE = 40.0
"""Seconds a start that should fail fast may take on a loaded machine (its
``--bootstrap-timeout`` is 120 s)."""


def start_peer(
    workdir: Path, join: str, bootstrap_timeout: float
) -> subprocess.CompletedProcess[str]:
    folder = workdir / "control"
    folder.mkdir(mode=0o700, exist_ok=True)
    control = str(folder / "c.sock")
    return run_cli(  # type: ignore[no-any-return]
        *("peer", "--listen", "127.0.0.1:0", "--control", control, "--join", join),
        *("--bootstrap-timeout", str(bootstrap_timeout)),
        timeout=RUN_DEADLINE + bootstrap_timeout if bootstrap_timeout < 60 else RUN_DEADLINE,
    )


def closed_port() -> int:
    """A port nobody listens on (bound once, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener takes connections into its backlog and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield int(listener.getsockname()[1])


@pytest.fixture
def web_server() -> Iterator[int]:
    """An HTTP/1 server's port."""

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("swarmavg peer: error:")]


@pytest.mark.timeout(90)
def test_a_closed_port_fails_within_seconds_saying_nothing_listens(tmp_path: Path) -> None:
    port = closed_port()
    result = start_peer(tmp_path, f"127.0.0.1:{port}", bootstrap_timeout=120)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert f"127.0.0.1:{port}: nothing listens there (connection refused)" in line
    assert "check the --join address" in line
    assert "private" not in line  # no hint that does not apply
    assert sum("retrying" in text for text in result.stderr.splitlines()) <= 1
    assert "peer stopped" not in result.stderr  # the error is the last word


@pytest.mark.timeout(90)
def test_a_web_server_is_named_as_not_speaking_the_protocol(
    tmp_path: Path, web_server: int
) -> None:
    result = start_peer(tmp_path, f"127.0.0.1:{web_server}", bootstrap_timeout=120)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert "that address does not speak swarmavg's protocol" in line
    assert "HTTP/2" not in result.stderr  # not gRPC's own wording
    assert "after 1 attempt(s)" in line  # not retried


@pytest.mark.timeout(90)
def test_a_silent_port_fails_at_the_bootstrap_timeout(tmp_path: Path, silent_port: int) -> None:
    result = start_peer(tmp_path, f"127.0.0.1:{silent_port}", bootstrap_timeout=4)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert "no answer in time" in line
    assert sum("retrying" in text for text in result.stderr.splitlines()) <= 1


@pytest.mark.timeout(90)
def test_a_private_runs_peer_is_named_and_the_private_flags_suggested(
    swarmavg_processes: ProcessPool,
) -> None:
    """A public start (--run-id, no credential) joining a private run's peer: the peer
    closes the plain connection at once; asked again for seconds, not the whole
    --bootstrap-timeout (120 s here)."""
    run = swarmavg_processes.workdir / "run"
    run.mkdir(mode=0o700)
    authority = Authority.create(run, "private-run")
    member = authority.invite("first")
    folder = swarmavg_processes.workdir / "private"
    folder.mkdir(mode=0o700)
    private = swarmavg_processes.start(
        [
            *("peer", "--listen", "127.0.0.1:0", "--control", str(folder / "p.sock")),
            *authority.peer_flags(member),
        ]
    )
    result = start_peer(swarmavg_processes.workdir, private.address, bootstrap_timeout=120)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert "it closed the connection at once (a private run's peer" in line
    assert "start with --run-file, --credential and --identity" in line
