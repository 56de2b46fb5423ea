"""``swarmavg run revoke`` end to end through the CLI (docs/private-runs.md, "Revoking a peer").

The organiser revokes an invited peer by its id or its credential file; the list is written
beside the run file and extended by the next call. Bad input gets one line on stderr. A daemon
given the list refuses the revoked peer, which then cannot join and is told why; a list of
another run stops a daemon at start.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import ProcessPool
from tests.integration.test_private_run_processes import (
    invite,
    join_request,
    organise,
    private_flags,
    start,
    swarmavg,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def revoke(organiser: Path, *args: str, run: str = "lab") -> tuple[int, str, str]:
    """``swarmavg run revoke ARGS`` in the organiser's folder of run ``run``."""
    authority, run_file = f"{run}.authority.pem", f"{run}.run.toml"
    done = swarmavg(
        organiser, "run", "revoke", *args, "--authority", authority, "--run-file", run_file
    )
    return done.returncode, done.stdout, done.stderr


def test_revoke_writes_extends_and_refuses_bad_input(tmp_path: Path) -> None:
    organiser, peers = tmp_path / "organiser", tmp_path / "peers"
    peers.mkdir()
    organise(organiser, "lab")
    requests = {name: join_request(peers, name) for name in ("p0", "p1")}
    invite(organiser, "lab", requests["p1"]["join_request"], peers / "p1.cred.pem")

    code, out, err = revoke(organiser, requests["p0"]["peer_id"])
    assert code == 0, err
    assert "revocation list #1 of run 'lab': 1 peer(s) revoked, written to" in out
    listing = organiser / "lab.revoked"  # beside the run file
    assert requests["p0"]["peer_id"] in listing.read_text()
    # By credential file this time: the list keeps p0 and takes the next number.
    code, out, err = revoke(organiser, str(peers / "p1.cred.pem"))
    assert code == 0, err
    assert "revocation list #2 of run 'lab': 2 peer(s) revoked" in out
    text = listing.read_text()
    assert requests["p0"]["peer_id"] in text
    assert requests["p1"]["peer_id"] in text
    assert re.search(r"^number = 2$", text, re.MULTILINE)

    code, _, err = revoke(organiser, "not-a-peer")
    assert code == 1
    assert err.strip() == (
        "swarmavg run: error: 'not-a-peer' is neither a peer id (40 hex digits) nor a "
        "credential file"
    )
    other = tmp_path / "other"
    organise(other, "other")
    foreign_key = str(other / "other.authority.pem")
    done = swarmavg(
        organiser,
        "run",
        "revoke",
        requests["p0"]["peer_id"],
        "--authority",
        foreign_key,
        "--run-file",
        "lab.run.toml",
    )
    assert done.returncode == 1
    assert "the authority key does not belong to run 'lab'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    code, _, err = revoke(other, requests["p0"]["peer_id"], run="other")
    assert code == 0, err
    code, _, err = revoke(
        organiser, requests["p0"]["peer_id"], "--out", str(other / "other.revoked")
    )
    assert code == 1
    assert "it is a revocation list of run 'other', not of run 'lab'" in err
    assert "number = 2" in listing.read_text()  # untouched by the failures


def test_a_daemon_with_the_list_keeps_the_revoked_peer_out(
    swarmavg_processes: ProcessPool, tmp_path: Path, sock_dir: Path
) -> None:
    organiser, peers = tmp_path / "organiser", tmp_path / "peers"
    peers.mkdir()
    organise(organiser, "lab")
    requests = {name: join_request(peers, name) for name in ("p0", "p1")}
    for name in ("p0", "p1"):
        invite(organiser, "lab", requests[name]["join_request"], peers / f"{name}.cred.pem")
    code, _, err = revoke(organiser, str(peers / "p1.cred.pem"))
    assert code == 0, err
    listing = organiser / "lab.revoked"

    flags = private_flags(organiser, peers, "p0", "lab")
    first = start(swarmavg_processes, sock_dir, "p0", [*flags, "--revocations", str(listing)])
    with pytest.raises(RuntimeError) as revoked:
        start(
            swarmavg_processes,
            sock_dir,
            "p1",
            private_flags(organiser, peers, "p1", "lab"),
            join=first.address,
        )
    assert "could not join the swarm" in str(revoked.value)
    assert "credential revoked" in str(revoked.value)
    assert "the run's organiser has revoked this peer's credential" in str(revoked.value)

    # A list of another run (its own authority, same run name) stops a daemon at start.
    other = tmp_path / "other"
    organise(other, "lab")
    code, _, err = revoke(other, requests["p1"]["peer_id"])
    assert code == 0, err
    with pytest.raises(RuntimeError) as foreign:
        start(
            swarmavg_processes,
            sock_dir,
            "p0b",
            [*flags, "--revocations", str(other / "lab.revoked")],
        )
    assert f"revocation list {other / 'lab.revoked'}: it was not signed by the authority" in str(
        foreign.value
    )
