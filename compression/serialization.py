"""Tensor wire format: an array as a stream of TensorChunk messages, and back.

A codec turns an array into one payload plus a header (codec, dtype, shape, meta). A
payload larger than ``max_chunk_bytes`` travels as a stream of messages:

- every chunk repeats ``codec``, ``dtype``, ``shape``, ``num_chunks`` and ``total_bytes``;
- ``meta`` travels only in chunk 0 (later chunks carry none);
- chunk ``seq`` (0, 1, ..., ``num_chunks - 1``) holds the bytes
  ``[offset, offset + len(buffer))`` of the payload, in order, none of them empty
  (an empty payload is one chunk with an empty buffer);
- a payload that fits in one chunk is a complete message (``num_chunks`` 1, ``seq`` 0),
  exactly what ``Codec.encode`` produces.

gRPC streams are ordered, so the assembler demands chunks in order: anything else is a
broken or hostile sender. It checks the declared size against ``max_total_bytes``
before it allocates, writes every chunk straight into one preallocated buffer, and the
decoded array is built on that buffer without a further copy where the codec allows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from swarmavg.compression.base import (
    DEFAULT_MAX_ELEMENTS,
    Codec,
    CodecInfo,
    Encoded,
    Header,
    check_shape,
    parse_meta,
    writable,
)
from swarmavg.compression.dtypes import dtype_from_proto, dtype_to_proto
from swarmavg.compression.errors import CodecError
from swarmavg.compression.registry import decoder_for, get_codec
from swarmavg.proto import tensor_pb2

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_TOTAL_BYTES",
    "ChunkAssembler",
    "SerializationError",
    "deserialize_array",
    "dtype_from_proto",
    "dtype_to_proto",
    "iter_chunks",
    "serialize_array",
    "split_chunk",
]

DEFAULT_CHUNK_BYTES = 1 << 20
"""Payload bytes per chunk: big enough to amortise per-message cost, well under gRPC's
default 4 MiB message cap."""

DEFAULT_MAX_TOTAL_BYTES = 1 << 30
"""Largest payload an assembler accepts unless told otherwise."""


class SerializationError(CodecError):
    """A chunk stream is truncated, reordered, duplicated, oversized or inconsistent."""


def iter_chunks(
    encoded: Encoded, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tensor_pb2.TensorChunk]:
    """Yield the stream of chunk messages for one encoded payload.

    Slices the payload through a memoryview: each chunk costs one copy into its message.
    The payload must not change until the iterator is exhausted.

    Raises:
        ValueError: ``max_chunk_bytes`` < 1.
    """
    if max_chunk_bytes < 1:
        raise ValueError("max_chunk_bytes must be >= 1")
    h = encoded.header
    view = memoryview(encoded.payload).cast("B")
    total = view.nbytes
    num = max(1, -(-total // max_chunk_bytes))
    dtype = dtype_to_proto(h.dtype)
    for seq in range(num):
        start = seq * max_chunk_bytes
        piece = view[start : start + max_chunk_bytes]
        yield tensor_pb2.TensorChunk(
            codec=h.codec,
            dtype=dtype,  # type: ignore[arg-type]
            shape=h.shape,
            buffer=piece.tobytes(),
            meta=h.meta_bytes() if seq == 0 else b"",
            seq=seq,
            num_chunks=num,
            offset=start,
            total_bytes=total,
        )


def split_chunk(
    message: tensor_pb2.TensorChunk, max_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[tensor_pb2.TensorChunk]:
    """Split one complete message into a stream whose buffers hold <= ``max_bytes`` each.

    A message that already fits is returned as a one-element stream (a copy).

    Raises:
        SerializationError: ``message`` is itself a piece of a stream.
    """
    if message.num_chunks > 1 or message.seq or message.offset:
        raise SerializationError("cannot split a message that is already a chunk of a stream")
    header = Header(
        codec=message.codec,
        dtype=dtype_from_proto(message.dtype),
        shape=tuple(message.shape),
        meta={},
    )
    out = list(iter_chunks(Encoded(header, message.buffer), max_bytes))
    out[0].meta = message.meta
    return out


def serialize_array(
    array: np.ndarray,
    codec: str | Codec = "none",
    *,
    info: CodecInfo | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[tensor_pb2.TensorChunk]:
    """Encode ``array`` with ``codec`` and cut the payload into a stream of chunks.

    Raises:
        CodecError: the codec cannot encode the array.
        ValueError: unknown codec name.
    """
    c = get_codec(codec) if isinstance(codec, str) else codec
    encoded = c.encode_payload(array, info if info is not None else CodecInfo())
    return list(iter_chunks(encoded, max_chunk_bytes))


class ChunkAssembler:
    """Reassembles chunk streams into complete payloads, one tensor after another.

    Not thread-safe: one assembler per incoming stream.
    """

    def __init__(
        self,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
    ) -> None:
        """Args:
        max_total_bytes: largest payload accepted; checked before allocating.
        max_elements: largest declared element count accepted.
        """
        if max_total_bytes < 0:
            raise ValueError("max_total_bytes must be >= 0")
        self.max_total_bytes = max_total_bytes
        self.max_elements = max_elements
        self._first: tensor_pb2.TensorChunk | None = None
        self._header: Header | None = None
        self._buffer = memoryview(b"")
        self._received = 0
        self._next_seq = 0

    @property
    def in_progress(self) -> bool:
        """Whether a tensor has started but not completed."""
        return self._first is not None

    def add(self, chunk: tensor_pb2.TensorChunk) -> tensor_pb2.TensorChunk | None:
        """Add the next chunk; return the complete message when this chunk completes it.

        Raises:
            SerializationError: the chunk does not continue the stream correctly.
        """
        done = self.add_payload(chunk)
        if done is None:
            return None
        header, payload = done
        return Encoded(header, payload).to_message()

    def add_payload(
        self, chunk: tensor_pb2.TensorChunk
    ) -> tuple[Header, memoryview | bytes] | None:
        """Like :meth:`add`, but return the validated header and the payload itself
        (the preallocated buffer, handed over to the caller) instead of a message copy."""
        if self._first is None:
            return self._start(chunk)
        return self._continue(chunk)

    def finish(self) -> None:
        """Declare the stream ended.

        Raises:
            SerializationError: a tensor was started but not completed (truncated stream).
        """
        first = self._first
        if first is not None:
            got, received = self._next_seq, self._received
            self._reset()
            raise SerializationError(
                f"truncated stream: got {got} of {first.num_chunks} chunks "
                f"({received} of {first.total_bytes} bytes)"
            )

    # -- internals ---------------------------------------------------------------------

    def _reset(self) -> None:
        self._first = None
        self._header = None
        self._buffer = memoryview(b"")
        self._received = 0
        self._next_seq = 0

    def _fail(self, reason: str) -> SerializationError:
        self._reset()
        return SerializationError(reason)

    def _start(self, chunk: tensor_pb2.TensorChunk) -> tuple[Header, memoryview | bytes] | None:
        if chunk.seq != 0:
            raise self._fail(
                f"expected the first chunk (seq 0) of a tensor, got seq {chunk.seq} "
                "(reordered, duplicated or missing chunks)"
            )
        num = chunk.num_chunks or 1
        total = chunk.total_bytes
        size = len(chunk.buffer)
        if total > self.max_total_bytes:
            raise self._fail(
                f"oversized: tensor declares {total} bytes, more than the "
                f"{self.max_total_bytes} allowed"
            )
        if num > max(1, total):
            raise self._fail(f"inconsistent: {num} chunks declared for {total} bytes")
        if chunk.offset != 0:
            raise self._fail(f"chunk 0 has offset {chunk.offset}, expected 0")
        if size > total or (num == 1 and size != total):
            raise self._fail(
                f"inconsistent: chunk 0 carries {size} bytes of a {total}-byte payload "
                f"in {num} chunk(s)"
            )
        if num > 1 and size == 0:
            raise self._fail("chunk 0 is empty")
        try:
            if not chunk.codec:
                raise CodecError("chunk names no codec")
            shape = tuple(int(d) for d in chunk.shape)
            check_shape(shape, self.max_elements)
            header = Header(
                chunk.codec, dtype_from_proto(chunk.dtype), shape, parse_meta(chunk.meta)
            )
        except CodecError as e:
            raise self._fail(f"bad chunk header: {e}") from None
        if num == 1:
            return header, chunk.buffer
        self._first = chunk
        self._header = header
        # Bounded by max_total_bytes, checked above. A numpy buffer rather than a
        # bytearray: large numpy allocations get transparent huge pages, which roughly
        # halves the cost of filling 64 MB here.
        self._buffer = np.empty(total, dtype=np.uint8).data
        self._buffer[:size] = chunk.buffer
        self._received = size
        self._next_seq = 1
        return None

    def _continue(self, chunk: tensor_pb2.TensorChunk) -> tuple[Header, memoryview | bytes] | None:
        first = self._first
        header = self._header
        if first is None or header is None:  # pragma: no cover - guarded by add_payload
            raise SerializationError("no stream in progress")
        if chunk.seq != self._next_seq:
            kind = "duplicated" if chunk.seq < self._next_seq else "reordered or missing"
            raise self._fail(f"{kind} chunk: expected seq {self._next_seq}, got {chunk.seq}")
        if (
            chunk.codec != first.codec
            or chunk.dtype != first.dtype
            or list(chunk.shape) != list(first.shape)
            or chunk.num_chunks != first.num_chunks
            or chunk.total_bytes != first.total_bytes
        ):
            raise self._fail(
                f"inconsistent: chunk {chunk.seq} disagrees with chunk 0 on codec, dtype, "
                "shape, num_chunks or total_bytes"
            )
        if chunk.meta:
            raise self._fail(f"inconsistent: chunk {chunk.seq} carries meta (only chunk 0 may)")
        if chunk.offset != self._received:
            raise self._fail(
                f"chunk {chunk.seq} has offset {chunk.offset}, expected {self._received}"
            )
        data = chunk.buffer
        size = len(data)
        if size == 0:
            raise self._fail(f"chunk {chunk.seq} is empty")
        end = self._received + size
        if end > first.total_bytes:
            raise self._fail(
                f"oversized: chunk {chunk.seq} ends at byte {end}, past the declared "
                f"total of {first.total_bytes}"
            )
        last = chunk.seq == first.num_chunks - 1
        if last and end != first.total_bytes:
            raise self._fail(f"truncated: the last chunk ends at byte {end} of {first.total_bytes}")
        if not last and end == first.total_bytes:
            raise self._fail(
                f"inconsistent: chunk {chunk.seq} completes the payload but "
                f"{first.num_chunks} chunks were declared"
            )
        self._buffer[self._received : end] = data
        self._received = end
        self._next_seq += 1
        if not last:
            return None
        payload = self._buffer
        self._reset()
        return header, payload


def deserialize_array(
    chunks: Iterable[tensor_pb2.TensorChunk],
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> np.ndarray:
    """Reassemble and decode a stream that holds exactly one tensor.

    Returns:
        A writable array of the original dtype and shape.

    Raises:
        SerializationError: empty, truncated, reordered, duplicated, oversized or
            inconsistent stream, or chunks after the tensor was complete.
        CodecError: the reassembled payload does not decode.
    """
    assembler = ChunkAssembler(max_total_bytes, max_elements=max_elements)
    result: tuple[Header, memoryview | bytes] | None = None
    count = 0
    for chunk in chunks:
        count += 1
        if result is not None:
            raise SerializationError(
                f"stream continues after the tensor was complete (chunk {count})"
            )
        result = assembler.add_payload(chunk)
    if count == 0:
        raise SerializationError("empty stream: no chunks")
    assembler.finish()
    if result is None:  # pragma: no cover - finish() raises for an unfinished tensor
        raise SerializationError("stream ended before the tensor was complete")
    header, payload = result
    return writable(decoder_for(header.codec).decode_payload(header, payload))
