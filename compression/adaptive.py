"""Adaptive selectors: codecs that pick another codec per tensor.

A selector encodes with the codec it picks, and the message carries *that* codec's name,
so receivers decode it like any other message. Non-floating tensors always go through
``none`` (no lossy codec takes integers).

- ``size-adaptive`` (:class:`SizeAdaptiveCodec`): small tensors (biases, norms: cheap to
  send, sensitive to error) in ``float16``, large ones in ``uint8-blockwise``.
- ``role-adaptive`` (:class:`RoleAdaptiveCodec`): gradients in ``uint8-blockwise``,
  parameters in ``float16``, optimizer state in ``scaled-float16`` (Adam's second moments
  are tiny and would underflow plain float16), other tensors in ``float16``.
- :class:`KeyAdaptiveCodec`: per tensor key, by glob pattern, first match wins; built in
  code since it needs the caller's rules.
"""

from __future__ import annotations

import fnmatch
from abc import abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np

from swarmavg.compression.base import Buffer, Codec, CodecInfo, Encoded, Header, Role
from swarmavg.compression.blockwise import Blockwise8BitCodec
from swarmavg.compression.dtypes import FLOATING, normalize_dtype
from swarmavg.compression.errors import CodecError
from swarmavg.compression.floating import Float16Codec, NoneCodec, ScaledFloat16Codec

__all__ = ["KeyAdaptiveCodec", "RoleAdaptiveCodec", "SelectorCodec", "SizeAdaptiveCodec"]

_NONE = NoneCodec()


class SelectorCodec(Codec):
    """A codec that delegates each tensor to a codec it selects."""

    @abstractmethod
    def select_floating(self, array: np.ndarray, info: CodecInfo) -> Codec:
        """The codec for a floating-point tensor."""

    @abstractmethod
    def choices(self) -> list[Codec]:
        """Every codec this selector may pick (besides ``none`` for integers)."""

    def select(self, array: np.ndarray, info: CodecInfo) -> Codec:
        """The codec that will encode ``array`` (``none`` for non-floating dtypes)."""
        if normalize_dtype(np.asarray(array).dtype) not in FLOATING:
            return _NONE
        return self.select_floating(array, info)

    def accepts(self, codec_name: str) -> bool:
        return codec_name == _NONE.name or any(c.accepts(codec_name) for c in self.choices())

    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        return self.select(array, info).encode_payload(array, info)

    def encode_payload_and_values(
        self, array: np.ndarray, info: CodecInfo
    ) -> tuple[Encoded, np.ndarray]:
        return self.select(array, info).encode_payload_and_values(array, info)

    def round_trip(self, array: np.ndarray, info: CodecInfo) -> np.ndarray:
        return self.select(array, info).round_trip(array, info)

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        return self._decoder(header).decode_payload(header, payload)

    def decode_payload_into(self, header: Header, payload: Buffer, out: np.ndarray) -> None:
        self._decoder(header).decode_payload_into(header, payload, out)

    @staticmethod
    def _decoder(header: Header) -> Codec:
        """The codec a message names (never a selector: messages name what was picked)."""
        from swarmavg.compression.registry import decoder_for  # registry imports this module

        decoder = decoder_for(header.codec)
        if isinstance(decoder, SelectorCodec):
            raise CodecError(
                f"{header.codec!r} is a selector; a message names the codec it selected"
            )
        return decoder


class SizeAdaptiveCodec(SelectorCodec):
    """``small`` for tensors of fewer than ``threshold`` elements, else ``large``."""

    name = "size-adaptive"

    def __init__(
        self, threshold: int = 1 << 16, small: Codec | None = None, large: Codec | None = None
    ) -> None:
        if threshold < 0:
            raise ValueError("threshold must be >= 0")
        self.threshold = threshold
        self.small = small if small is not None else Float16Codec()
        self.large = large if large is not None else Blockwise8BitCodec()

    def select_floating(self, array: np.ndarray, info: CodecInfo) -> Codec:
        return self.small if np.size(array) < self.threshold else self.large

    def choices(self) -> list[Codec]:
        return [self.small, self.large]


class RoleAdaptiveCodec(SelectorCodec):
    """One codec per :class:`Role`; roles missing from ``by_role`` use ``default``."""

    name = "role-adaptive"

    def __init__(
        self, by_role: Mapping[Role, Codec] | None = None, default: Codec | None = None
    ) -> None:
        self.by_role: dict[Role, Codec] = (
            dict(by_role)
            if by_role is not None
            else {
                Role.GRADIENT: Blockwise8BitCodec(),
                Role.PARAMETER: Float16Codec(),
                Role.OPTIMIZER_STATE: ScaledFloat16Codec(),
            }
        )
        self.default = default if default is not None else Float16Codec()

    def select_floating(self, array: np.ndarray, info: CodecInfo) -> Codec:
        return self.by_role.get(info.role, self.default)

    def choices(self) -> list[Codec]:
        return [*self.by_role.values(), self.default]


class KeyAdaptiveCodec(SelectorCodec):
    """The codec of the first ``(glob pattern, codec)`` rule matching ``info.key``."""

    name = "key-adaptive"

    def __init__(self, rules: Sequence[tuple[str, Codec]], default: Codec) -> None:
        self.rules = list(rules)
        self.default = default

    def select_floating(self, array: np.ndarray, info: CodecInfo) -> Codec:
        for pattern, codec in self.rules:
            if fnmatch.fnmatchcase(info.key, pattern):
                return codec
        return self.default

    def choices(self) -> list[Codec]:
        return [c for _, c in self.rules] + [self.default]
