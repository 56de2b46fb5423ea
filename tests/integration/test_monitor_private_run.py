"""``swarmavg monitor`` in a private run (docs/peer.md "Monitor",
docs/private-runs.md): with the run file, a credential and the identity it was issued for,
the monitor joins a swarm of invited ``swarmavg peer`` daemons (real processes, mutual TLS)
and records what their trainers report; without a credential every peer refuses it at the
handshake and it says what to give.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest

from swarmavg.averaging.training.progress import ProgressTracker
from swarmavg.peer import connect
from tests.harness import ProcessPool, SwarmavgProcess
from tests.private_runs import Authority

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
RUN = "private-watch"


def series_in(csv_path: Path) -> dict[str, float]:
    """The last value of every series the monitor wrote so far."""
    if not csv_path.exists():
        return {}
    with csv_path.open(newline="") as f:
        rows = list(csv.reader(f))[1:]
    return {name: float(value) for _, name, value in rows}


def test_an_invited_monitor_records_a_private_run_and_a_stranger_is_refused(
    swarmavg_processes: ProcessPool, tmp_path: Path
) -> None:
    authority = Authority.create(tmp_path / "run", RUN)
    members = {name: authority.invite(name) for name in ("a", "b", "watch")}

    def start_peer(name: str, *extra: str) -> SwarmavgProcess:
        control = str(tmp_path / f"{name}.sock")
        flags = authority.peer_flags(members[name])
        return swarmavg_processes.start(
            ["peer", "--listen", "127.0.0.1:0", "--control", control, *flags, *extra]
        )

    first = start_peer("a")
    daemons = [first, start_peer("b", "--join", first.address)]
    csv_path = tmp_path / "private.csv"
    clients = [connect(d.control, use_shm=False) for d in daemons]
    try:
        trackers = [ProgressTracker(c, RUN, 10_000, ttl=60.0) for c in clients]
        for i, tracker in enumerate(trackers):
            tracker.add_samples(16)
            tracker.set_metrics({"loss": 1.0 + i})
            tracker.report()

        # The run file names the run: no --run-id, as for `swarmavg peer`.
        monitor = swarmavg_processes.start(
            [
                "monitor",
                *authority.peer_flags(members["watch"]),
                "--initial-peers",
                daemons[1].address,
                "--interval",
                "0.3",
                "--no-http",
                "--csv",
                str(csv_path),
            ]
        )
        assert monitor.ready["run_id"] == RUN
        assert monitor.peer_id == members["watch"].identity.peer_id_hex
        deadline = time.monotonic() + 60
        seen = series_in(csv_path)
        while not (seen.get("peers") == 2 and seen.get("trainers") == 2):
            assert time.monotonic() < deadline, f"the monitor never saw the run: {seen}"
            assert monitor.proc.poll() is None, monitor.stderr()
            for tracker in trackers:  # keep the records fresh while the monitor polls
                tracker.add_samples(16)
                tracker.report()
            time.sleep(0.2)
            seen = series_in(csv_path)
        assert seen["metric/loss"] == pytest.approx(1.5)  # both trainers' mean, over TLS
        assert "private run private-watch: TLS with credential" in monitor.stderr()
    finally:
        for client in clients:
            client.close()

    # A monitor without credentials: the invited peers refuse its handshakes.
    with pytest.raises(RuntimeError) as stranger:
        swarmavg_processes.start(
            [
                "monitor",
                "--run-id",
                RUN,
                "--initial-peers",
                first.address,
                "--bootstrap-timeout",
                "2",
                "--no-http",
            ]
        )
    assert "could not join the swarm" in str(stranger.value)
    assert "if the run is private, start with --run-file, --credential" in str(stranger.value)

    # The monitor's credential on another identity: refused before it dials anyone.
    borrowed = authority.peer_flags(members["watch"])
    borrowed[-1] = str(members["a"].identity_path)
    with pytest.raises(RuntimeError) as borrower:
        swarmavg_processes.start(
            ["monitor", *borrowed, "--initial-peers", first.address, "--no-http"]
        )
    assert f"issued to peer {members['watch'].identity.peer_id_hex}" in str(borrower.value)
