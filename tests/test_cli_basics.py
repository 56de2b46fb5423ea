"""The console script answers --help and --version without a daemon."""

from __future__ import annotations

import subprocess
import sys

from swarmavg.peer import __version__


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"swarmavg {__version__}"


def test_help_lists_usage() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "usage: swarmavg" in result.stdout
