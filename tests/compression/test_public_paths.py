"""The public ``Codec.encode``/``decode`` give exactly what the internal paths give.

The all-reduce calls ``encode_payload``/``decode_payload`` (no protobuf message); users
call ``encode``/``decode`` and ``decode_chunk``. Both must produce the same bytes on the
wire and the same bits after decoding, for every codec, so that speeding one up can
never change what a peer receives.
"""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.compression import CodecError, CodecInfo, decode_chunk, get_codec
from swarmavg.compression.base import Encoded

from .helpers import ALL_CODECS, FLOAT_DTYPES, dtype_id, normal

pytestmark = pytest.mark.timeout(120)

SHAPES = [(1000,), (37, 129), (2, 3, 4096), (0,)]


def _input(shape: tuple[int, ...], dtype: object) -> np.ndarray:
    n = int(np.prod(shape))
    x = normal(n, np.float32, seed=n) * np.float32(3)
    return x.astype(dtype).reshape(shape)  # type: ignore[call-overload,no-any-return]


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("name", [*ALL_CODECS, "sparseloco"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_public_and_internal_paths_give_identical_bytes(
    name: str, dtype: object, shape: tuple[int, ...]
) -> None:
    x = _input(shape, dtype)
    info = CodecInfo(key="w", part_size=x.size)
    # Fresh codecs: stateful ones (top-k error feedback) must start from the same state.
    internal: Encoded = get_codec(name).encode_payload(x, info)
    message = get_codec(name).encode(x, info)

    assert message.buffer == bytes(internal.payload)
    assert message.codec == internal.header.codec
    assert message.meta == internal.header.meta_bytes()
    assert tuple(message.shape) == internal.header.shape
    assert message.SerializeToString() == internal.to_message().SerializeToString()

    codec = get_codec(name)
    expected = codec.decode_payload(internal.header, internal.payload)
    for decoded in (codec.decode(message), decode_chunk(message)):
        _same_bits(decoded, expected)
        assert decoded.flags.writeable
    # The decoded array is the caller's: writing to it changes nothing in the message.
    again = codec.decode(message)
    if again.size:
        again.reshape(-1)[0] = 0
        _same_bits(codec.decode(message), expected)


@pytest.mark.parametrize("decode", ["method", "decode_chunk"])
def test_public_decode_still_checks_total_bytes(decode: str) -> None:
    codec = get_codec("float16")
    message = codec.encode(np.ones(8, np.float32))
    message.total_bytes = len(message.buffer) + 1
    with pytest.raises(CodecError, match="total_bytes"):
        codec.decode(message) if decode == "method" else decode_chunk(message)
