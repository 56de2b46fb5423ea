"""Messages that say what is wrong; real ``swarmavg peer`` processes.

``connect()`` at a peer's public port names it as such (not "the daemon there is not
yours"); a run-id mismatch between daemons leads with "the run ids differ" (not "no initial
peer answered"); ``status`` on a loopback peer says it is local only.
"""

from __future__ import annotations

import pytest

from swarmavg.peer import connect
from swarmavg.peer.cli.status import format_status
from swarmavg.peer.client.errors import DaemonUnavailableError
from tests.harness import ProcessPool
from tests.integration.test_peer_processes import run_cli

pytestmark = pytest.mark.integration


def control_args(pool: ProcessPool, name: str) -> list[str]:
    folder = pool.workdir / "control"
    folder.mkdir(mode=0o700, exist_ok=True)
    return ["--control", str(folder / f"{name}.sock")]


@pytest.mark.timeout(90)
def test_connect_at_a_peers_public_port_names_it(swarmavg_processes: ProcessPool) -> None:
    peer = swarmavg_processes.start(
        ["peer", "--listen", "127.0.0.1:0", *control_args(swarmavg_processes, "a")]
    )
    with pytest.raises(DaemonUnavailableError) as info:
        connect(peer.address, connect_timeout=5)
    message = str(info.value)
    assert f"{peer.address} is a port of a swarmavg peer" in message
    assert "not its control endpoint" in message
    assert "not yours" not in message
    with connect(peer.control, connect_timeout=30) as client:  # what the message points to
        text = format_status(client.status())
    assert "local only: a loopback address" in text
    assert "public (dialled directly" not in text
    assert "not measured yet (starting value" in text


@pytest.mark.timeout(90)
def test_a_run_id_mismatch_says_the_run_ids_differ(swarmavg_processes: ProcessPool) -> None:
    first = swarmavg_processes.start(
        [
            "peer",
            "--listen",
            "127.0.0.1:0",
            "--run-id",
            "right",
            *control_args(swarmavg_processes, "r"),
        ]
    )
    other = run_cli(
        *("peer", "--listen", "127.0.0.1:0", "--run-id", "wrong", "--join", first.address),
        *control_args(swarmavg_processes, "w"),
    )
    assert other.returncode == 1
    [line] = [text for text in other.stderr.splitlines() if "error:" in text]
    assert line.startswith("swarmavg peer: error: could not join the swarm: the run ids differ")
    assert "no initial peer answered" not in line
    assert "peer stopped" not in other.stderr


@pytest.mark.timeout(90)
def test_a_taken_port_is_one_line_without_grpcs_own(swarmavg_processes: ProcessPool) -> None:
    first = swarmavg_processes.start(
        ["peer", "--listen", "127.0.0.1:0", *control_args(swarmavg_processes, "t")]
    )
    second = run_cli("peer", "--listen", first.address, *control_args(swarmavg_processes, "u"))
    assert second.returncode == 1
    port = first.address.rsplit(":", 1)[1]
    assert second.stderr.strip() == (
        f"swarmavg peer: error: cannot listen on {first.address}: port {port} is already in "
        "use (another swarmavg peer?); choose another with --listen HOST:PORT (port 0 picks a "
        "free one)"
    )
