"""Links with propagation delay, jitter and loss: a compiled userspace wire between two TAPs.

netem is missing from the project's kernels, so a host's link that must delay or drop frames
is not a veth pair but two TAP devices (the host's ``eth0`` and the switch's or router's
port), joined by one ``wire`` process (``wire.c`` next to this file) that carries each frame
across after the link's delay or drops it. Rate limits stay ``tc tbf`` on the two devices,
ahead of the wire, exactly as on a veth link.

The C source is compiled on first use with the machine's C compiler into a cache folder
(``$SWARMAVG_TESTBED_CACHE``, else ``$XDG_CACHE_HOME/swarmavg-testbed``, else
``~/.cache/swarmavg-testbed``), under a name that holds the source's hash, so an edited
source is rebuilt and parallel test beds share one binary.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deploy.testbed._system import COMMAND_TIMEOUT, TestBedError

SOURCE = Path(__file__).with_name("wire.c")
NETNS_DIR = Path("/run/netns")
"""Where ``ip netns add`` mounts named namespaces (the wire enters them by these paths)."""
MIN_QUEUE_BYTES = 1 << 20
MAX_QUEUE_BYTES = 256 << 20
UNLIMITED_RATE_MBIT = 1000.0
"""The rate a link without a limit is sized for: the wire itself carries about this much."""
QUEUE_HEADROOM_S = 0.05


@dataclass(frozen=True)
class LinkImpairment:
    """What one link does to the frames crossing it, the same in both directions.

    Attributes:
        delay_ms: one-way propagation delay.
        jitter_ms: the delay varies within ``delay_ms +- jitter_ms`` (never above the delay),
            smoothly enough that frames keep their order.
        loss: probability that a frame is dropped, per frame and direction.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms!r}")
        if not 0 <= self.jitter_ms <= self.delay_ms:
            raise ValueError(f"jitter_ms must be in [0, delay_ms], got {self.jitter_ms!r}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss!r}")

    @property
    def active(self) -> bool:
        """Whether the link needs a wire at all (a plain veth otherwise)."""
        return self.delay_ms > 0 or self.loss > 0


def cache_dir() -> Path:
    """The folder compiled wires are kept in (see the module docstring)."""
    explicit = os.environ.get("SWARMAVG_TESTBED_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swarmavg-testbed"


def compiler() -> str | None:
    """The C compiler to build the wire with: ``$CC``, else ``cc``, else ``gcc``; None if none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def missing_requirements() -> str | None:
    """Why links with delay or loss cannot be built here (a reason to skip with), or None."""
    if compiler() is None:
        return (
            "links with delay, jitter or loss need a C compiler to build the test bed's wire "
            "(set $CC, or apt-get install gcc)"
        )
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "links with delay, jitter or loss need /dev/net/tun (TAP devices)"
    return None


def binary() -> Path:
    """The compiled wire, built now if this source was never built here.

    Raises:
        TestBedError: no compiler, or the build failed (with the compiler's output).
    """
    reason = missing_requirements()
    if reason is not None:
        raise TestBedError(reason)
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"wire-{digest}"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: a parallel build never sees half a binary.
    fd, partial = tempfile.mkstemp(prefix=".wire-", dir=folder)
    os.close(fd)
    command = [str(compiler()), "-O2", "-Wall", "-Wextra", "-o", partial, str(SOURCE)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT * 3, check=False
        )
        if done.returncode != 0:
            raise TestBedError(f"building the wire failed: {' '.join(command)}: {done.stderr}")
        os.replace(partial, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestBedError(f"building the wire failed: {' '.join(command)}: {exc}") from exc
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def queue_bytes(rate_mbit: float | None, impairment: LinkImpairment) -> int:
    """How many bytes may wait in one direction of the wire: what the link carries while a
    frame crosses it, twice over, so that the wire never drops what a router with a buffer of
    one bandwidth-delay product would carry."""
    rate = UNLIMITED_RATE_MBIT if rate_mbit is None else rate_mbit
    seconds = (impairment.delay_ms + impairment.jitter_ms) / 1000 + QUEUE_HEADROOM_S
    wanted = int(2 * rate * 1e6 / 8 * seconds)
    return max(MIN_QUEUE_BYTES, min(MAX_QUEUE_BYTES, wanted))


def wire_command(
    program: Path,
    host_end: tuple[str, str],
    far_end: tuple[str, str],
    impairment: LinkImpairment,
    *,
    rate_mbit: float | None = None,
    seed: int = 0,
) -> list[str]:
    """The argv of a wire that creates ``host_end`` and ``far_end`` (``(namespace, device)``)
    as TAP devices and joins them. It ends up in the host's namespace (its ``a`` end)."""
    return [
        str(program),
        "--a",
        f"{NETNS_DIR / host_end[0]}:{host_end[1]}",
        "--b",
        f"{NETNS_DIR / far_end[0]}:{far_end[1]}",
        "--delay-us",
        str(round(impairment.delay_ms * 1000)),
        "--jitter-us",
        str(round(impairment.jitter_ms * 1000)),
        "--loss",
        repr(float(impairment.loss)),
        "--seed",
        str(seed),
        "--queue-bytes",
        str(queue_bytes(rate_mbit, impairment)),
        # Super-frames only where nothing is dropped: a loss would take several segments.
        "--offload",
        "0" if impairment.loss > 0 else "1",
    ]


class Wire:
    """One running wire process; :meth:`close` stops it, which removes both devices."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.stderr = ""
        """What the wire wrote on stderr (its counters), once closed."""
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if self.proc.stdout is None:
            raise TestBedError("wire stdout is not a pipe")
        # The wire only sets up two devices before "ready" (no network wait): a readline
        # without a deadline ends at that line or at its exit.
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.close()
            raise TestBedError(f"{' '.join(command)}: the wire did not start: {self.stderr}")

    def close(self) -> None:
        """Stop the wire (SIGTERM, SIGKILL after a grace) and collect its counters. Idempotent."""
        if self.proc.returncode is None:
            if self.proc.poll() is None:
                self.proc.terminate()
            try:
                _, err = self.proc.communicate(timeout=COMMAND_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                _, err = self.proc.communicate(timeout=COMMAND_TIMEOUT)
            self.stderr = err or ""
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
