"""A private run end to end through the CLI (docs/private-runs.md).

``swarmavg run init``, ``run whoami`` and ``run invite`` as the organiser and the peers would
type them; invited ``swarmavg peer`` daemons (real processes) average through the client API;
a daemon without a credential cannot join, and one with a foreign or borrowed credential does
not start, each with a message that says why.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmavg.peer import connect_async
from tests.harness import ProcessPool, SwarmavgProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

CLI = [sys.executable, "-m", "swarmavg.peer.cli"]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def swarmavg(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], cwd=folder, capture_output=True, text=True, timeout=60, check=False
    )


def organise(folder: Path, run_id: str) -> None:
    """``swarmavg run init`` in ``folder``: ``<run>.authority.pem`` and ``<run>.run.toml``."""
    folder.mkdir(parents=True, exist_ok=True)
    done = swarmavg(folder, "run", "init", "--run-id", run_id)
    assert done.returncode == 0, done.stderr
    assert f"{run_id}.run.toml" in done.stdout


def join_request(folder: Path, name: str) -> dict[str, str]:
    done = swarmavg(folder, "run", "whoami", "--identity", f"{name}.key", "--json")
    assert done.returncode == 0, done.stderr
    record: dict[str, str] = json.loads(done.stdout)
    return record


def invite(organiser: Path, run_id: str, request: str, out: Path) -> None:
    done = swarmavg(
        organiser,
        "run",
        "invite",
        request,
        "--authority",
        f"{run_id}.authority.pem",
        "--run-file",
        f"{run_id}.run.toml",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "invited peer" in done.stdout


def start(
    pool: ProcessPool, sock_dir: Path, name: str, flags: list[str], join: str | None = None
) -> SwarmavgProcess:
    args = ["peer", "--listen", "127.0.0.1:0", "--control", str(sock_dir / f"{name}.sock")]
    args += ["--bootstrap-timeout", "5", *flags]
    if join is not None:
        args += ["--join", join]
    return pool.start(args)


def private_flags(organiser: Path, peers: Path, name: str, run_id: str) -> list[str]:
    return [
        "--run-file",
        str(organiser / f"{run_id}.run.toml"),
        "--credential",
        str(peers / f"{name}.cred.pem"),
        "--identity",
        str(peers / f"{name}.key"),
    ]


async def average_all(daemons: list[SwarmavgProcess], inputs: list[np.ndarray]) -> list[object]:
    async def one(daemon: SwarmavgProcess, x: np.ndarray) -> object:
        async with connect_async(daemon.control) as client:
            return await client.average([x], key="step-1", group_size=len(daemons), timeout=40)

    return await asyncio.gather(
        *(one(d, x) for d, x in zip(daemons, inputs, strict=True)), return_exceptions=True
    )


def test_invited_daemons_average_and_strangers_are_kept_out(
    swarmavg_processes: ProcessPool, tmp_path: Path, sock_dir: Path
) -> None:
    organiser, peers = tmp_path / "organiser", tmp_path / "peers"
    peers.mkdir()
    organise(organiser, "lab")
    requests = {name: join_request(peers, name) for name in ("p0", "p1", "p2", "p3")}
    for name in ("p0", "p1", "p2"):  # p3 asked, but is never invited
        invite(organiser, "lab", requests[name]["join_request"], peers / f"{name}.cred.pem")

    first = start(swarmavg_processes, sock_dir, "p0", private_flags(organiser, peers, "p0", "lab"))
    daemons = [first] + [
        start(
            swarmavg_processes,
            sock_dir,
            name,
            private_flags(organiser, peers, name, "lab"),
            join=first.address,
        )
        for name in ("p1", "p2")
    ]
    assert [d.ready["run_id"] for d in daemons] == ["lab"] * 3  # named by the run file
    assert [d.peer_id for d in daemons] == [requests[n]["peer_id"] for n in ("p0", "p1", "p2")]

    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(300_000).astype(np.float32) for _ in daemons]
    results = asyncio.run(average_all(daemons, inputs))
    expected = np.mean(inputs, axis=0, dtype=np.float64)
    for result in results:
        assert not isinstance(result, BaseException), result
        assert result.group_size == 3  # type: ignore[attr-defined]
        np.testing.assert_allclose(result.tensors[0], expected, rtol=1e-5, atol=1e-6)  # type: ignore[attr-defined]

    # A daemon without credentials: every initial peer refuses it at the handshake.
    with pytest.raises(RuntimeError) as stranger:
        start(swarmavg_processes, sock_dir, "s", ["--run-id", "lab"], join=first.address)
    assert "could not join the swarm" in str(stranger.value)
    assert "if the run is private, start with --run-file" in str(stranger.value)

    # p3 borrows p2's credential: it names p2's peer id, not p3's.
    borrowed = private_flags(organiser, peers, "p2", "lab")
    borrowed[-1] = str(peers / "p3.key")
    with pytest.raises(RuntimeError) as borrower:
        start(swarmavg_processes, sock_dir, "b", borrowed, join=first.address)
    assert f"issued to peer {requests['p2']['peer_id']}" in str(borrower.value)
    assert f"is peer {requests['p3']['peer_id']}" in str(borrower.value)

    # A credential from another organiser's authority for a run of the same name.
    other = tmp_path / "other"
    organise(other, "lab")
    invite(other, "lab", requests["p3"]["join_request"], peers / "p3.cred.pem")
    with pytest.raises(RuntimeError) as foreign:
        start(
            swarmavg_processes,
            sock_dir,
            "f",
            private_flags(organiser, peers, "p3", "lab"),
            join=first.address,
        )
    assert "was not issued by the authority of run 'lab'" in str(foreign.value)
    # ...which does get p3 into the other organiser's run, and only there.
    alone = start(swarmavg_processes, sock_dir, "o", private_flags(other, peers, "p3", "lab"))
    assert alone.peer_id == requests["p3"]["peer_id"]
