"""A daemon process's life: the event loop, the signals, the ready line, the exit codes.

Shared by the commands that run until stopped (``swarmavg peer``, ``dht``, ``monitor``):
the first SIGINT/SIGTERM shuts down gracefully, a second exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from typing import Any, Protocol

EXIT_STARTUP = 1
EXIT_USAGE = 2
EXIT_FORCED = 130


class Daemon(Protocol):
    async def start(self) -> None: ...
    async def shutdown(self, grace: float | None = None) -> None: ...
    def ready_record(self) -> dict[str, Any]: ...


def _announce_banner(record: dict[str, Any], command: str, run_file: str | None) -> None:
    """The human part of the start (stderr, after the JSON ready line on stdout): how
    others join, and a warning when they cannot reach the announced address."""
    from swarmavg.peer.daemon.narration import address_warning, announce_hint, join_banner

    logger = logging.getLogger("swarmavg.peer.cli")
    if logger.isEnabledFor(logging.INFO):
        for line in join_banner(record, command, run_file):
            print(line, file=sys.stderr)
        sys.stderr.flush()
    warning = address_warning(str(record["address"])) if record.get("address") else None
    if warning is not None:
        logger.warning("%s", announce_hint(warning))


def report_error(command: str, message: str) -> None:
    print(f"swarmavg {command}: error: {message}", file=sys.stderr, flush=True)


def run_loop(main: Any) -> int:
    """Run ``main`` on uvloop when importable, else the default loop."""
    factory: Any = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        pass
    if sys.version_info < (3, 11):  # pragma: no cover - no loop_factory before 3.11
        if factory is not None:
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return int(asyncio.run(main))
    with asyncio.Runner(loop_factory=factory) as runner:
        return int(runner.run(main))


async def serve(daemon: Daemon, command: str) -> int:
    """Start ``daemon``, print the ready line, run until a signal, shut down.

    First SIGINT/SIGTERM: graceful shutdown (also during startup). Second: exit at once.
    """
    from swarmavg.peer.daemon.daemon import StartupError

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()
    signals_seen = 0
    starting = True

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            print(f"swarmavg {command}: second signal, exiting now", file=sys.stderr, flush=True)
            _cleanup_socket(daemon)
            os._exit(EXIT_FORCED)
        logging.getLogger("swarmavg").info(
            "%s received: shutting down (send it again to exit at once)",
            signal.Signals(signum).name,
        )
        stop.set()
        if starting and main_task is not None:
            main_task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        try:
            await daemon.start()
        except StartupError as exc:
            report_error(command, str(exc))
            return EXIT_STARTUP
        except asyncio.CancelledError:
            await daemon.shutdown(0.0)
            return 0
        starting = False
        record = daemon.ready_record()
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
        _announce_banner(record, command, _run_file_of(daemon))
        await stop.wait()
        await daemon.shutdown()
        return 0
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def _run_file_of(daemon: Daemon) -> str | None:
    """A private run's run file (the join command names it), None in a public run."""
    config = getattr(daemon, "config", None)
    run_file = getattr(config, "run_file", None)
    credential = getattr(config, "credential", None)
    return None if run_file is None or credential is None else str(run_file)


def _cleanup_socket(daemon: Daemon) -> None:
    """Best effort on a forced exit: remove our control socket so the next start is clean."""
    control = getattr(daemon, "control", None)
    path = getattr(control, "path", None)
    if path is not None and getattr(daemon, "_control_server", None) is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)
