"""Content-addressed state chunks: round trip, verification, incremental reuse."""

from __future__ import annotations

import ml_dtypes
import msgpack
import numpy as np
import pytest

from swarmavg.averaging.state.format import (
    Manifest,
    StateFormatError,
    chunk_hash,
    compute_root,
    pack_state,
    unpack_state,
)


def tensors() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [
        rng.standard_normal((300, 7)).astype(np.float32),
        np.arange(10, dtype=np.int64),
        rng.standard_normal(1000).astype(ml_dtypes.bfloat16),
        np.zeros((0, 3), dtype=np.float16),
        np.array(3.5, dtype=np.float64),
    ]


def test_round_trip_exact() -> None:
    packed = pack_state(tensors(), b"meta", version=3.0, chunk_size=1024)
    metadata, out = unpack_state(packed.manifest, packed.chunks)
    assert metadata == b"meta"
    for a, b in zip(tensors(), out, strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert a.tobytes() == b.tobytes()
        assert b.flags.writeable


def test_manifest_verified_against_root() -> None:
    packed = pack_state(tensors(), b"m", version=1.0, chunk_size=1024)
    root = packed.manifest.root
    wire = packed.manifest.to_proto()
    assert Manifest.from_proto(wire, root, 1 << 30) == packed.manifest
    wire.chunk_sizes[0] -= 1
    with pytest.raises(StateFormatError, match="root"):
        Manifest.from_proto(wire, root, 1 << 30)
    with pytest.raises(StateFormatError, match="cap"):
        Manifest.from_proto(packed.manifest.to_proto(), root, 100)


def test_same_content_same_root_regardless_of_version() -> None:
    a = pack_state(tensors(), b"m", version=1.0, chunk_size=1024)
    b = pack_state(tensors(), b"m", version=2.0, chunk_size=1024)
    assert a.manifest.root == b.manifest.root


def test_changing_one_tensor_changes_only_its_chunks() -> None:
    old = pack_state(tensors(), b"m", version=1.0, chunk_size=1024)
    changed = tensors()
    changed[1] = changed[1] + 1
    new = pack_state(changed, b"m", version=2.0, chunk_size=1024)
    fresh = set(new.manifest.chunk_hashes) - set(old.manifest.chunk_hashes)
    assert len(fresh) == 1  # int64 x 10 = 80 bytes, one chunk
    assert new.manifest.root != old.manifest.root


def test_missing_chunk_and_bad_header_rejected() -> None:
    packed = pack_state(tensors(), b"m", version=1.0, chunk_size=1024)
    chunks = dict(packed.chunks)
    chunks.pop(packed.manifest.chunk_hashes[-1])
    with pytest.raises(StateFormatError, match="missing"):
        unpack_state(packed.manifest, chunks)


def test_unsupported_dtype_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        pack_state([np.array(["a"])], b"", version=0.0)


@pytest.mark.parametrize("name", [["float32"], {"a": 1}, "bfloat17", None])
def test_a_header_naming_no_supported_dtype_is_a_format_error(name: object) -> None:
    header = msgpack.packb({"v": 1, "metadata": b"", "tensors": [[name, [2]]]})
    digest = chunk_hash(header)
    root = compute_root(1024, 1, [digest], [len(header)])
    manifest = Manifest(root, 0.0, 1024, 1, (digest,), (len(header),))
    with pytest.raises(StateFormatError, match="bad tensor spec"):
        unpack_state(manifest, {digest: header})
