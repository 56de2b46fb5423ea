"""Running ip/tc/iptables, checking that the test bed can run here, naming and stale cleanup.

Every name the test bed creates starts with ``satb<pid>x<random>``: the pid of the process that
owns it, so that leftovers of a process that was killed (SIGKILL leaves no chance to clean up)
can be recognised and removed by the next test bed, and a random part, so that parallel test
beds in one process never clash.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

NAME_PREFIX = "satb"
COMMAND_TIMEOUT = 20.0
_OWNED_NAME = re.compile(rf"^{NAME_PREFIX}(\d+)x[0-9a-f]+-")


class TestBedError(RuntimeError):
    """A test bed command failed; the message holds the command and its stderr."""

    __test__ = False  # not a pytest test class despite the name


def run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one system command with a deadline; raise :class:`TestBedError` when it fails."""
    try:
        done = subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestBedError(f"{' '.join(args)}: {exc}") from exc
    if check and done.returncode != 0:
        raise TestBedError(f"{' '.join(args)} exited with {done.returncode}: {done.stderr.strip()}")
    return done


def new_prefix() -> str:
    """A name prefix unique to this process and call: ``satb<pid>x<8 hex digits>``."""
    return f"{NAME_PREFIX}{os.getpid()}x{secrets.token_hex(4)}"


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = run(["ip", "netns", "list"]).stdout
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """Pids of the processes running inside ``namespace`` (empty when it is gone)."""
    done = run(["ip", "netns", "pids", namespace], check=False)
    return [int(word) for word in done.stdout.split() if word.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(namespace: str, grace: float = 3.0) -> None:
    """SIGTERM every process inside ``namespace``, then SIGKILL those left after ``grace``.

    A named namespace outlives ``ip netns del`` while processes still run in it, and so do
    its interfaces, so they must be gone before the namespace is deleted.
    """
    pids = namespace_pids(namespace)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in namespace_pids(namespace) if _pid_alive(pid)]
        if pids:
            time.sleep(0.05)
    for pid in namespace_pids(namespace):
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def delete_namespace(namespace: str) -> None:
    """Stop the processes inside ``namespace`` and delete it; its interfaces and its
    iptables rules go with it. A namespace that is already gone is fine."""
    kill_namespace_processes(namespace)
    run(["ip", "netns", "del", namespace], check=False)


def sweep_stale() -> list[str]:
    """Delete test bed namespaces whose owning process no longer exists; return their names."""
    removed = []
    for name in list_namespaces():
        match = _OWNED_NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            delete_namespace(name)
            removed.append(name)
    return removed


@functools.cache
def missing_requirements() -> str | None:
    """Why the test bed cannot run on this machine, or None when it can.

    Checks root, the ``ip``/``tc``/``iptables`` binaries and that a network namespace can
    really be created (containers without CAP_SYS_ADMIN cannot). Cached per process.
    """
    if os.geteuid() != 0:
        return "the network test bed needs root (network namespaces, tc, iptables)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            package = "iproute2" if tool in ("ip", "tc") else "iptables"
            return f"the network test bed needs `{tool}` (apt-get install {package})"
    probe = f"{new_prefix()}-probe"
    try:
        run(["ip", "netns", "add", probe])
    except TestBedError as exc:
        return f"cannot create a network namespace here: {exc}"
    try:
        run(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", "-n"])
    except TestBedError as exc:
        return f"iptables NAT does not work inside a network namespace: {exc}"
    finally:
        run(["ip", "netns", "del", probe], check=False)
    return None
