"""Lossless wrappers: ``zstd+<codec>`` and ``lz4+<codec>``.

The wrapper runs the inner codec, then compresses its payload; the message is labelled
``<wrapper>+<inner message's codec>`` and carries the inner codec's parameters plus
``meta["raw_bytes"]``, the payload size before compression. Decompression is bounded by
that size, and the size itself is bounded by the declared shape, so a small message
cannot expand into a huge allocation ("decompression bomb").

Worth it for payloads with redundancy: top-k index gaps, 8-bit codes of peaked
distributions, sparse tensors. Random-looking float16 mantissas gain little.
"""

from __future__ import annotations

import lz4.block
import numpy as np
import zstandard

from swarmavg.compression.base import (
    Buffer,
    Codec,
    CodecInfo,
    Encoded,
    Header,
    meta_int,
)
from swarmavg.compression.errors import CodecError

__all__ = ["WRAPPERS", "LosslessCodec"]

WRAPPERS = ("zstd", "lz4")
_RAW_KEY = "raw_bytes"
# No codec produces more than 10 bytes per element (scaled-float16 with one-element
# rows); the slack covers small fixed parts.
_MAX_BYTES_PER_ELEMENT = 16
_SLACK = 1 << 16


class LosslessCodec(Codec):
    """Compress another codec's payload with zstd or lz4."""

    def __init__(self, kind: str, inner: Codec, level: int | None = None) -> None:
        """Args:
        kind: ``"zstd"`` or ``"lz4"``.
        inner: the codec whose payload is compressed.
        level: zstd level (default 1: most of the gain at several hundred MB/s).
        """
        if kind not in WRAPPERS:
            raise ValueError(f"unknown lossless wrapper {kind!r}; known: {', '.join(WRAPPERS)}")
        if isinstance(inner, LosslessCodec):
            raise ValueError("lossless wrappers do not nest")
        self.kind = kind
        self.inner = inner
        self.level = 1 if level is None else level
        self.name = f"{kind}+{inner.name}"

    def accepts(self, codec_name: str) -> bool:
        return codec_name.startswith(self.kind + "+")

    def _compress(self, data: Buffer) -> bytes:
        if self.kind == "zstd":
            # A compressor object is not thread-safe; one per call keeps encode reentrant.
            return bytes(zstandard.ZstdCompressor(level=self.level).compress(data))
        return bytes(lz4.block.compress(data, store_size=False))

    def _decompress(self, data: Buffer, raw: int) -> bytes:
        try:
            if self.kind == "zstd":
                out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw)
            else:
                out = lz4.block.decompress(data, uncompressed_size=raw)
        except Exception as e:  # both libraries raise their own error types
            raise CodecError(f"{self.kind}: corrupt compressed payload: {e}") from None
        return bytes(out)

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        return self._wrap(self.inner.encode_payload(array, info))

    def encode_payload_and_values(
        self, array: np.ndarray, info: CodecInfo
    ) -> tuple[Encoded, np.ndarray]:
        """The inner codec's encoding, compressed, and its values: compression is
        lossless, so they are what decoding the compressed payload gives."""
        enc, values = self.inner.encode_payload_and_values(array, info)
        return self._wrap(enc), values

    def _wrap(self, enc: Encoded) -> Encoded:
        """The inner codec's encoding with its payload compressed."""
        h = enc.header
        if _RAW_KEY in h.meta:
            raise CodecError(f"codec {h.codec!r} uses the reserved meta key {_RAW_KEY!r}")
        raw = memoryview(enc.payload).cast("B")
        meta = {**h.meta, _RAW_KEY: raw.nbytes}
        header = Header(f"{self.kind}+{h.codec}", h.dtype, h.shape, meta)
        return Encoded(header, self._compress(raw))

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        inner, inner_header, data = self._unwrap(header, payload)
        return inner.decode_payload(inner_header, data)

    def decode_payload_into(self, header: Header, payload: Buffer, out: np.ndarray) -> None:
        inner, inner_header, data = self._unwrap(header, payload)
        inner.decode_payload_into(inner_header, data, out)

    def _unwrap(self, header: Header, payload: Buffer) -> tuple[Codec, Header, bytes]:
        """The inner codec, header and decompressed payload of a message.

        Raises:
            CodecError: not this wrapper's message, nested wrappers, corrupt or
                mis-sized compressed data.
        """
        from swarmavg.compression.registry import decoder_for  # registry imports this module

        prefix, _, inner_name = header.codec.partition("+")
        if prefix != self.kind or not inner_name:
            raise CodecError(f"{self.name} cannot decode a {header.codec!r} message")
        inner = decoder_for(inner_name)
        if isinstance(inner, LosslessCodec):
            raise CodecError("lossless wrappers do not nest")
        raw = meta_int(header, _RAW_KEY, 0, _MAX_BYTES_PER_ELEMENT * header.size + _SLACK)
        data = self._decompress(payload, raw)
        if len(data) != raw:
            raise CodecError(
                f"{self.kind}: payload decompressed to {len(data)} bytes, declared {raw}"
            )
        meta = {k: v for k, v in header.meta.items() if k != _RAW_KEY}
        return inner, Header(inner_name, header.dtype, header.shape, meta), data
