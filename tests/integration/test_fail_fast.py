"""Fail fast, with a message that says what to do; real ``swarmavg`` processes."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.harness import ProcessPool

pytestmark = pytest.mark.integration


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(150)
def test_a_run_id_mismatch_at_bootstrap_is_not_retried(swarmavg_processes: ProcessPool) -> None:
    sock = swarmavg_processes.workdir / "a.sock"
    first = swarmavg_processes.start(
        ["peer", "--listen", "127.0.0.1:0", "--control", str(sock), "--run-id", "right"]
    )
    other = run_cli(
        "peer",
        "--listen",
        "127.0.0.1:0",
        "--control",
        str(swarmavg_processes.workdir / "b.sock"),
        "--run-id",
        "wrong",
        "--join",
        first.address,
        "--bootstrap-timeout",
        "100",
    )
    assert other.returncode == 1
    assert other.stdout == ""
    assert "after 1 attempt(s)" in other.stderr  # one try, not 100 s of them
    assert "the run id differs" in other.stderr
    assert "every peer of a run must use the same --run-id" in other.stderr


@pytest.mark.timeout(90)
def test_an_explicit_data_port_that_is_taken_is_an_error(swarmavg_processes: ProcessPool) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "peer",
            "--listen",
            "127.0.0.1:0",
            "--control",
            str(swarmavg_processes.workdir / "d.sock"),
            "--data-port",
            str(port),
        )
    assert result.returncode == 1
    assert result.stdout == ""
    assert f"the data plane cannot listen on 127.0.0.1:{port} (--data-port {port})" in (
        result.stderr
    )
    assert "choose another --data-port, 0 for a free one, or -1" in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("address", "hint"),
    [
        ("http://127.0.0.1:41337", "drop the http:// scheme and write '127.0.0.1:41337'"),
        (
            "/ip4/10.0.0.1/tcp/31337/p2p/QmPeer",
            "multiaddrs are not supported: write 10.0.0.1:31337",
        ),
    ],
)
def test_urls_and_multiaddrs_are_refused_with_the_address_to_write(address: str, hint: str) -> None:
    result = run_cli("peer", "--join", address)
    assert result.returncode == 2
    assert f"join {address!r}: expected HOST:PORT; {hint}" in result.stderr
