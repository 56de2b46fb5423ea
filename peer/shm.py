"""Shared-memory segments for tensors between a client and its daemon (DESIGN 6.4).

A segment is a file in ``/dev/shm`` named ``swarmavg-<client pid>-<random>``. The client
creates it (mode 600, ``O_EXCL``), copies its inputs in and sends the name. The daemon
checks the name, owner and size, maps the file and **unlinks it at once**: from then on the
memory lives only as long as one of the two mappings, so a client killed at any later
point leaks nothing. The daemon writes the results in place and the client reads them
from its own mapping. For the short window before the daemon has mapped the segment the
client unlinks it itself when the call fails, and the daemon sweeps files whose creator
process is gone (:func:`sweep_stale`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from swarmavg.peer.errors import ValidationError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "swarmavg-"
ALIGN = 64
NAME_RE = re.compile(r"^swarmavg-(\d{1,10})-([0-9a-f]{32})$")


def shm_available(directory: Path = SHM_DIR) -> bool:
    """Whether ``directory`` exists and this process can create files in it."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


def segment_layout(
    dtypes: Sequence[np.dtype[np.generic]], shapes: Sequence[tuple[int, ...]]
) -> tuple[list[int], int]:
    """Byte offset of each tensor (64-byte aligned) and the segment's total size."""
    offsets: list[int] = []
    cursor = 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        cursor = -(-cursor // ALIGN) * ALIGN
        offsets.append(cursor)
        cursor += math.prod(shape) * np.dtype(dtype).itemsize
    return offsets, max(cursor, 1)


def _views(
    buffer: mmap.mmap,
    dtypes: Sequence[np.dtype[np.generic]],
    shapes: Sequence[tuple[int, ...]],
) -> list[np.ndarray]:
    offsets, _ = segment_layout(dtypes, shapes)
    return [
        np.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
        for dtype, shape, offset in zip(dtypes, shapes, offsets, strict=True)
    ]


class ClientSegment:
    """The client's side: a fresh segment holding copies of the inputs."""

    def __init__(self, arrays: Sequence[np.ndarray], directory: Path = SHM_DIR) -> None:
        self.dtypes = [a.dtype for a in arrays]
        self.shapes = [tuple(a.shape) for a in arrays]
        _, self.size = segment_layout(self.dtypes, self.shapes)
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        self.path = directory / self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        try:
            for view, array in zip(
                _views(self._map, self.dtypes, self.shapes), arrays, strict=True
            ):
                view[...] = array
        except BaseException:
            self.unlink()
            raise

    def unlink(self) -> None:
        """Remove the file if it is still there (idempotent; the daemon usually did it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def results(self) -> list[np.ndarray]:
        """Arrays over the segment (the daemon's results once it answered Done).

        The returned arrays keep the mapping alive; it is released when they are freed.
        """
        return _views(self._map, self.dtypes, self.shapes)


class DaemonSegment:
    """The daemon's side: a client segment, checked, mapped and already unlinked."""

    def __init__(
        self,
        name: str,
        size: int,
        dtypes: Sequence[np.dtype[np.generic]],
        shapes: Sequence[tuple[int, ...]],
        directory: Path = SHM_DIR,
    ) -> None:
        """Map segment ``name``.

        Raises:
            ValidationError: a bad name, a size that does not match the layout, a file
                that is not a regular file owned by this user, or one that is missing.
        """
        if NAME_RE.match(name) is None:
            raise ValidationError(f"bad shared-memory segment name {name!r}")
        _, expected = segment_layout(dtypes, shapes)
        if size != expected:
            raise ValidationError(f"segment size {size} does not match the layout ({expected})")
        path = directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ValidationError(f"shared-memory segment {name} does not exist") from None
        except OSError as exc:
            raise ValidationError(f"cannot open shared-memory segment {name}: {exc}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise ValidationError(f"segment {name} is not a regular file owned by this user")
            if info.st_size != size:
                raise ValidationError(f"segment {name} holds {info.st_size} bytes, not {size}")
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            # Unlinking right after mapping ties the memory to the two mappings alone.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.dtypes = list(dtypes)
        self.shapes = list(shapes)

    def inputs(self) -> list[np.ndarray]:
        """Read-write views of the client's inputs (valid until :meth:`close`)."""
        if self._map is None:
            raise ValueError("segment closed")
        return _views(self._map, self.dtypes, self.shapes)

    def write_results(self, arrays: Sequence[np.ndarray]) -> None:
        """Copy the results over the inputs (same dtypes and shapes)."""
        for view, array in zip(self.inputs(), arrays, strict=True):
            if view.shape != array.shape:
                raise ValueError(f"result shape {array.shape} != input shape {view.shape}")
            view[...] = array

    def close(self) -> None:
        """Drop the daemon's mapping (idempotent). Views still alive keep it until freed."""
        mapping, self._map = self._map, None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: Path = SHM_DIR) -> int:
    """Unlink segments whose creating process has exited; return how many were removed."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        match = NAME_RE.match(entry.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(entry.path)
            removed += 1
            log.info("removed stale shared-memory segment %s", entry.name)
    return removed
