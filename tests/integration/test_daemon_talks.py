"""A daemon that talks: banner, warnings, joins and leaves, failed rounds with
their reason, one summary per interval; real ``swarmavg peer`` processes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from swarmavg.peer import NoGroupError, connect
from tests.harness import ProcessPool, SwarmavgProcess

pytestmark = pytest.mark.integration
RUN = "talk-run"


def wait_for_stderr(daemon: SwarmavgProcess, found: Callable[[str], bool], what: str) -> str:
    """Poll a daemon's stderr file (another process: nothing to wait on but its output)."""
    deadline = time.monotonic() + 60.0
    while not found(text := daemon.stderr()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in the daemon's stderr:\n{text}")
        time.sleep(0.1)
    return text


def start(pool: ProcessPool, name: str, *extra: str) -> SwarmavgProcess:
    sock = pool.workdir / f"{name}.sock"
    return pool.start(
        ["peer", "--listen", "127.0.0.1:0", "--control", str(sock), "--run-id", RUN, *extra]
    )


@pytest.mark.timeout(150)
def test_the_daemon_says_how_to_join_who_joined_and_how_rounds_went(
    swarmavg_processes: ProcessPool,
) -> None:
    first = start(swarmavg_processes, "a", "-v", "--summary-interval", "1")
    assert first.stdout_lines == [json.dumps(first.ready)]  # the ready line, unchanged
    assert set(first.ready) == {"event", "peer_id", "address", "control", "run_id"}
    # The banner is printed, then the address warning logged: wait for both (reading
    # between the two, on a loaded machine, found the banner without the warning).
    text = wait_for_stderr(
        first,
        lambda t: "others join with" in t and "is a loopback address" in t,
        "banner and address warning",
    )
    assert f"swarmavg peer --join {first.address} --run-id {RUN}" in text
    assert f"the announced address {first.address} is a loopback address" in text
    assert "--announce PUBLIC_HOST:PORT" in text

    second = start(swarmavg_processes, "b", "--join", first.address)
    wait_for_stderr(first, lambda t: f"peer {second.peer_id[:12]} joined" in t, "join line")

    with connect(first.control, use_shm=False) as client, pytest.raises(NoGroupError):
        client.average(
            [np.ones(2, np.float32)], key="lonely", min_group_size=3, group_size=3, timeout=1.0
        )
    text = wait_for_stderr(first, lambda t: "round lonely failed (no_group)" in t, "failed round")
    text = wait_for_stderr(first, lambda t: "1 failed (no_group 1)" in t, "summary line")
    summaries = [line for line in text.splitlines() if ": last " in line]
    assert all(" INFO swarmavg.peer.daemon: last " in line for line in summaries)
    assert "1 peer known" in summaries[-1]
    # -v shows the daemon's DEBUG lines, not gRPC's per-call ones
    assert " DEBUG swarmavg." in text
    assert "grpc._cython" not in text

    # A stopped peer leaves the routing table once requests to it failed (stale_after = 3,
    # dht/config.py): DHT stores through the first daemon make those requests.
    second.stop()
    gone = f"peer {second.peer_id[:12]} left ({second.address}); 0 known"
    with connect(first.control, use_shm=False) as client:
        deadline = time.monotonic() + 60.0
        while gone not in first.stderr():
            assert time.monotonic() < deadline, first.stderr()
            client.dht.store("probe", 1, ttl=30.0)


@pytest.mark.timeout(90)
def test_quiet_daemon_prints_only_its_ready_line_and_warnings(
    swarmavg_processes: ProcessPool, tmp_path: Path
) -> None:
    quiet = start(swarmavg_processes, "q", "-q")
    assert quiet.stdout_lines == [json.dumps(quiet.ready)]
    text = wait_for_stderr(quiet, lambda t: "loopback address" in t, "address warning")
    assert "others join with" not in text
    assert " INFO " not in text
