"""Test harness shared by every test suite: in-process gRPC servers and real CLI processes.

Everything started here is torn down when the test ends, also when it fails: servers are
stopped, processes are terminated (then killed) and their stderr is kept for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

READY_TIMEOUT = 30.0

RegisterServices = Callable[[grpc.aio.Server, int], None]
"""Called with a fresh server and its index before it starts; adds the services under test."""


class GrpcServerPool:
    """Starts grpc.aio servers on 127.0.0.1 with OS-chosen ports; stops them all on close."""

    def __init__(self) -> None:
        self.servers: list[grpc.aio.Server] = []

    async def start(self, n: int, register: RegisterServices) -> list[str]:
        """Start ``n`` servers, each given to ``register`` first; return their HOST:PORT."""
        addresses = []
        for i in range(n):
            server = grpc.aio.server()
            register(server, i)
            port = server.add_insecure_port("127.0.0.1:0")
            if port == 0:
                raise RuntimeError("could not bind a loopback port")
            await server.start()
            self.servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        return addresses

    async def close(self) -> None:
        await asyncio.gather(*(s.stop(grace=None) for s in self.servers))
        self.servers.clear()


@dataclass
class SwarmavgProcess:
    """A real ``swarmavg`` subprocess whose ready line has been read."""

    args: list[str]
    proc: subprocess.Popen[bytes]
    ready: dict[str, Any]
    stderr_path: Path
    stdout_lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @property
    def address(self) -> str:
        return str(self.ready["address"])

    @property
    def control(self) -> str:
        return str(self.ready["control"])

    @property
    def peer_id(self) -> str:
        return str(self.ready["peer_id"])

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; return the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        if self._reader is not None:
            self._reader.join(timeout=timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


class ProcessPool:
    """Starts ``swarmavg`` subcommands as real processes and waits for their ready line."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: list[SwarmavgProcess] = []

    def start(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        ready_timeout: float = READY_TIMEOUT,
        executable: Sequence[str] | None = None,
    ) -> SwarmavgProcess:
        """Run ``swarmavg *args``; return once it printed its JSON ready line.

        Raises:
            RuntimeError: the process exited or printed no ready line in time; the
                message holds its stderr.
        """
        command = [*(executable or [sys.executable, "-m", "swarmavg.peer.cli"]), *args]
        stderr_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open by the child
            dir=self.workdir, prefix="stderr-", suffix=".log", delete=False
        )
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr_file,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=self.workdir,
        )
        stderr_file.close()
        lines: list[str] = []
        ready_event = threading.Event()
        ready: dict[str, Any] = {}

        def read_stdout() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                lines.append(line)
                if not ready_event.is_set():
                    with contextlib.suppress(json.JSONDecodeError):
                        record = json.loads(line)
                        if isinstance(record, dict) and record.get("event") == "ready":
                            ready.update(record)
                            ready_event.set()
            ready_event.set()  # EOF: wake the waiter, which sees no ready record

        reader = threading.Thread(target=read_stdout, daemon=True)
        reader.start()
        handle = SwarmavgProcess(
            list(command), proc, ready, Path(stderr_file.name), lines, _reader=reader
        )
        self.processes.append(handle)
        if not ready_event.wait(ready_timeout) or not ready:
            handle.stop(timeout=5)
            raise RuntimeError(
                f"{' '.join(command)} gave no ready line within {ready_timeout}s "
                f"(exit code {proc.poll()}); stdout={lines!r}\nstderr:\n{handle.stderr()}"
            )
        return handle

    def close(self) -> None:
        for handle in self.processes:
            handle.stop(timeout=10)
        self.processes.clear()

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def logged_to(handler: logging.Handler, logger_name: str, level: int) -> Iterator[None]:
    """``handler`` receives the records of ``logger_name`` from ``level`` up while the block
    runs (a code path's own log line as the event a test waits for); the logger's level is
    restored after."""
    logger = logging.getLogger(logger_name)
    previous = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
