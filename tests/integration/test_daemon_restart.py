"""A trainer's client survives its daemon's restart; a real ``swarmavg peer`` process is
stopped with Ctrl+C under a connected client and started again on the same endpoint.

While the daemon is away, a round fails at once (the wrappers count it as a failed round)
and a short call waits for it; once it is back, both work again on the same client, and the
absence and return are logged once each.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from swarmavg.peer import connect
from swarmavg.peer.client.errors import DaemonUnavailableError, SwarmError
from tests.harness import ProcessPool

pytestmark = pytest.mark.integration


def daemon_args(workdir: Path) -> list[str]:
    folder = workdir / "control"
    folder.mkdir(mode=0o700, exist_ok=True)
    return [
        "peer",
        "--listen",
        "127.0.0.1:0",
        "--run-id",
        "restart",
        "--control",
        str(folder / "c.sock"),
        "--identity",
        str(workdir / "peer.key"),
    ]


@pytest.mark.timeout(120)
def test_a_client_waits_for_its_restarted_daemon_and_goes_on(
    swarmavg_processes: ProcessPool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="swarmavg.peer.client")
    args = daemon_args(swarmavg_processes.workdir)
    first = swarmavg_processes.start(args)
    x = np.arange(4, dtype=np.float32)
    with connect(first.control, reconnect_timeout=90) as client:
        assert client.status()["peer_id"] == first.peer_id
        solo = client.average([x], key="before", min_group_size=1, group_size=1, timeout=10)
        assert solo.group_size == 1

        first.signal(signal.SIGINT)  # Ctrl+C on the daemon
        assert first.wait(timeout=30) == 0
        with pytest.raises(DaemonUnavailableError):  # a round while it is away: failed at once
            client.average([x], key="away", min_group_size=1, group_size=1, timeout=10)

        # A short call made while it is away waits for it (the round above marked it away).
        answer: dict[str, Any] = {}

        def status_meanwhile() -> None:
            try:
                answer["status"] = client.status()
            except SwarmError as exc:
                answer["error"] = exc

        waiter = threading.Thread(target=status_meanwhile)
        waiter.start()
        second = swarmavg_processes.start(args)  # the same command again
        waiter.join(timeout=100)
        assert not waiter.is_alive()
        assert "error" not in answer, answer.get("error")
        assert answer["status"]["peer_id"] == second.peer_id == first.peer_id
        assert answer["status"]["pid"] != first.proc.pid  # the new process answered

        again = client.average([x], key="after", min_group_size=1, group_size=1, timeout=10)
        assert again.group_size == 1
        np.testing.assert_array_equal(again.tensors[0], x)
    messages = [r.getMessage() for r in caplog.records if r.name == "swarmavg.peer.client"]
    assert sum("went away" in m for m in messages) == 1, messages
    assert sum("is back after" in m for m in messages) == 1, messages


@pytest.mark.timeout(60)
def test_a_daemon_that_stays_away_fails_the_call_after_the_reconnect_timeout(
    swarmavg_processes: ProcessPool,
) -> None:
    first = swarmavg_processes.start(daemon_args(swarmavg_processes.workdir))
    with connect(first.control, reconnect_timeout=1.0) as client:
        first.signal(signal.SIGINT)
        assert first.wait(timeout=30) == 0
        with pytest.raises(DaemonUnavailableError, match="did not come back within 1 s"):
            client.status()
