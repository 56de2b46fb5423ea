"""Codecs by name, and self-describing decoding of any message.

Names (see docs/compression.md):

- plain codecs: ``none``, ``float16``, ``bfloat16``, ``scaled-float16``, ``uint8-uniform``,
  ``uint8-quantile``, ``uint8-blockwise``, ``uint4-blockwise``, ``topk``;
- lossless wrappers: ``zstd+<codec>`` and ``lz4+<codec>`` compress the payload of the
  inner codec (for example ``zstd+uint8-blockwise``, ``lz4+topk``); one wrapper at most;
- adaptive selectors: ``size-adaptive``, ``role-adaptive``.

Messages carry the name of the codec that actually produced them (a selector writes its
chosen codec's name), so :func:`decode_chunk` needs nothing but the message.
"""

from __future__ import annotations

import collections
import difflib
import inspect
import threading
from collections.abc import Callable

import numpy as np

from swarmavg.compression.base import DEFAULT_MAX_ELEMENTS, Codec, parse_header_with, writable
from swarmavg.compression.errors import CodecError
from swarmavg.proto import tensor_pb2

__all__ = [
    "canonical_name",
    "decode_chunk",
    "decoder_for",
    "get_codec",
    "known_codecs",
    "parse_spec",
    "register_codec",
]

_factories: dict[str, Callable[..., Codec]] = {}
_wrappers: dict[str, Callable[[Codec], Codec]] = {}
# Decoders by the codec name a message carries, which a peer chooses: bounded (LRU), so
# that a flood of spellings ("topk:fraction=0.0001", ...) cannot grow it.
_decoders: collections.OrderedDict[str, Codec] = collections.OrderedDict()
MAX_DECODERS = 64
_lock = threading.Lock()


def register_codec(name: str, factory: Callable[..., Codec]) -> None:
    """Register a codec factory under ``name`` (a new name; ``+`` and ``:`` are reserved).

    The factory is called with no arguments, or with the keyword parameters of a
    ``name:key=value,...`` spec.
    """
    if not name or "+" in name or ":" in name:
        raise ValueError(f"invalid codec name {name!r}")
    with _lock:
        if name in _factories:
            raise ValueError(f"codec {name!r} is already registered")
        _factories[name] = factory


def register_wrapper(prefix: str, factory: Callable[[Codec], Codec]) -> None:
    """Register a wrapper usable as ``<prefix>+<codec>``."""
    with _lock:
        _wrappers[prefix] = factory


def known_codecs() -> list[str]:
    """Names accepted by :func:`get_codec` (wrappers shown as ``prefix+<codec>``)."""
    return sorted(_factories) + sorted(f"{p}+<codec>" for p in _wrappers)


def parse_spec(spec: str, what: str = "codec") -> tuple[str, dict[str, int | float | str]]:
    """Split a ``name:key=value,...`` spec into its name and its parameters.

    Values become ``int`` or ``float`` where they parse as one, else stay strings. Used for
    codec names and, with the same syntax, for other names with parameters (the
    averaging layer's aggregation rules).

    Raises:
        ValueError: a parameter without ``=`` or without a key; the message names ``what``.
    """
    base, colon, text = spec.partition(":")
    if not colon:
        return base, {}
    params: dict[str, int | float | str] = {}
    for item in text.split(","):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad {what} parameter {item!r} in {spec!r}; use name:key=value,...")
        value: int | float | str = raw.strip()
        for convert in (int, float):
            try:
                value = convert(raw)
                break
            except ValueError:
                continue
        params[key.strip()] = value
    return base, params


def _build(spec: str) -> Codec | None:
    base, colon, _ = spec.partition(":")
    factory = _factories.get(base)
    if factory is None:
        return None
    if not colon:
        return factory()
    _, params = parse_spec(spec)
    taken = _parameters_of(factory)
    unknown = sorted(set(params) - set(taken)) if taken is not None else []
    if taken is not None and unknown:
        takes = f"it takes {', '.join(taken)}" if taken else "it takes none"
        raise ValueError(f"codec {base!r} does not take parameters {unknown}: {takes}")
    try:
        return factory(**params)
    except TypeError as exc:
        raise ValueError(f"codec {base!r}: bad parameters {sorted(params)}: {exc}") from None


def _parameters_of(factory: Callable[..., Codec]) -> list[str] | None:
    """The keyword parameters a codec factory takes; None when it cannot say (no
    signature, or ``**kwargs``): the factory itself then judges them."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return [
        name
        for name, p in signature.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def _did_you_mean(name: str) -> str:
    """`` (did you mean 'float16'?)`` for a near miss (``fp16``), else empty."""
    base = name.partition(":")[0]
    wrapper, plus, inner = base.partition("+")
    candidates = sorted(_factories)
    guess = difflib.get_close_matches(inner if plus else base, candidates, n=1, cutoff=0.5)
    if not guess:
        return ""
    return f" (did you mean {(wrapper + '+' if plus else '') + guess[0]!r}?)"


def get_codec(name: str) -> Codec:
    """Return a new codec instance for ``name``.

    ``name`` is a registered name, optionally with constructor parameters
    (``"topk:fraction=0.05"``, ``"uint8-blockwise:block=1024"``), optionally behind one
    lossless wrapper (``"zstd+topk:fraction=0.05"``). Messages always carry the plain
    codec name; parameters needed for decoding travel in the message's meta.

    Stateful codecs (``topk``) keep their error-feedback state in the returned instance:
    keep the instance across rounds (one per averaged tensor stream); a fresh instance
    starts with no residuals.

    Raises:
        ValueError: unknown name or bad parameters; the message lists the known names.
    """
    prefix, plus, inner = name.partition("+")
    with _lock:
        if plus:
            wrapper = _wrappers.get(prefix)
            inner_codec = _build(inner) if wrapper is not None else None
            if wrapper is not None and inner_codec is not None:
                return wrapper(inner_codec)
        else:
            codec = _build(name)
            if codec is not None:
                return codec
    raise ValueError(
        f"unknown codec {name!r}{_did_you_mean(name)}; known: {', '.join(known_codecs())}"
    )


def decoder_for(name: str) -> Codec:
    """A shared instance that decodes messages labelled ``name``.

    Raises:
        CodecError: no codec of that name.
    """
    with _lock:
        codec = _decoders.get(name)
        if codec is not None:
            _decoders.move_to_end(name)
            return codec
    try:
        codec = get_codec(name)
    except ValueError as e:
        raise CodecError(str(e)) from None
    with _lock:
        codec = _decoders.setdefault(name, codec)
        while len(_decoders) > MAX_DECODERS:
            _decoders.popitem(last=False)
    return codec


def cached_decoders() -> int:
    """How many shared decoders :func:`decoder_for` holds now (at most :data:`MAX_DECODERS`)."""
    return len(_decoders)


def canonical_name(name: str) -> str:
    """One spelling per codec: ``name`` with its parameters parsed, sorted and printed
    back (``"topk:fraction=0.050"`` and ``"topk:fraction=5e-2"`` give
    ``"topk:fraction=0.05"``), so that caches keyed by a peer's spelling hold one entry
    per distinct codec.

    Raises:
        ValueError: malformed parameters.
    """
    prefix, plus, inner = name.partition("+")
    if plus:
        return f"{prefix.strip()}+{canonical_name(inner)}"
    base, params = parse_spec(name)
    if not params:
        return base.strip()
    return base.strip() + ":" + ",".join(f"{k}={params[k]!r}" for k in sorted(params))


def decode_chunk(
    message: tensor_pb2.TensorChunk, *, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> np.ndarray:
    """Decode any complete message with the codec it names.

    Args:
        message: one complete (not split) TensorChunk.
        max_elements: refuse messages declaring more elements than this.

    Returns:
        A writable array of the original dtype and shape.

    Raises:
        CodecError: unknown codec or malformed message.
    """
    buffer = message.buffer  # read once: each read of a bytes field copies it
    header = parse_header_with(message, buffer, max_elements)
    return writable(decoder_for(header.codec).decode_payload(header, buffer))
