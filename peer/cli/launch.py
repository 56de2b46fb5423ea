"""``swarmavg launch [peer options] -- COMMAND ...``: a daemon for one training command.

torchrun's shape for a swarm: the launcher starts a daemon (``swarmavg peer`` with the
given options), waits for its ready line, runs COMMAND with ``SWARMAVG_CONTROL`` (and
``SWARMAVG_RUN_ID``) set to that daemon, and when COMMAND ends, stops the daemon and exits
with COMMAND's code. Several launches on one machine (one per GPU) each get their own
daemon: the control socket and, with the default ``--listen``, the port step aside for one
another (peer/daemon/control_server.py, peer/daemon/daemon.py).

Signals: both children run in sessions of their own, so a Ctrl+C in the terminal reaches
the launcher only. It forwards SIGINT/SIGTERM/SIGHUP to COMMAND (which may finish its
step and its final agreement through the daemon, still running), and stops the daemon
after COMMAND exits; a second Ctrl+C is forwarded too, for a command that exits on it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import IO, Any

READY_TIMEOUT = 600.0
"""Seconds the launcher waits for the daemon's ready line. The daemon bounds its own start
(``--bootstrap-timeout``, default 30 s); this catches a daemon wedged before it."""
DAEMON_STOP_TIMEOUT = 15.0
"""Seconds the daemon gets to shut down after SIGTERM (its own bound is a few seconds)
before it is killed."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WAIT_SLICE = 0.2
"""Seconds between two looks at the command while waiting for it: the longest a forwarded
signal can wait for the launcher's main thread."""


class LaunchError(RuntimeError):
    """The daemon did not become ready; the message is one line meant for the user."""


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[peer options] -- COMMAND ...`` -> (peer options, COMMAND).

    Raises:
        ValueError: no ``--`` or nothing after it.
    """
    if "--" not in argv:
        raise ValueError(
            "give the training command after --, e.g. "
            "swarmavg launch --join HOST:PORT -- python train.py"
        )
    cut = list(argv).index("--")
    command = list(argv[cut + 1 :])
    if not command:
        raise ValueError("nothing to run after --")
    return list(argv[:cut]), command


def start_daemon(peer_options: Sequence[str]) -> subprocess.Popen[bytes]:
    """``swarmavg peer`` with ``peer_options``, in a session of its own; stdout piped for
    its ready line, stderr (its logs and banner) shared with the launcher."""
    return subprocess.Popen(
        [sys.executable, "-m", "swarmavg.peer.cli", "peer", *peer_options],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )


def read_ready(daemon: subprocess.Popen[bytes], timeout: float = READY_TIMEOUT) -> dict[str, Any]:
    """The daemon's ready record.

    Raises:
        LaunchError: the daemon exited first (its error is already on stderr) or stayed
            silent for ``timeout`` seconds.
    """
    stdout: IO[bytes] | None = daemon.stdout
    if stdout is None:
        raise LaunchError("the daemon's stdout is not piped")
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"the daemon printed no ready line within {timeout:.0f} s")
            if selector.select(left):
                break
    line = stdout.readline()
    if not line:
        code = daemon.wait(timeout=DAEMON_STOP_TIMEOUT)
        raise LaunchError(f"the daemon did not start (exit code {code})")
    record = json.loads(line)
    if not isinstance(record, dict) or record.get("event") != "ready":
        raise LaunchError(f"the daemon's first line is not its ready line: {line[:200]!r}")
    return record


def command_environment(record: dict[str, Any]) -> dict[str, str]:
    """The training command's environment: the launcher's, plus where its daemon is."""
    env = dict(os.environ)
    env["SWARMAVG_CONTROL"] = str(record["control"])
    env["SWARMAVG_RUN_ID"] = str(record["run_id"])
    return env


def stop_daemon(daemon: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the daemon's graceful shutdown), then SIGKILL if it overstays."""
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=DAEMON_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    if daemon.stdout is not None:
        daemon.stdout.close()


def wait_interruptibly(child: subprocess.Popen[bytes]) -> int:
    """``child.wait()`` in short slices. The kernel may deliver a Ctrl+C to any of this
    process's threads (an imported library may have started one), and Python runs the
    handler only when the main thread executes again: a plain ``wait()`` blocked in
    ``waitpid`` would hold the forward until the child exits on its own."""
    while True:
        try:
            return child.wait(timeout=WAIT_SLICE)
        except subprocess.TimeoutExpired:
            continue


def exit_code(returncode: int) -> int:
    """A child's code as a shell reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def launch(peer_options: Sequence[str], command: Sequence[str]) -> int:
    """Run ``command`` beside a daemon started with ``peer_options``; return its exit code.

    Raises:
        LaunchError: the daemon did not become ready (nothing was run).
        OSError: ``command`` cannot be started (the daemon is stopped first).
    """
    daemon = start_daemon(peer_options)
    trainer: subprocess.Popen[bytes] | None = None
    starting = False  # the command is being started: a signal now is the command's
    pending: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if trainer is None and starting:
            pending.append(signum)  # delivered once Popen returns
            return
        target = trainer if trainer is not None else daemon
        if target.poll() is None:
            target.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        record = read_ready(daemon)
        print(
            f"swarmavg launch: running {' '.join(command)} with "
            f"SWARMAVG_CONTROL={record['control']}",
            file=sys.stderr,
            flush=True,
        )
        starting = True
        trainer = subprocess.Popen(
            list(command), env=command_environment(record), start_new_session=True
        )
        for signum in pending:
            trainer.send_signal(signum)
        return exit_code(wait_interruptibly(trainer))
    finally:
        if trainer is not None and trainer.poll() is None:  # the launcher itself failed
            trainer.kill()
            trainer.wait()
        stop_daemon(daemon)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
