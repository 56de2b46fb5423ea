"""``swarmavg.peer.enable_logging``: the library's lines visible in a training script."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from swarmavg.peer import enable_logging


@pytest.fixture
def bare_logging() -> Iterator[None]:
    """No root handler (a script that never configured logging); restored afterwards."""
    root, ours, grpc_logger = (
        logging.getLogger(),
        logging.getLogger("swarmavg"),
        logging.getLogger("grpc"),
    )
    saved = (root.handlers[:], ours.handlers[:], ours.level, ours.propagate, grpc_logger.level)
    root.handlers.clear()
    ours.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:], ours.handlers[:] = saved[0], saved[1]
        ours.setLevel(saved[2])
        ours.propagate = saved[3]
        grpc_logger.setLevel(saved[4])


SCRIPT = """
import logging
from swarmavg.peer import enable_logging
enable_logging()
enable_logging("debug")
logging.getLogger("swarmavg.averaging.training").debug("loading state: %d%%", 50)
logging.getLogger("grpc._cython.cygrpc").debug("[_cygrpc] Loaded running loop")
assert len(logging.getLogger("swarmavg").handlers) == 1
try:
    enable_logging("loud")
except ValueError as exc:
    print(exc)
"""


def test_a_plain_script_sees_the_lines_once_and_not_grpcs() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("loading state: 50%") == 1
    assert " DEBUG swarmavg.averaging.training: " in result.stderr
    assert "_cygrpc" not in result.stderr
    assert "unknown logging level 'loud'" in result.stdout


@pytest.mark.usefixtures("bare_logging")
def test_a_script_with_its_own_logging_keeps_its_handlers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logging.getLogger().addHandler(logging.NullHandler())
    enable_logging("INFO")
    assert logging.getLogger("swarmavg").handlers == []
    with caplog.at_level(logging.INFO):
        logging.getLogger("swarmavg.peer").info("visible")
    assert "visible" in caplog.text
