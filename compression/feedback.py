"""Error-feedback state for sparsifying codecs: what was not sent, kept for next round.

Top-k sends a small fraction of each tensor. Error feedback (Seide et al. 2014; Stich
et al. 2018, "Sparsified SGD with Memory") adds the untransmitted remainder (the
residual) to the next round's input, so every coordinate is eventually sent and the
sum of what was transmitted tracks the sum of the inputs.

The state is an explicit object (like PyTorch's ``PowerSGDState``): the caller owns it,
can inspect it, checkpoint it (``to_bytes``/``from_bytes``, msgpack, no pickle) and
bound its memory. Residuals are float32, keyed by ``(CodecInfo.key, part_index)``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import msgpack
import numpy as np

from swarmavg.compression.errors import CodecError

__all__ = ["ErrorFeedback", "FeedbackKey"]

FeedbackKey = tuple[str, int]

_STATE_VERSION = 1


class ErrorFeedback:
    """Residuals per tensor key with bounded memory, thread-safe.

    Memory: at most ``max_bytes`` of residuals. When adding one would exceed it, the
    least recently used residuals are dropped (their untransmitted mass is lost, which
    is counted in ``evicted``); a single residual larger than ``max_bytes`` is not kept.

    Concurrency: every method is atomic. ``take`` removes the residual it returns, so two
    concurrent encodes of the same key cannot both apply it; the averager encodes each
    ``(key, part)`` once per round anyway.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        """Args:
        max_bytes: bound on the residuals kept (default 1 GiB, a 256M-parameter model).
        """
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.evicted = 0
        """Number of residuals dropped to respect ``max_bytes`` or because their size changed."""
        self._residuals: OrderedDict[FeedbackKey, np.ndarray] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of residuals held now."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._residuals)

    def entries(self) -> list[FeedbackKey]:
        """The keys that hold a residual, least recently used first."""
        with self._lock:
            return list(self._residuals)

    def peek(self, key: FeedbackKey) -> np.ndarray | None:
        """A copy of the residual for ``key``, or None."""
        with self._lock:
            r = self._residuals.get(key)
            return None if r is None else r.copy()

    def take(self, key: FeedbackKey, size: int) -> np.ndarray | None:
        """Remove and return the residual for ``key`` if it has ``size`` elements.

        A residual of another size (the partition changed) is discarded and counted in
        ``evicted``: adding it to a different slice of the model would be wrong.
        """
        with self._lock:
            r = self._residuals.pop(key, None)
            if r is None:
                return None
            self._nbytes -= r.nbytes
            if r.size != size:
                self.evicted += 1
                return None
            return r

    def put(self, key: FeedbackKey, residual: np.ndarray) -> None:
        """Store ``residual`` (float32, flat; kept without copying) as the most recent."""
        if residual.dtype != np.float32 or residual.ndim != 1:
            raise ValueError("a residual is a flat float32 array")
        with self._lock:
            old = self._residuals.pop(key, None)
            if old is not None:
                self._nbytes -= old.nbytes
            if residual.nbytes > self.max_bytes:
                self.evicted += 1
                return
            while self._residuals and self._nbytes + residual.nbytes > self.max_bytes:
                _, dropped = self._residuals.popitem(last=False)
                self._nbytes -= dropped.nbytes
                self.evicted += 1
            self._residuals[key] = residual
            self._nbytes += residual.nbytes

    def reset(self, key: str | None = None) -> None:
        """Forget every residual, or those of one tensor key (all its parts)."""
        with self._lock:
            for k in [k for k in self._residuals if key is None or k[0] == key]:
                self._nbytes -= self._residuals.pop(k).nbytes

    def state_dict(self) -> dict[str, Any]:
        """A msgpack-serialisable snapshot (copies the residuals)."""
        with self._lock:
            entries = [
                [key, part, r.astype("<f4").tobytes()] for (key, part), r in self._residuals.items()
            ]
        return {"version": _STATE_VERSION, "max_bytes": self.max_bytes, "entries": entries}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the residuals with a snapshot from :meth:`state_dict`.

        Raises:
            CodecError: malformed snapshot, or one exceeding ``max_bytes``.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise CodecError("not an error-feedback snapshot of a known version")
        entries = state.get("entries")
        if not isinstance(entries, list):
            raise CodecError("error-feedback snapshot has no entry list")
        loaded: OrderedDict[FeedbackKey, np.ndarray] = OrderedDict()
        total = 0
        for entry in entries:
            if (
                not isinstance(entry, (list, tuple))
                or len(entry) != 3
                or not isinstance(entry[0], str)
                or not isinstance(entry[1], int)
                or not isinstance(entry[2], bytes)
                or len(entry[2]) % 4
            ):
                raise CodecError("malformed error-feedback entry")
            total += len(entry[2])
            if total > self.max_bytes:
                raise CodecError(f"error-feedback snapshot exceeds max_bytes={self.max_bytes}")
            r = np.frombuffer(entry[2], dtype="<f4").astype(np.float32)
            if not np.isfinite(r).all():
                raise CodecError("error-feedback snapshot holds NaN or Inf")
            loaded[(entry[0], entry[1])] = r
        with self._lock:
            self._residuals = loaded
            self._nbytes = total

    def to_bytes(self) -> bytes:
        """The snapshot as msgpack bytes (for a checkpoint file)."""
        return bytes(msgpack.packb(self.state_dict(), use_bin_type=True))

    @classmethod
    def from_bytes(cls, data: bytes, max_bytes: int | None = None) -> ErrorFeedback:
        """Rebuild from :meth:`to_bytes` output.

        Raises:
            CodecError: malformed data.
        """
        try:
            state = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types for bad input
            raise CodecError(f"error-feedback snapshot is not valid msgpack: {e}") from None
        if not isinstance(state, dict):
            raise CodecError("error-feedback snapshot is not a map")
        limit = max_bytes if max_bytes is not None else state.get("max_bytes", 1 << 30)
        if not isinstance(limit, int) or limit < 0:
            raise CodecError("error-feedback snapshot has a bad max_bytes")
        fb = cls(limit)
        fb.load_state_dict(state)
        return fb
