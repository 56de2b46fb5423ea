"""Tensor wire format: chunked round trips and every kind of broken stream."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from swarmavg.compression import CodecError, get_codec
from swarmavg.compression.serialization import (
    ChunkAssembler,
    SerializationError,
    deserialize_array,
    serialize_array,
    split_chunk,
)
from swarmavg.proto import tensor_pb2

DTYPES = [
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.float64,
    np.int8,
    np.uint8,
    np.int32,
    np.int64,
]


def _array(dtype: type, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def _stream(n: int = 1000, chunk: int = 512) -> list[tensor_pb2.TensorChunk]:
    return serialize_array(_array(np.float32, (n,)), max_chunk_bytes=chunk)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (257, 3)])
def test_round_trip_is_exact(dtype: type, shape: tuple[int, ...]) -> None:
    x = _array(dtype, shape)
    chunks = serialize_array(x, max_chunk_bytes=100)
    assert all(len(c.buffer) <= 100 for c in chunks)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    y = deserialize_array(chunks)
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    assert y.flags.writeable
    assert x.tobytes() == y.tobytes()


def test_non_contiguous_and_big_endian_inputs() -> None:
    x = _array(np.float64, (40, 30))[::3, ::2]
    assert np.array_equal(deserialize_array(serialize_array(x, max_chunk_bytes=64)), x)
    be = np.arange(10, dtype=">i4")
    y = deserialize_array(serialize_array(be))
    assert y.dtype == np.int32
    assert np.array_equal(y, be)


def test_lossy_codec_stream_carries_meta_in_first_chunk_only() -> None:
    x = _array(np.float32, (64, 100))
    chunks = serialize_array(x, "scaled-float16", max_chunk_bytes=1000)
    assert chunks[0].meta
    assert all(not c.meta for c in chunks[1:])
    y = deserialize_array(chunks)
    assert np.allclose(y, x, atol=1e-2)


def test_split_chunk_and_assembler_give_back_the_message() -> None:
    msg = get_codec("scaled-float16").encode(_array(np.float32, (64, 100)))
    parts = split_chunk(msg, 999)
    assert len(parts) == -(-len(msg.buffer) // 999)
    assembler = ChunkAssembler(max_total_bytes=len(msg.buffer))
    results = [assembler.add(p) for p in parts]
    assert all(r is None for r in results[:-1])
    whole = results[-1]
    assert whole is not None
    assert whole.buffer == msg.buffer
    assert np.array_equal(
        get_codec("scaled-float16").decode(whole),
        get_codec("none").decode(get_codec("none").encode(get_codec("scaled-float16").decode(msg))),
    )
    assert not assembler.in_progress


def test_assembler_takes_consecutive_tensors() -> None:
    a = serialize_array(np.arange(100, dtype=np.int64), max_chunk_bytes=128)
    b = serialize_array(np.ones(7, np.float32), max_chunk_bytes=128)
    assembler = ChunkAssembler()
    done = [m for m in (assembler.add(c) for c in [*a, *b]) if m is not None]
    assert len(done) == 2
    assert np.array_equal(get_codec("none").decode(done[0]), np.arange(100))
    assert np.array_equal(get_codec("none").decode(done[1]), np.ones(7, np.float32))


# --- broken streams ------------------------------------------------------------------

Mutation = Callable[[list[tensor_pb2.TensorChunk]], list[tensor_pb2.TensorChunk]]


def _truncate(s: list[tensor_pb2.TensorChunk]) -> list[tensor_pb2.TensorChunk]:
    return s[:-1]


def _reorder(s: list[tensor_pb2.TensorChunk]) -> list[tensor_pb2.TensorChunk]:
    return [s[0], s[2], s[1], *s[3:]]


def _duplicate(s: list[tensor_pb2.TensorChunk]) -> list[tensor_pb2.TensorChunk]:
    return [s[0], s[1], s[1], *s[2:]]


def _drop_first(s: list[tensor_pb2.TensorChunk]) -> list[tensor_pb2.TensorChunk]:
    return s[1:]


def _extra_after_end(s: list[tensor_pb2.TensorChunk]) -> list[tensor_pb2.TensorChunk]:
    return [*s, s[0]]


def _edit(i: int, **fields: object) -> Mutation:
    def mutate(s: list[tensor_pb2.TensorChunk]) -> list[tensor_pb2.TensorChunk]:
        out = [tensor_pb2.TensorChunk() for _ in s]
        for o, c in zip(out, s, strict=True):
            o.CopyFrom(c)
        for k, v in fields.items():
            if k == "shape":
                del out[i].shape[:]
                out[i].shape.extend(v)  # type: ignore[call-overload]
            else:
                setattr(out[i], k, v)
        return out

    return mutate


def _short_last(s: list[tensor_pb2.TensorChunk]) -> list[tensor_pb2.TensorChunk]:
    return _edit(len(s) - 1, buffer=s[-1].buffer[:-4])(s)


def _long_last(s: list[tensor_pb2.TensorChunk]) -> list[tensor_pb2.TensorChunk]:
    return _edit(len(s) - 1, buffer=s[-1].buffer + b"\0" * 8)(s)


BROKEN: dict[str, tuple[Mutation, str]] = {
    "truncated": (_truncate, "truncated stream: got 7 of 8 chunks"),
    "reordered": (_reorder, "reordered or missing chunk: expected seq 1, got 2"),
    "duplicated": (_duplicate, "duplicated chunk: expected seq 2, got 1"),
    "missing-first": (_drop_first, r"expected the first chunk \(seq 0\)"),
    "extra-after-end": (_extra_after_end, "stream continues after the tensor was complete"),
    "short-last": (_short_last, "truncated: the last chunk ends at byte"),
    "long-last": (_long_last, "oversized: chunk 7 ends at byte"),
    "bad-offset": (_edit(3, offset=0), "chunk 3 has offset 0, expected 1536"),
    "codec-changes": (_edit(2, codec="float16"), "chunk 2 disagrees with chunk 0"),
    "shape-changes": (_edit(2, shape=[999]), "chunk 2 disagrees with chunk 0"),
    "total-changes": (_edit(2, total_bytes=5000), "chunk 2 disagrees with chunk 0"),
    "meta-later": (_edit(2, meta=b"\x80"), "chunk 2 carries meta"),
    "empty-middle": (_edit(2, buffer=b""), "inconsistent|chunk 2 is empty"),
    "too-many-chunks": (_edit(0, num_chunks=10**6), "1000000 chunks declared for 4000 bytes"),
    "first-offset": (_edit(0, offset=4), "chunk 0 has offset 4"),
    "bad-dtype": (_edit(0, dtype=0), "bad chunk header: unknown or unspecified dtype"),
    "absurd-shape": (_edit(0, shape=[1 << 40, 1 << 40]), "bad chunk header: shape"),
    "bad-meta": (_edit(0, meta=b"\xc1"), "bad chunk header: codec meta is not valid msgpack"),
    "no-codec": (_edit(0, codec=""), "bad chunk header: chunk names no codec"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_stream_is_rejected_with_reason(case: str) -> None:
    mutate, reason = BROKEN[case]
    with pytest.raises(SerializationError, match=reason):
        deserialize_array(mutate(_stream()))


def test_oversized_declaration_is_rejected_before_allocation() -> None:
    # A 1 TB declaration: allocating it would kill the process, so passing proves the
    # check happens first.
    chunk = _stream()[0]
    chunk.total_bytes = 1 << 40
    chunk.num_chunks = 1 << 20
    with pytest.raises(SerializationError, match="oversized: tensor declares 1099511627776"):
        ChunkAssembler(max_total_bytes=1 << 30).add(chunk)
    with pytest.raises(SerializationError, match="oversized"):
        deserialize_array(_stream(), max_total_bytes=3999)


def test_empty_stream_and_payload_size_mismatch() -> None:
    with pytest.raises(SerializationError, match="empty stream"):
        deserialize_array([])
    # A consistent stream whose payload does not fit the declared shape: a codec error.
    chunks = _edit(0, shape=[999])(serialize_array(np.ones(1000, np.float32)))
    with pytest.raises(CodecError, match="payload is 4000 bytes but shape"):
        deserialize_array(chunks)


def test_assembler_recovers_after_an_error() -> None:
    assembler = ChunkAssembler()
    stream = _stream()
    assembler.add(stream[0])
    with pytest.raises(SerializationError):
        assembler.add(stream[2])
    assert not assembler.in_progress
    done = [m for m in (assembler.add(c) for c in stream) if m is not None]
    assert len(done) == 1


def test_split_rejects_a_piece_of_a_stream() -> None:
    with pytest.raises(SerializationError, match="already a chunk"):
        split_chunk(_stream()[1])
