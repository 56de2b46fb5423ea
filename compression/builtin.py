"""Registers the built-in codecs under their names (imported by the package)."""

from __future__ import annotations

from collections.abc import Callable

from swarmavg.compression.adaptive import RoleAdaptiveCodec, SizeAdaptiveCodec
from swarmavg.compression.base import Codec
from swarmavg.compression.blockwise import Blockwise4BitCodec, Blockwise8BitCodec
from swarmavg.compression.floating import (
    BFloat16Codec,
    Float16Codec,
    NoneCodec,
    ScaledFloat16Codec,
)
from swarmavg.compression.lossless import WRAPPERS, LosslessCodec
from swarmavg.compression.quantization import Quantile8BitCodec, Uniform8BitCodec
from swarmavg.compression.registry import register_codec, register_wrapper
from swarmavg.compression.sparseloco import SparseLoCoCodec
from swarmavg.compression.topk import TopKCodec

for _codec in (
    NoneCodec,
    Float16Codec,
    BFloat16Codec,
    ScaledFloat16Codec,
    Uniform8BitCodec,
    Quantile8BitCodec,
    Blockwise8BitCodec,
    Blockwise4BitCodec,
    TopKCodec,
    SparseLoCoCodec,
    SizeAdaptiveCodec,
    RoleAdaptiveCodec,
):
    register_codec(_codec.name, _codec)


def _wrapper(kind: str) -> Callable[[Codec], Codec]:
    def wrap(inner: Codec) -> Codec:
        return LosslessCodec(kind, inner)

    return wrap


for _kind in WRAPPERS:
    register_wrapper(_kind, _wrapper(_kind))
