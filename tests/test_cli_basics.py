"""The console script answers --help and --version without a daemon, and fails clearly."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from swarmavg.peer import __version__


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"swarmavg {__version__}"


def test_help_lists_usage() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "usage: swarmavg" in result.stdout
    for command in ("peer", "dht", "status", "peers"):
        assert command in result.stdout


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        (
            "peer",
            [
                "--listen",
                "--announce",
                "--join",
                "--run-id",
                "--control",
                "--client-mode",
                "--identity",
                "--config",
                "--metrics",
                "--log-level",
                "SWARMAVG_LISTEN",
            ],
        ),
        ("dht", ["--listen", "--announce", "--join", "--identity", "--run-id"]),
        ("status", ["--control", "--json"]),
        ("peers", ["--run-id", "--control", "--json", "--training-run"]),
        ("launch", ["--join", "--run-id", "--listen", "-- COMMAND", "SWARMAVG_CONTROL"]),
    ],
)
def test_subcommand_help(command: str, flags: list[str]) -> None:
    result = run_cli(command, "--help")
    assert result.returncode == 0
    for flag in flags:
        assert flag in result.stdout


def test_status_without_a_daemon_is_one_clear_line() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        result = run_cli("status", "--control", str(Path(d) / "none.sock"))
    assert result.returncode == 1
    assert result.stderr.startswith("swarmavg status: error: no swarmavg daemon answers at")
    assert len(result.stderr.strip().splitlines()) == 1


def test_peers_without_a_daemon_is_one_clear_line() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        result = run_cli("peers", "--control", str(Path(d) / "none.sock"))
    assert result.returncode == 1
    assert result.stderr.startswith("swarmavg peers: error: no swarmavg daemon answers at")
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_settings_exit_with_usage_error(tmp_path: Path) -> None:
    result = run_cli("peer", "--listen", "nowhere")
    assert result.returncode == 2
    assert "listen 'nowhere': expected HOST:PORT" in result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("colour = 'blue'\n")
    result = run_cli("peer", "--config", str(bad))
    assert result.returncode == 2
    assert "unknown top-level key colour" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "suggestion"),
    [
        (["peer", "--run_id", "x"], "did you mean --run-id (not --run_id)?"),
        (["peer", "--bootstrap-timout=3"], "did you mean --bootstrap-timeout"),
        (["status", "--jsn"], "did you mean --json (not --jsn)?"),
        (["launch", "--run_id", "x", "--", "true"], "did you mean --run-id (not --run_id)?"),
    ],
)
def test_a_flag_typo_gets_the_flag_it_likely_meant(args: list[str], suggestion: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    [line] = [text for text in result.stderr.splitlines() if "error:" in text]
    assert "unrecognized arguments" in line
    assert line.endswith(suggestion) or suggestion in line
    assert result.stdout == ""


def test_launch_without_a_command_says_where_it_goes() -> None:
    result = run_cli("launch", "--run-id", "x")
    assert result.returncode == 2
    assert "give the training command after --" in result.stderr
