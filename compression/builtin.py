"""Registers the built-in codecs under their names (imported by the package)."""

from __future__ import annotations

from swarmavg.compression.blockwise import Blockwise4BitCodec, Blockwise8BitCodec
from swarmavg.compression.floating import (
    BFloat16Codec,
    Float16Codec,
    NoneCodec,
    ScaledFloat16Codec,
)
from swarmavg.compression.quantization import Quantile8BitCodec, Uniform8BitCodec
from swarmavg.compression.registry import register_codec

register_codec(NoneCodec.name, NoneCodec)
register_codec(Float16Codec.name, Float16Codec)
register_codec(BFloat16Codec.name, BFloat16Codec)
register_codec(ScaledFloat16Codec.name, ScaledFloat16Codec)
register_codec(Blockwise8BitCodec.name, Blockwise8BitCodec)
register_codec(Blockwise4BitCodec.name, Blockwise4BitCodec)
register_codec(Uniform8BitCodec.name, Uniform8BitCodec)
register_codec(Quantile8BitCodec.name, Quantile8BitCodec)
