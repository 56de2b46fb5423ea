"""Shared-memory segments for tensors between a client and its daemon (docs/peer.md).

A segment is a file in ``/dev/shm`` named ``swarmavg-<client pid>-<random>``. The client
creates it (mode 600, ``O_EXCL``), copies its inputs in and sends the name. The daemon
checks the name, owner and size, maps the file and **unlinks it at once**: from then on the
memory lives only as long as one of the two mappings, so a client killed at any later
point leaves no file behind. The daemon writes the results in place and the client reads
them from its own mapping. For the short window before the daemon has mapped the segment
the client unlinks it itself when the call fails, and the daemon sweeps files whose
creator process is gone (:func:`sweep_stale`).

**Reuse.** Faulting in fresh tmpfs pages costs more than copying the tensors, and a
training loop averages the same layout every step. So both sides keep their mapping after
a call: the client reuses an idle segment of the same size for a later call (one that no
earlier result still points into; it keeps two, so a caller holding the previous result
alternates between them) and tells the daemon, which reuses its own mapping
(:class:`DaemonSegmentCache`). The daemon drops mappings whose client process has exited.

**Loaded states.** For ``load_state`` the client offers an empty segment
(:class:`LoadOffer`) with its request; the daemon sizes it and writes the state's tensors in
(:func:`fill_offer`) instead of streaming their bytes, and the client maps it and unlinks it.
So here too the client creates every segment, and the same sweep covers a client that dies.
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
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from swarmavg.peer.client.errors import ValidationError
from swarmavg.peer.client.handoff import copy_checked

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "swarmavg-"
ALIGN = 64
NAME_RE = re.compile(r"^swarmavg-(\d{1,10})-([0-9a-f]{32})$")
NOT_MAPPED = "is not mapped here"
"""In the daemon's refusal of a reused segment it no longer maps (it restarted or evicted
it): the client's cue to send a fresh one."""


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
    offsets, size = segment_layout(dtypes, shapes)
    if size != len(buffer):
        raise ValidationError(f"layout of {size} bytes does not fit a segment of {len(buffer)}")
    return [
        np.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
        for dtype, shape, offset in zip(dtypes, shapes, offsets, strict=True)
    ]


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def pid_of(name: str) -> int | None:
    """The creating process of segment ``name``, or ``None`` for a foreign name."""
    match = NAME_RE.match(name)
    return int(match.group(1)) if match else None


def _new_file(directory: Path) -> tuple[str, Path, int]:
    """A fresh segment file of this process: its name (``swarmavg-<pid>-<random>``, which
    :func:`sweep_stale` reads the creator from), path and a read-write descriptor. Mode
    600, and never a file that was there before."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
    path = directory / name
    return name, path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


def _open_segment(directory: Path, name: str, flags: int) -> int:
    """The daemon's side: open a client's segment ``name`` (never through a link).

    Raises:
        ValidationError: ``name`` is not a segment's, or the file is missing or cannot be
            opened.
    """
    if NAME_RE.match(name) is None:
        raise ValidationError(f"bad shared-memory segment name {name!r}")
    try:
        return os.open(directory / name, flags | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ValidationError(f"shared-memory segment {name} does not exist") from None
    except OSError as exc:
        raise ValidationError(f"cannot open shared-memory segment {name}: {exc}") from None


def _own_regular_file(name: str, fd: int) -> os.stat_result:
    """The status of the open segment ``name``.

    Raises:
        ValidationError: it is not a regular file owned by this user.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        raise ValidationError(f"segment {name} is not a regular file owned by this user")
    return info


class ClientSegment:
    """The client's side: a segment of ``size`` bytes, mapped until garbage-collected."""

    def __init__(self, size: int, directory: Path = SHM_DIR) -> None:
        """Create and map the file, its pages taken at once.

        Raises:
            OSError: the file cannot be made, e.g. ``ENOSPC`` when ``directory`` has no
                room for ``size`` bytes (see :func:`segment_or_inline`).
        """
        self.size = size
        self.name, self.path, fd = _new_file(directory)
        self.daemon_mapped = False
        """The daemon mapped (and unlinked) this segment in an earlier call."""
        try:
            os.ftruncate(fd, size)
            # tmpfs grants a file any size, and a write past the room it has kills the
            # writer with SIGBUS (a container's /dev/shm is 64 MB unless it is given more):
            # taking the pages now fails with ENOSPC instead, and the call goes inline.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)

    @classmethod
    def holding(cls, arrays: Sequence[np.ndarray], directory: Path = SHM_DIR) -> ClientSegment:
        """A fresh segment holding copies of ``arrays``."""
        _, size = segment_layout([a.dtype for a in arrays], [a.shape for a in arrays])
        segment = cls(size, directory)
        try:
            segment.fill(arrays)
        except BaseException:
            segment.unlink()
            raise
        return segment

    def fill(self, arrays: Sequence[np.ndarray]) -> None:
        """Copy ``arrays`` in (their layout must have this segment's size), checking them
        for NaN/Inf block by block as they are copied.

        Raises:
            InvalidTensorsError: a tensor holds NaN or Inf (the segment is then unusable).
        """
        views = _views(self._map, [a.dtype for a in arrays], [a.shape for a in arrays])
        copy_checked(arrays, views)

    def in_use(self) -> bool:
        """Whether arrays returned by :meth:`results` still point into the mapping.

        Every such array holds a reference to the mmap object (CPython reference counts:
        the attribute plus ``getrefcount``'s own argument make 2).
        """
        return sys.getrefcount(self._map) > 2

    def unlink(self) -> None:
        """Remove the file if it is still there (idempotent; the daemon usually did it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def results(
        self, dtypes: Sequence[np.dtype[np.generic]], shapes: Sequence[tuple[int, ...]]
    ) -> list[np.ndarray]:
        """Arrays over the segment (the daemon's results once it answered Done).

        The arrays keep the mapping alive; while any exists the segment is not reused.
        """
        return _views(self._map, dtypes, shapes)


def segment_or_inline(
    segments: SegmentPool, arrays: Sequence[np.ndarray], fill: bool = True
) -> ClientSegment | None:
    """:meth:`SegmentPool.acquire`, or ``None`` when the shared-memory folder has no room
    for the tensors: the call then sends them through the socket, and a warning says how
    to give it room (once per process).

    Raises:
        InvalidTensorsError: a tensor holds NaN or Inf (checked while copying).
    """
    try:
        return segments.acquire(arrays, fill=fill)
    except OSError as exc:
        _NoRoom.warn(segments.directory, sum(a.nbytes for a in arrays), exc)
        return None


class _NoRoom:
    """The warning of a shared-memory folder without room, given once per process."""

    warned = False

    @classmethod
    def warn(cls, directory: Path, size: int, exc: OSError) -> None:
        if cls.warned:
            return
        cls.warned = True
        log.warning(
            "no room for %.1f MB in %s (%s): tensors go through the control socket instead "
            "(slower); in a container, give it more shared memory (docker run --shm-size=2g)",
            size / 1e6,
            directory,
            exc.strerror or exc,
        )


class SegmentPool:
    """Reusable segments of one client (thread-safe).

    Keeps up to ``keep`` idle segments, not one: a training loop usually still holds the
    previous call's result (``res = client.average(...)`` is rebound only after the next
    call returns), and that result points into the previous segment. With a single idle
    segment every such call would create, fault in and hand over a fresh one (about 60 ms
    for 64 MB, twice: the client fills it and the daemon maps it); with two, calls
    alternate between them. A caller gets a fresh segment only when every idle one is of
    another size or still referenced by results.
    """

    def __init__(self, directory: Path = SHM_DIR, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = directory
        self._keep = keep
        self._lock = threading.Lock()
        self._idle: list[ClientSegment] = []  # oldest first

    def acquire(self, arrays: Sequence[np.ndarray], fill: bool = True) -> ClientSegment:
        """A segment holding copies of ``arrays``: an idle one when it fits, else a fresh one.
        With ``fill=False``, a segment of their layout's size left for the caller to
        :meth:`~ClientSegment.fill`.

        Raises:
            InvalidTensorsError: a tensor holds NaN or Inf (checked while copying).
        """
        _, size = segment_layout([a.dtype for a in arrays], [a.shape for a in arrays])
        segment: ClientSegment | None = None
        with self._lock:
            for index, idle in enumerate(self._idle):
                if idle.size == size and not idle.in_use():
                    segment = self._idle.pop(index)
                    break
        if segment is None:
            if fill:
                return ClientSegment.holding(arrays, self.directory)
            segment = ClientSegment(size, self.directory)
        if fill:
            segment.fill(arrays)
        return segment

    def release(self, segment: ClientSegment, ok: bool) -> None:
        """Return ``segment`` after a call; a failed call's segment is dropped.

        Only segments the daemon has mapped are kept (the daemon maps each segment once
        and reuses its mapping); beyond ``keep`` idle ones the oldest is dropped.
        """
        segment.unlink()
        with self._lock:
            self._idle = [s for s in self._idle if s is not segment]
            if ok and segment.daemon_mapped:
                self._idle.append(segment)
                del self._idle[: max(len(self._idle) - self._keep, 0)]

    def clear(self) -> None:
        """Forget every idle segment (the daemon lost its mappings: it restarted or evicted
        them), so that the next call hands over a fresh one."""
        with self._lock:
            self._idle.clear()

    def __len__(self) -> int:
        """How many idle segments the pool keeps now."""
        with self._lock:
            return len(self._idle)


class LoadOffer:
    """An empty segment file a client offers to its daemon for a loaded state
    (``load_state``): the daemon sizes it and writes the tensors in (:func:`fill_offer`),
    the client maps it and unlinks it when the call ends. The client creates it, so a
    client killed mid-call leaves a file that :func:`sweep_stale` removes, as for
    ``average``'s segments."""

    def __init__(self, directory: Path = SHM_DIR) -> None:
        """Create the empty file.

        Raises:
            OSError: it cannot be made (no shared-memory folder; the call goes inline).
        """
        self.name, self.path, fd = _new_file(directory)
        os.close(fd)

    def arrays(
        self,
        size: int,
        dtypes: Sequence[np.dtype[np.generic]],
        shapes: Sequence[tuple[int, ...]],
    ) -> list[np.ndarray]:
        """The tensors the daemon wrote, as views of a private (copy-on-write) mapping:
        writable, and nothing written to them reaches the file. They keep the memory alive
        after :meth:`unlink`.

        Raises:
            ValidationError: the file does not hold ``size`` bytes of this layout.
        """
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            held = os.fstat(fd).st_size
            if held != size:
                raise ValidationError(f"the loaded state's segment holds {held} bytes, not {size}")
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        return _views(mapping, dtypes, shapes)

    def unlink(self) -> None:
        """Remove the file (idempotent)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @classmethod
    def or_none(cls, use_shm: bool, directory: Path = SHM_DIR) -> LoadOffer | None:
        """An offer when the client uses shared memory and can make one, else ``None``."""
        if not use_shm:
            return None
        try:
            return cls(directory)
        except OSError as exc:
            log.info("no shared-memory segment for the loaded state (%s): it comes inline", exc)
            return None


def fill_offer(name: str, arrays: Sequence[np.ndarray], directory: Path = SHM_DIR) -> int:
    """The daemon's side of a :class:`LoadOffer`: size the client's empty segment ``name``
    for ``arrays``, write them in, and return its size. The file is the client's to unlink.

    Written with ``pwrite``, not through a mapping: one copy, no page faults, and a full
    shared-memory folder fails the write with ``ENOSPC`` where a mapping's store would
    kill the daemon with SIGBUS.

    Raises:
        ValidationError: a bad name, or a file that is missing, cannot be opened (a link),
            is not a regular file owned by this user, or is not empty (not an offer).
        OSError: no room for the tensors (``ENOSPC``): the caller sends them inline.
    """
    offsets, size = segment_layout([a.dtype for a in arrays], [a.shape for a in arrays])
    fd = _open_segment(directory, name, os.O_WRONLY)
    try:
        info = _own_regular_file(name, fd)
        if info.st_size != 0:
            raise ValidationError(f"segment {name} is not an empty offer ({info.st_size} bytes)")
        os.ftruncate(fd, size)  # the gaps of the alignment read as zeros
        for offset, array in zip(offsets, arrays, strict=True):
            _write_at(fd, np.ascontiguousarray(array).reshape(-1).view(np.uint8), offset)
    finally:
        os.close(fd)
    return size


def _write_at(fd: int, data: np.ndarray, offset: int) -> None:
    """All of ``data``'s bytes at ``offset`` (``pwrite`` may write fewer than asked)."""
    view = data.data
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class DaemonSegment:
    """The daemon's side: a client segment, checked, mapped and already unlinked."""

    def __init__(self, name: str, size: int, directory: Path = SHM_DIR) -> None:
        """Map segment ``name`` of ``size`` bytes.

        Raises:
            ValidationError: a bad name, or a file that is missing, not a regular file
                owned by this user, or of another size.
        """
        self.name = name
        self.size = size
        path = directory / name
        fd = _open_segment(directory, name, os.O_RDWR)
        try:
            info = _own_regular_file(name, fd)
            if info.st_size != size:
                raise ValidationError(f"segment {name} holds {info.st_size} bytes, not {size}")
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            # Unlinking right after mapping ties the memory to the two mappings alone.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def inputs(
        self, dtypes: Sequence[np.dtype[np.generic]], shapes: Sequence[tuple[int, ...]]
    ) -> list[np.ndarray]:
        """Read-write views of the client's inputs in this layout."""
        if self._map is None:
            raise ValidationError(f"segment {self.name} was released")
        return _views(self._map, dtypes, shapes)

    def write_results(self, arrays: Sequence[np.ndarray]) -> None:
        """Copy the results over the inputs (same dtypes and shapes)."""
        views = self.inputs([a.dtype for a in arrays], [a.shape for a in arrays])
        for view, array in zip(views, arrays, strict=True):
            # The round usually wrote its result here already (run_allreduce's `out`).
            if _address(view) != _address(array):
                view[...] = array

    def close(self) -> None:
        """Drop the daemon's mapping (idempotent). Views still alive keep it until freed."""
        mapping, self._map = self._map, None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()


class DaemonSegmentCache:
    """The daemon's mappings of client segments, kept for reuse across calls.

    Bounded: at most ``per_client`` segments per client process and ``max_bytes`` in all
    (the oldest go first; a client whose segment was dropped gets an error and retries
    with a fresh one). :meth:`sweep` drops the segments of processes that have exited.
    """

    def __init__(self, max_bytes: int = 16 << 30, per_client: int = 4) -> None:
        self.max_bytes = max_bytes
        self.per_client = per_client
        self._segments: dict[str, DaemonSegment] = {}  # insertion order = age

    def open(self, name: str, size: int, reuse: bool) -> DaemonSegment:
        """The mapping of segment ``name``: the cached one when ``reuse``, else freshly
        mapped (and unlinked) from /dev/shm.

        Raises:
            ValidationError: ``reuse`` of a segment that is not cached (or has another
                size), or any reason :class:`DaemonSegment` refuses the file.
        """
        if reuse:
            segment = self._segments.get(name)
            if segment is None or segment.size != size:
                raise ValidationError(f"shared-memory segment {name} {NOT_MAPPED}")
            self._segments[name] = self._segments.pop(name)  # most recently used
            return segment
        segment = DaemonSegment(name, size)
        self._segments.pop(name, None)
        self._segments[name] = segment
        self._evict(pid_of(name))
        return segment

    def drop(self, name: str) -> None:
        segment = self._segments.pop(name, None)
        if segment is not None:
            segment.close()

    def _evict(self, pid: int | None) -> None:
        same = [n for n in self._segments if pid_of(n) == pid]
        for name in same[: max(len(same) - self.per_client, 0)]:
            self.drop(name)
        while sum(s.size for s in self._segments.values()) > self.max_bytes:
            self.drop(next(iter(self._segments)))

    def sweep(self) -> int:
        """Drop the mappings of client processes that have exited; return how many."""
        dead = [n for n in self._segments if not _pid_alive(pid_of(n) or 0)]
        for name in dead:
            self.drop(name)
        return len(dead)

    def close(self) -> None:
        for name in list(self._segments):
            self.drop(name)

    def __len__(self) -> int:
        return len(self._segments)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped by its parent) holds no mappings any more.
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def unlink_if_orphaned(name: str, directory: Path = SHM_DIR) -> bool:
    """Unlink segment ``name`` if the process that created it has exited."""
    pid = pid_of(name)
    if pid is None or _pid_alive(pid):
        return False
    with contextlib.suppress(FileNotFoundError, PermissionError):
        os.unlink(directory / name)
        return True
    return False


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
