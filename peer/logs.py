"""Logging setup: the daemon's (``swarmavg peer``/``dht``) and a training script's.

``swarmavg.peer.enable_logging()`` is the one call a training script makes to see the
library's warnings and progress (a late joiner's state download, a failed round): without
it, Python shows nothing below WARNING, and nothing at all of a library whose script never
configured logging beyond the last-resort handler.

gRPC's own Python loggers write a DEBUG line per call (``[_cygrpc] Loaded running loop``),
which drowns the daemon's at ``-v``: they stay at WARNING unless the user asks for gRPC's
logs with ``GRPC_VERBOSITY`` (which also sets the C core's level, read when grpc is imported).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
GRPC_VERBOSITY_ENV = "GRPC_VERBOSITY"
_HANDLER_NAME = "swarmavg.enable_logging"
LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


def quiet_grpc() -> None:
    """Keep gRPC's Python loggers at WARNING unless ``GRPC_VERBOSITY`` asks for more."""
    if not os.environ.get(GRPC_VERBOSITY_ENV):
        logging.getLogger("grpc").setLevel(logging.WARNING)


def setup_daemon_logging(level: str) -> None:
    """The daemon's logging: every logger at ``level`` on stderr (stdout holds only the
    JSON ready line), gRPC's quiet (see the module docstring)."""
    logging.basicConfig(level=level, stream=sys.stderr, format=FORMAT)
    quiet_grpc()


def enable_logging(level: str | int = "INFO", stream: TextIO | None = None) -> logging.Logger:
    """Make swarmavg's log lines visible in a training script; idempotent.

    When the script has configured logging itself (the root logger has a handler), only the
    ``swarmavg`` logger's level is set and its lines go to the script's handlers. Otherwise a
    handler writing to ``stream`` (default stderr) is added to the ``swarmavg`` logger; a
    second call changes the level and keeps that one handler.

    Args:
        level: a logging level or its name (``"DEBUG"``, ``"INFO"``, ...).
        stream: where the lines go when swarmavg adds its own handler.

    Returns:
        the ``swarmavg`` logger.

    Raises:
        ValueError: an unknown level name.
    """
    if isinstance(level, str):
        if level.upper() not in LEVELS:
            raise ValueError(f"unknown logging level {level!r}: one of {', '.join(LEVELS)}")
        level = LEVELS[level.upper()]
    logger = logging.getLogger("swarmavg")
    logger.setLevel(level)
    quiet_grpc()
    if logging.getLogger().handlers:
        return logger
    ours = [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]
    if not ours:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
        # Our handler shows the lines; the last-resort handler must not print them again.
        logger.propagate = False
    elif stream is not None and isinstance(ours[0], logging.StreamHandler):
        ours[0].setStream(stream)
    return logger
