"""Published state as content-addressed chunks: layout, manifest and root hash (pure logic).

A state is ``(metadata: bytes, tensors: list[np.ndarray])``. It is cut into chunks of at
most ``chunk_size`` bytes: first a msgpack header (metadata and every tensor's dtype and
shape), then each tensor's raw little-endian bytes, chunked on its own. Chunks never span
two tensors, so changing one tensor (or only the metadata) changes only its own chunks, and
a peer holding an older version downloads just those (hivemind re-sends the whole state).

Each chunk is named by its sha256. The manifest lists the chunk hashes and sizes; its root
(sha256 over chunk size, header chunk count, hashes and sizes) names the whole state, so a
joiner that trusts the root from the DHT can verify the manifest and then every chunk.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from swarmavg.compression.dtypes import BFLOAT16_NAME, bfloat16
from swarmavg.proto import averaging_pb2

FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = 1 << 20
MAX_CHUNK_SIZE = 2 << 20  # stays under gRPC's 4 MiB message cap with room for framing
MAX_CHUNKS = 1 << 16
MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 100_000
MAX_NDIM = 32
"""Most dimensions a tensor of a state may have (what the client accepts too)."""
HASH_BYTES = 32

_PLAIN_DTYPES: dict[str, np.dtype[np.generic]] = {
    np.dtype(t).name: np.dtype(t)
    for t in [
        np.float16,
        np.float32,
        np.float64,
        np.int8,
        np.uint8,
        np.int16,
        np.int32,
        np.int64,
        np.bool_,
    ]
}
SUPPORTED_DTYPES: frozenset[str] = frozenset([*_PLAIN_DTYPES, BFLOAT16_NAME])
"""The dtype names a state header may carry (numpy's names)."""


def _dtype_named(name: str) -> np.dtype[np.generic]:
    """The dtype of a supported name; bfloat16 imports ml_dtypes only when a state has it."""
    return bfloat16() if name == BFLOAT16_NAME else _PLAIN_DTYPES[name]


class StateFormatError(ValueError):
    """A manifest, header or chunk does not describe a valid state."""


def chunk_hash(data: bytes | memoryview) -> bytes:
    """Content address of one chunk."""
    return hashlib.sha256(data).digest()


def compute_root(
    chunk_size: int, header_chunks: int, hashes: Sequence[bytes], sizes: Sequence[int]
) -> bytes:
    """The root hash naming a state (independent of its version and publisher)."""
    h = hashlib.sha256(b"swarmavg.state.v1")
    h.update(struct.pack("<IIQ", chunk_size, header_chunks, len(hashes)))
    for digest, size in zip(hashes, sizes, strict=True):
        h.update(digest)
        h.update(struct.pack("<Q", size))
    return h.digest()


@dataclass(frozen=True)
class Manifest:
    """Table of contents of one state. ``root`` names it; ``version`` orders publications."""

    root: bytes
    version: float
    chunk_size: int
    header_chunks: int
    chunk_hashes: tuple[bytes, ...]
    chunk_sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.chunk_sizes)

    def to_proto(self) -> averaging_pb2.StateManifest:
        return averaging_pb2.StateManifest(
            root=self.root,
            version=self.version,
            chunk_size=self.chunk_size,
            header_chunks=self.header_chunks,
            chunk_hashes=list(self.chunk_hashes),
            chunk_sizes=list(self.chunk_sizes),
        )

    @classmethod
    def from_proto(
        cls, message: averaging_pb2.StateManifest, expected_root: bytes, max_total_bytes: int
    ) -> Manifest:
        """Parse a donor's manifest and check it against the root taken from the DHT.

        Raises:
            StateFormatError: malformed, over the limits, or not matching ``expected_root``.
        """
        hashes = tuple(bytes(h) for h in message.chunk_hashes)
        sizes = tuple(int(s) for s in message.chunk_sizes)
        if not 0 < message.chunk_size <= MAX_CHUNK_SIZE:
            raise StateFormatError(f"chunk size {message.chunk_size} out of range")
        if len(hashes) != len(sizes) or len(hashes) > MAX_CHUNKS:
            raise StateFormatError("chunk hash and size lists differ in length or are too long")
        if not 0 < message.header_chunks <= len(hashes):
            raise StateFormatError("bad header chunk count")
        if any(len(h) != HASH_BYTES for h in hashes):
            raise StateFormatError("chunk hashes must be 32 bytes")
        if any(not 0 < s <= message.chunk_size for s in sizes):
            raise StateFormatError("chunk size outside (0, chunk_size]")
        if sum(sizes) > max_total_bytes:
            raise StateFormatError(f"state of {sum(sizes)} bytes exceeds the {max_total_bytes} cap")
        if not math.isfinite(message.version):
            raise StateFormatError("version must be finite")
        root = compute_root(message.chunk_size, message.header_chunks, hashes, sizes)
        if root != expected_root or bytes(message.root) != expected_root:
            raise StateFormatError("manifest does not match the advertised root hash")
        return cls(root, message.version, message.chunk_size, message.header_chunks, hashes, sizes)


@dataclass(frozen=True)
class PackedState:
    """A state cut into chunks, ready to serve: the manifest and ``{hash: bytes}``."""

    manifest: Manifest
    chunks: dict[bytes, bytes]


def _split(data: bytes, chunk_size: int) -> list[bytes]:
    return [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]


def pack_state(
    tensors: Sequence[np.ndarray],
    metadata: bytes,
    version: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> PackedState:
    """Cut a state into content-addressed chunks.

    Raises:
        ValueError: unsupported dtype, too many tensors, header or state too large.
    """
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be in (0, {MAX_CHUNK_SIZE}]")
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS} tensors")
    specs = []
    for i, array in enumerate(tensors):
        name = np.dtype(array.dtype).name
        if name not in SUPPORTED_DTYPES:
            raise ValueError(
                f"tensor {i} has unsupported dtype {name}; supported: {sorted(SUPPORTED_DTYPES)}"
            )
        specs.append([name, [int(d) for d in array.shape]])
    header = msgpack.packb(
        {"v": FORMAT_VERSION, "metadata": bytes(metadata), "tensors": specs}, use_bin_type=True
    )
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"metadata and tensor specs exceed {MAX_HEADER_BYTES} bytes")
    pieces = _split(header, chunk_size)
    header_chunks = len(pieces)
    for array in tensors:
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        # Sliced from a byte view: each chunk is one copy of the tensor's bytes (tobytes()
        # first would copy the whole tensor once more).
        data = little.reshape(-1).view(np.uint8)
        pieces.extend(data[i : i + chunk_size].tobytes() for i in range(0, data.size, chunk_size))
    if len(pieces) > MAX_CHUNKS:
        raise ValueError(f"state needs {len(pieces)} chunks; at most {MAX_CHUNKS}")
    hashes = tuple(chunk_hash(p) for p in pieces)
    sizes = tuple(len(p) for p in pieces)
    root = compute_root(chunk_size, header_chunks, hashes, sizes)
    manifest = Manifest(root, version, chunk_size, header_chunks, hashes, sizes)
    return PackedState(manifest, dict(zip(hashes, pieces, strict=True)))


def unpack_state(
    manifest: Manifest, chunks: Mapping[bytes, bytes]
) -> tuple[bytes, list[np.ndarray]]:
    """Rebuild ``(metadata, tensors)`` from verified chunks; the arrays are fresh copies.

    Raises:
        StateFormatError: a chunk is missing, or the header disagrees with the manifest.
    """
    try:
        data = [chunks[h] for h in manifest.chunk_hashes]
    except KeyError:
        raise StateFormatError("a chunk of the state is missing") from None
    header_bytes = b"".join(data[: manifest.header_chunks])
    try:
        header = msgpack.unpackb(
            header_bytes, raw=False, max_bin_len=MAX_HEADER_BYTES, max_array_len=MAX_TENSORS
        )
    except Exception as error:  # msgpack raises several unrelated types
        raise StateFormatError(f"undecodable state header: {error}") from None
    if not isinstance(header, dict) or header.get("v") != FORMAT_VERSION:
        raise StateFormatError("unknown state header version")
    metadata, specs = header.get("metadata"), header.get("tensors")
    if not isinstance(metadata, bytes) or not isinstance(specs, list):
        raise StateFormatError("state header lacks metadata or tensor specs")
    tensors = []
    index = manifest.header_chunks
    for spec in specs:
        if (
            not isinstance(spec, list)
            or len(spec) != 2
            or not isinstance(spec[0], str)  # a list here would not even hash
            or spec[0] not in SUPPORTED_DTYPES
            or not isinstance(spec[1], list)
            or len(spec[1]) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec[1])
        ):
            raise StateFormatError(f"bad tensor spec {spec!r}")
        dtype = _dtype_named(spec[0])
        shape = tuple(spec[1])
        nbytes = math.prod(shape) * dtype.itemsize
        count = math.ceil(nbytes / manifest.chunk_size)
        if nbytes > manifest.total_bytes or index + count > len(data):
            raise StateFormatError("tensor specs need more chunks than the manifest lists")
        raw = b"".join(data[index : index + count])
        index += count
        if len(raw) != nbytes:
            raise StateFormatError("tensor bytes do not match its shape and dtype")
        try:  # a zero-sized shape may still name dimensions numpy cannot hold
            array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)
        except (ValueError, OverflowError) as error:
            raise StateFormatError(f"bad tensor shape {shape}: {error}") from None
        tensors.append(array.copy() if not array.flags.writeable else array)
    if index != len(data):
        raise StateFormatError("manifest lists chunks that no tensor uses")
    return metadata, tensors
