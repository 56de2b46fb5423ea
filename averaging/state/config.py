"""Settings of state sharing, and its fault seam for tests."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarmavg.averaging.state.format import DEFAULT_CHUNK_SIZE

MAX_CHUNKS_PER_REQUEST = 1024


@dataclass(frozen=True)
class StateSharingConfig:
    """Settings of state sharing.

    Attributes:
        chunk_size: bytes per chunk when publishing.
        ttl: lifetime of the DHT advertisement; it is refreshed every ``ttl / 3``.
        batch_chunks: chunks asked from one donor per request.
        message_timeout: deadline for each message of a download stream, on both sides:
            a donor cuts a joiner whose next message it cannot write in this long.
        upload_timeout: a donor cuts a download stream that lasts longer than this (a
            request asks for at most ``MAX_CHUNKS_PER_REQUEST`` chunks; a joiner asks for
            ``batch_chunks`` at a time, 8 MiB by default, which takes 4 s at 16 Mbit/s).
        max_state_bytes: largest state a joiner accepts (checked on the manifest).
        max_uploads: concurrent downloads served; more get ``STATE_BUSY``.
        keep_loaded_chunks: keep the chunks of the last loaded state in memory, so that the
            next load fetches only the chunks that changed (costs one copy of the state).
        retain_versions: superseded versions a donor keeps serving after it publishes a
            new one, so that downloads in progress can finish (0: drop at once). A donor
            holds at most ``retain_versions + 1`` states, shared chunks counted once.
        retain_seconds: a superseded version is dropped this long after it was superseded
            or last asked for, whichever is later (and earlier when ``retain_versions``
            newer ones were superseded after it).
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    ttl: float = 60.0
    batch_chunks: int = 8
    message_timeout: float = 10.0
    upload_timeout: float = 60.0
    max_state_bytes: int = 16 << 30
    max_uploads: int = 8
    keep_loaded_chunks: bool = True
    retain_versions: int = 2
    retain_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not (self.ttl > 0 and self.message_timeout > 0 and self.upload_timeout > 0):
            raise ValueError("ttl, message_timeout and upload_timeout must be positive")
        if self.retain_versions < 0 or not (
            math.isfinite(self.retain_seconds) and self.retain_seconds >= 0
        ):
            raise ValueError("retain_versions and retain_seconds must be finite and >= 0")
        if not 0 < self.batch_chunks <= MAX_CHUNKS_PER_REQUEST:
            raise ValueError(f"batch_chunks must be in 1..{MAX_CHUNKS_PER_REQUEST}")
        if self.max_uploads < 1 or self.max_state_bytes < 1:
            raise ValueError("max_uploads and max_state_bytes must be >= 1")


@dataclass(frozen=True)
class DonorFaults:
    """Fault plan for the serving side (tests and benchmarks; production passes ``None``).

    Attributes:
        fail_after_chunks: abort every download stream after this many chunks served in
            total by this donor (a donor dying mid-download).
        corrupt_chunks: flip a byte in every chunk served (a corrupting donor).
        before_chunk: awaited before each requested chunk is looked up, with the number of
            chunks this donor served so far; a test blocks or republishes in it to act at
            an exact point of a download.
    """

    fail_after_chunks: int | None = None
    corrupt_chunks: bool = False
    before_chunk: Callable[[int], Awaitable[None]] | None = None
