"""swarmavg.compression: tensor codecs, their registry, and the tensor wire format.

Public API (DESIGN section 5.3)::

    from swarmavg.compression import get_codec, decode_chunk, CodecInfo, Role
    codec = get_codec("uint8-blockwise")
    msg = codec.encode(array, CodecInfo(key="w", role=Role.GRADIENT))
    out = decode_chunk(msg)          # or codec.decode(msg)
"""

from swarmavg.compression import builtin as _builtin  # noqa: F401  (registers the codecs)
from swarmavg.compression.base import DEFAULT_MAX_ELEMENTS, Codec, CodecInfo, Role
from swarmavg.compression.errors import CodecError
from swarmavg.compression.registry import decode_chunk, get_codec, known_codecs, register_codec

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "Codec",
    "CodecError",
    "CodecInfo",
    "Role",
    "decode_chunk",
    "get_codec",
    "known_codecs",
    "register_codec",
]
