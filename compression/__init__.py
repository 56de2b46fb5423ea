"""swarmavg.compression: tensor codecs and their registry.

Public API::

    from swarmavg.compression import get_codec, decode_chunk, CodecInfo, Role
    codec = get_codec("uint8-blockwise")
    msg = codec.encode(array, CodecInfo(key="w", role=Role.GRADIENT))
    out = decode_chunk(msg)          # or codec.decode(msg)

Codec names and when to use which: docs/compression.md.
"""

from swarmavg.compression import builtin as _builtin  # noqa: F401  (registers the codecs)
from swarmavg.compression.adaptive import (
    KeyAdaptiveCodec,
    RoleAdaptiveCodec,
    SelectorCodec,
    SizeAdaptiveCodec,
)
from swarmavg.compression.base import DEFAULT_MAX_ELEMENTS, Codec, CodecInfo, Role
from swarmavg.compression.errors import CodecError
from swarmavg.compression.feedback import ErrorFeedback
from swarmavg.compression.lossless import LosslessCodec
from swarmavg.compression.registry import (
    canonical_name,
    decode_chunk,
    get_codec,
    known_codecs,
    register_codec,
)
from swarmavg.compression.sparseloco import SparseLoCoCodec
from swarmavg.compression.topk import TopKCodec

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "Codec",
    "CodecError",
    "CodecInfo",
    "ErrorFeedback",
    "KeyAdaptiveCodec",
    "LosslessCodec",
    "Role",
    "RoleAdaptiveCodec",
    "SelectorCodec",
    "SizeAdaptiveCodec",
    "SparseLoCoCodec",
    "TopKCodec",
    "canonical_name",
    "decode_chunk",
    "get_codec",
    "known_codecs",
    "register_codec",
]
