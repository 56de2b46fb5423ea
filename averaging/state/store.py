"""What a donor serves: its current state plus a bounded grace of superseded ones (pure logic).

Peers republish their state every few steps. A joiner that read the manifest of version v
and is still downloading its chunks would fail on every chunk that v+1 changed if the donor
dropped v at once, and with several donors republishing at different moments a large
state might never finish. So a superseded (retired) version stays servable for a grace:

- at most ``retain_versions`` retired versions are kept (the oldest goes first), and
- a retired version is dropped ``retain_seconds`` after it was retired or last asked
  for, whichever is later (a download in progress keeps its version alive, an abandoned
  one does not pin memory).

Whichever bound is hit first applies, so memory never exceeds ``retain_versions + 1``
states however often a peer publishes. Chunks are content-addressed and stored once with
a reference count: a chunk shared by several held versions costs its bytes once, and a
version whose tensors barely changed costs only the chunks that changed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from swarmavg.averaging.state.format import Manifest, PackedState


@dataclass
class _Held:
    manifest: Manifest
    hashes: frozenset[bytes]
    retired_at: float | None = None  # None while it is the current version
    last_used: float = -math.inf


class StateStore:
    """Content-addressed chunks of the current state and of its retained predecessors.

    Not thread-safe; the state sharer uses it from the event loop only. Every read prunes
    what the grace no longer covers, so an expired version is never served even if nobody
    called :meth:`prune` in between.
    """

    def __init__(
        self,
        retain_versions: int,
        retain_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            retain_versions: retired versions kept at most (0: drop at once).
            retain_seconds: grace of a retired version after its retirement or last use.
            clock: monotonic seconds (tests pass a fake one).

        Raises:
            ValueError: a negative or non-finite bound.
        """
        if retain_versions < 0 or not (math.isfinite(retain_seconds) and retain_seconds >= 0):
            raise ValueError("retain_versions and retain_seconds must be finite and >= 0")
        self.retain_versions = retain_versions
        self.retain_seconds = retain_seconds
        self.clock = clock
        self._versions: list[_Held] = []  # oldest first; the last one is current
        self._chunks: dict[bytes, bytes] = {}
        self._refs: dict[bytes, int] = {}
        self._bytes = 0

    @property
    def current(self) -> Manifest | None:
        """Manifest of the latest published state."""
        return self._versions[-1].manifest if self._versions else None

    @property
    def roots(self) -> list[bytes]:
        """Roots of every version held, oldest first (the last one is current)."""
        self.prune()
        return [v.manifest.root for v in self._versions]

    @property
    def held_bytes(self) -> int:
        """Bytes of distinct chunks held (each shared chunk counted once)."""
        return self._bytes

    @property
    def chunks(self) -> Mapping[bytes, bytes]:
        """Read-only view of every chunk held, by sha256."""
        return MappingProxyType(self._chunks)

    def publish(self, packed: PackedState) -> None:
        """Make ``packed`` current; the previous current version is retired now.

        Publishing a root already held (same content, new version) replaces that entry.
        """
        now = self.clock()
        root = packed.manifest.root
        for held in [v for v in self._versions if v.manifest.root == root]:
            self._drop(held)
        if self._versions and self._versions[-1].retired_at is None:
            self._versions[-1].retired_at = now
        hashes = frozenset(packed.manifest.chunk_hashes)
        for digest in hashes:
            count = self._refs.get(digest, 0)
            if count == 0:
                data = packed.chunks[digest]
                self._chunks[digest] = data
                self._bytes += len(data)
            self._refs[digest] = count + 1
        self._versions.append(_Held(packed.manifest, hashes, last_used=now))
        self.prune()

    def manifest(self, root: bytes) -> Manifest | None:
        """The manifest of ``root`` if held; counts as a use (extends a retired one's grace)."""
        held = self._find(root)
        return held.manifest if held is not None else None

    def touch(self, root: bytes) -> bool:
        """Record a use of ``root`` (a download asking for its chunks); ``False`` if not held."""
        return self._find(root) is not None

    def chunk(self, digest: bytes) -> bytes | None:
        """The chunk named ``digest`` if any held version contains it."""
        self.prune()
        return self._chunks.get(digest)

    def prune(self) -> None:
        """Drop the retired versions beyond either bound and the chunks only they used."""
        now = self.clock()
        retired = [v for v in self._versions if v.retired_at is not None]
        excess = len(retired) - self.retain_versions
        for held in retired:  # oldest first
            if excess > 0 or self._expiry(held) <= now:
                self._drop(held)
                excess -= 1

    def next_expiry(self) -> float | None:
        """Clock time at which the next retired version expires; ``None`` when none is held."""
        expiries = [self._expiry(v) for v in self._versions if v.retired_at is not None]
        return min(expiries, default=None)

    def clear(self) -> None:
        """Drop everything (the sharer stops serving)."""
        self._versions.clear()
        self._chunks.clear()
        self._refs.clear()
        self._bytes = 0

    def _expiry(self, held: _Held) -> float:
        if held.retired_at is None:  # the current version never expires
            return math.inf
        return max(held.retired_at, held.last_used) + self.retain_seconds

    def _find(self, root: bytes) -> _Held | None:
        self.prune()
        for held in self._versions:
            if held.manifest.root == root:
                held.last_used = self.clock()
                return held
        return None

    def _drop(self, held: _Held) -> None:
        self._versions.remove(held)
        for digest in held.hashes:
            count = self._refs[digest] - 1
            if count:
                self._refs[digest] = count
            else:
                del self._refs[digest]
                self._bytes -= len(self._chunks.pop(digest))
