"""Chunk size from the group's links: small chunks on slow links, large on fast.

A round streams each part as chunks, and the reducer returns a chunk once every sender
delivered it. So each stream's return direction idles until the first chunk is in, and its
forward direction idles while the last one is averaged and returned: a round pays about
one chunk's transfer time per stream at either end, on top of the bytes themselves. On a
100 Mbit/s link a 1 MiB chunk shared by three streams takes a quarter of a second to pass;
on loopback the same chunk passes in a millisecond, and the cost that matters there is the
CPU per message (headers, encoder and reducer calls, event-loop turns), which falls with
larger chunks. Hence the rule: a chunk carries :data:`CHUNK_SECONDS` of the slowest
member's link, rounded down to a power of two and kept within
[:data:`MIN_LINK_CHUNK_BYTES`, :data:`MAX_LINK_CHUNK_BYTES`]. The figures behind it are in
docs/benchmarks-data-path.md and docs/benchmarks-testbed.md ("Chunk size", "Chunks on slow
links"): on loopback
256 KiB chunks cost the most CPU and time, and on a quiet 100 Mbit/s test bed too, so the
rule errs large: 100 ms of the link per chunk.

Every member must cut the same chunks, so the rule reads only what the group description
gives every member alike: the bandwidths the members advertised in matchmaking (measured
by each peer from its rounds, :mod:`~swarmavg.averaging.allreduce.throughput`, or set by
its user). A member that under-claims makes chunks smaller (down to the floor: more CPU per
byte, nothing worse); over-claims cannot make them larger than the slowest honest claim.

The chunk's size in elements also depends on the codec: :func:`bytes_per_element` measures
it the same way on every member.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from swarmavg.averaging.allreduce.throughput import MB
from swarmavg.averaging.group import Member
from swarmavg.compression import Codec, CodecInfo

__all__ = [
    "CHUNK_SECONDS",
    "MAX_CHUNK_SECONDS",
    "MAX_LINK_CHUNK_BYTES",
    "MIN_LINK_CHUNK_BYTES",
    "bytes_per_element",
    "chunk_seconds",
    "link_chunk_bytes",
]

_PROBE_ELEMENTS = 65536

CHUNK_SECONDS = 0.1
"""Link time one chunk may take at the slowest member's advertised bandwidth: 512 KiB at
10 MB/s, 1 MiB at 11-20 MB/s (90-160 Mbit/s), the cap from about 21 MB/s up. A shorter
0.025 s (256 KiB at 100 Mbit/s) follows from the fill-and-drain argument alone; measured on a quiet
test bed (4 hosts at 100 Mbit/s, codec none, interleaved), 256 KiB chunks made 64 MB rounds
8-12% slower than 1 MiB ones with either congestion control: the fill and drain they save
(tenths of a second per round) costs less than the CPU of 4x the messages on a machine the
daemons share (docs/benchmarks-testbed.md, "Chunks on slow links")."""

MIN_LINK_CHUNK_BYTES = 256 * 1024
"""Floor, whatever a member claims: smaller chunks save at most a few tens of milliseconds
of fill and drain per round on any link, while the CPU per message keeps growing (a 4 MiB
part is already 16 messages)."""

MAX_LINK_CHUNK_BYTES = 2 * 1024 * 1024
"""Cap: of the sizes measured on loopback (256 KiB, 1 MiB, 2 MiB), 2 MiB cost the least CPU
with codec none and about as much as 1 MiB with uint8-blockwise; 3 MiB, the message limit,
is not a power of two."""


def link_chunk_bytes(members: Sequence[Member]) -> int:
    """The chunk target for a group of ``members``: :data:`CHUNK_SECONDS` of the slowest
    positive advertised bandwidth (MB/s), a power of two within the bounds above.

    Members advertising 0 (clients that reduce nothing) are left out; with no positive
    claim at all, the cap.
    """
    claims = [m.bandwidth for m in members if m.bandwidth > 0 and math.isfinite(m.bandwidth)]
    if not claims:
        return MAX_LINK_CHUNK_BYTES
    target = min(claims) * MB * CHUNK_SECONDS
    if target <= MIN_LINK_CHUNK_BYTES:
        return MIN_LINK_CHUNK_BYTES
    power = 1 << int(math.log2(target))  # round down: a slow link's chunk errs small
    return min(max(power, MIN_LINK_CHUNK_BYTES), MAX_LINK_CHUNK_BYTES)


MAX_CHUNK_SECONDS = 15.0
"""Cap of :func:`chunk_seconds`: every member's claim reaches it, so a member that
under-claims could otherwise stretch the round's patience for a silent sender without
bound; 15 s is a 256 KiB chunk at 0.8 Mbit/s in a group of four."""


def chunk_seconds(members: Sequence[Member], chunk_bytes: int | None = None) -> float:
    """Seconds a chunk of ``chunk_bytes`` (None: :func:`link_chunk_bytes`'s) takes to cross
    the slowest advertised link at one stream's share of it: in a round every member's link
    carries a stream to and from each other member at once, 2 (N - 1) in all. 0.0 without
    a positive claim or a second member.

    What the round's patience for a first chunk and a first average must allow beyond its
    fixed floors (``min_stall``): a 256 KiB chunk at a 2 Mbit/s link's share in a group of
    four is about 6 s, at a 20 Mbit/s link's in a group of sixteen about 3 s.
    """
    claims = [m.bandwidth for m in members if m.bandwidth > 0 and math.isfinite(m.bandwidth)]
    if not claims or len(members) < 2:
        return 0.0
    chunk_bytes = chunk_bytes or link_chunk_bytes(members)
    return min(chunk_bytes * 2 * (len(members) - 1) / (min(claims) * MB), MAX_CHUNK_SECONDS)


def bytes_per_element(codec: Codec, dtype: np.dtype) -> float:
    """Encoded bytes per element of ``codec`` on a fixed pseudo-random probe.

    Deterministic (same codec code -> same answer), so every member derives the same
    chunk size without negotiating it.
    """
    probe = np.random.default_rng(0).standard_normal(_PROBE_ELEMENTS).astype(dtype)
    message = codec.encode(probe, CodecInfo(key="swarmavg.chunk-size-probe"))
    return max(message.ByteSize(), 1) / _PROBE_ELEMENTS
