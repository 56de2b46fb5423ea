"""The start banner's commands are the ones to run: a private run's join command carries
the private-run flags, and a daemon off its run's default socket prints the
``SWARMAVG_CONTROL=...`` line its trainers need."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmavg.peer.cli.process import _run_file_of
from swarmavg.peer.daemon.config import PeerConfig
from swarmavg.peer.daemon.narration import join_banner


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "swarmavg"


def record(control: str, run_id: str = "my-run") -> dict[str, str]:
    return {
        "peer_id": "ab" * 20,
        "address": "203.0.113.7:31337",
        "control": control,
        "run_id": run_id,
    }


def test_a_private_run_banner_prints_a_join_command_with_the_private_flags(
    runtime_dir: Path,
) -> None:
    text = "\n".join(
        join_banner(record(str(runtime_dir / "my-run.sock")), "peer", "my-run.run.toml")
    )
    assert (
        "others join with:   swarmavg peer --join 203.0.113.7:31337 --run-file my-run.run.toml "
        "--credential THEIR.cred.pem --identity THEIR.key"
    ) in text
    assert "--run-id" not in text.split("others join with:")[1].splitlines()[0]
    assert "docs/private-runs.md" in text


def test_a_public_run_banner_keeps_the_run_id_join_command(runtime_dir: Path) -> None:
    text = "\n".join(join_banner(record(str(runtime_dir / "my-run.sock")), "peer"))
    assert "swarmavg peer --join 203.0.113.7:31337 --run-id my-run" in text
    assert "--run-file" not in text
    assert "swarmavg peers --run-id my-run" in text  # the default socket: found by run id
    assert "SWARMAVG_CONTROL" not in text


def test_a_daemon_off_the_default_socket_prints_the_environment_line(runtime_dir: Path) -> None:
    sibling = runtime_dir / "my-run-2.sock"
    lines = join_banner(record(str(sibling)), "peer")
    assert f"    SWARMAVG_CONTROL={sibling}" in lines
    assert f"  the run's peers:    swarmavg peers --control {sibling}" in lines


def test_the_run_file_reaches_the_banner_only_in_a_private_run(tmp_path: Path) -> None:
    class Daemon:
        def __init__(self, config: PeerConfig) -> None:
            self.config = config

    public = PeerConfig(run_id="r")
    assert _run_file_of(Daemon(public)) is None  # type: ignore[arg-type]
    private = PeerConfig(
        run_id="r",
        run_file=tmp_path / "r.run.toml",
        credential=tmp_path / "me.cred.pem",
        identity=tmp_path / "me.key",
    )
    assert _run_file_of(Daemon(private)) == str(tmp_path / "r.run.toml")  # type: ignore[arg-type]
