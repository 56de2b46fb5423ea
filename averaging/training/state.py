"""Training state <-> (metadata bytes, list of arrays): what peers publish to late joiners.

``client.publish_state(tensors, metadata)`` (docs/peer.md) carries a flat list of arrays and
one bytes blob. A training state is the model's parameters, one or two optimizers' state
dicts and a few numbers (epoch, ...). This module flattens it: every tensor goes into the
list (0-d tensors as one-element arrays, so the daemon only sees ordinary arrays), every
other value into msgpack metadata together with where each tensor goes back. No pickle:
the metadata comes from another peer, so :func:`unpack_state` checks it before use.

torch is imported inside the functions only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

if TYPE_CHECKING:
    import torch

FORMAT = "swarmavg.training-state.v1"
MAX_METADATA_BYTES = 16 << 20
RUN_EXTRA = "run"
"""The key of ``TrainingState.extra`` that names the training run which published it."""


class StateFormatError(ValueError):
    """A published state does not match what this process expects (other model or format)."""


@dataclass
class TrainingState:
    """What a training wrapper publishes.

    Attributes:
        kind: which wrapper wrote it (a joiner refuses another wrapper's state).
        epoch: the global step the state belongs to.
        params: the model parameters, in ``param_groups`` order.
        optimizers: name -> ``optimizer.state_dict()``.
        extra: small msgpack-able numbers (counters, flags).
    """

    kind: str
    epoch: int
    params: list[torch.Tensor]
    optimizers: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def training_run(self) -> str | None:
        """The training run that published this state; None when it does not say."""
        run = self.extra.get(RUN_EXTRA)
        return run if isinstance(run, str) else None


def pack_state(state: TrainingState) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Flatten ``state`` to ``(metadata, arrays)`` for ``client.publish_state``.

    The metadata is a msgpack-able dict (the client msgpacks it). Arrays are copies (the
    caller may keep training while the daemon serves them).
    """
    arrays: list[np.ndarray] = []
    param_refs = [_add_tensor(arrays, p) for p in state.params]
    optimizers = {name: _pack_value(sd, arrays) for name, sd in state.optimizers.items()}
    metadata = {
        "format": FORMAT,
        "kind": state.kind,
        "epoch": state.epoch,
        "params": param_refs,
        "optimizers": optimizers,
        "extra": state.extra,
    }
    return metadata, arrays


def unpack_state(
    metadata: object, arrays: Sequence[np.ndarray], *, kind: str, like: Sequence[torch.Tensor]
) -> TrainingState:
    """Rebuild a :class:`TrainingState` published by :func:`pack_state`.

    Args:
        metadata, arrays: what ``client.load_state`` returned (metadata as the decoded
            msgpack object, or its raw bytes).
        kind: the wrapper kind this process expects.
        like: this process's parameters; the loaded ones must match their shapes.

    Raises:
        StateFormatError: unknown format, another kind, mismatched parameter shapes, or
            references to arrays that do not exist.
    """
    meta = metadata
    if isinstance(metadata, bytes | bytearray):
        if len(metadata) > MAX_METADATA_BYTES:
            raise StateFormatError(f"state metadata of {len(metadata)} bytes is too large")
        try:
            meta = msgpack.unpackb(metadata, raw=False, strict_map_key=False)
        except (ValueError, msgpack.exceptions.ExtraData) as exc:
            raise StateFormatError(f"state metadata is not msgpack: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateFormatError("state metadata has an unknown format")
    if meta.get("kind") != kind:
        raise StateFormatError(f"state was published by {meta.get('kind')!r}, expected {kind!r}")
    epoch = meta.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise StateFormatError(f"state has an invalid epoch {epoch!r}")
    refs = meta.get("params")
    if not isinstance(refs, list) or len(refs) != len(like):
        raise StateFormatError(
            f"state holds {len(refs) if isinstance(refs, list) else '?'} parameters, "
            f"this model has {len(like)}"
        )
    params = []
    for i, (ref, mine) in enumerate(zip(refs, like, strict=True)):
        tensor = _unpack_tensor(ref, arrays)
        if tuple(tensor.shape) != tuple(mine.shape):
            raise StateFormatError(
                f"parameter {i} has shape {tuple(tensor.shape)} in the state, "
                f"{tuple(mine.shape)} here"
            )
        params.append(tensor.to(dtype=mine.dtype))
    optimizers_raw = meta.get("optimizers")
    if not isinstance(optimizers_raw, dict):
        raise StateFormatError("state has no optimizer section")
    optimizers = {str(k): _unpack_value(v, arrays) for k, v in optimizers_raw.items()}
    extra = meta.get("extra")
    return TrainingState(
        kind=kind,
        epoch=epoch,
        params=params,
        optimizers={k: v for k, v in optimizers.items() if isinstance(v, dict)},
        extra=extra if isinstance(extra, dict) else {},
    )


# A tensor is stored as {"__t": index, "shape": [...], "dtype": "float32"}; maps keep
# their key types through msgpack (optimizer state is keyed by int parameter index).
_TENSOR = "__t"
_TUPLE = "__tuple"
_MAP = "__map"


def _add_tensor(arrays: list[np.ndarray], tensor: torch.Tensor) -> dict[str, Any]:
    import torch

    t = tensor.detach().to("cpu")
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)  # widened for transport; restored from "dtype" on load
    array = np.array(t.numpy(), copy=True).reshape(-1 if t.dim() == 0 else t.shape)
    arrays.append(array)
    return {_TENSOR: len(arrays) - 1, "shape": list(tensor.shape), "dtype": dtype}


def _unpack_tensor(ref: object, arrays: Sequence[np.ndarray]) -> torch.Tensor:
    import torch

    if not isinstance(ref, dict) or not isinstance(ref.get(_TENSOR), int):
        raise StateFormatError("malformed tensor reference in state metadata")
    index, shape, dtype_name = ref[_TENSOR], ref.get("shape"), ref.get("dtype")
    if not 0 <= index < len(arrays):
        raise StateFormatError(f"state refers to array {index} of {len(arrays)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise StateFormatError("malformed tensor shape in state metadata")
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise StateFormatError(f"unknown tensor dtype {dtype_name!r} in state metadata")
    array = np.asarray(arrays[index])
    if array.size != math.prod(shape):
        raise StateFormatError(f"array {index} has {array.size} elements, expected {shape}")
    return torch.from_numpy(np.array(array, copy=True)).reshape(shape).to(dtype)


def _pack_value(value: Any, arrays: list[np.ndarray]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return _add_tensor(arrays, value)
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _pack_value(v, arrays) for k, v in value.items()}
        # The client decodes with msgpack's strict_map_key: non-str keys travel as pairs.
        return {_MAP: [[_pack_value(k, arrays), _pack_value(v, arrays)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {_TUPLE: [_pack_value(v, arrays) for v in value]}
    if isinstance(value, list):
        return [_pack_value(v, arrays) for v in value]
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    raise TypeError(f"cannot publish a value of type {type(value).__name__} in training state")


def _unpack_value(value: Any, arrays: Sequence[np.ndarray]) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value:
            return _unpack_tensor(value, arrays)
        if _MAP in value and isinstance(value[_MAP], list):
            pairs = [p for p in value[_MAP] if isinstance(p, list) and len(p) == 2]
            return {_hashable(_unpack_value(k, arrays)): _unpack_value(v, arrays) for k, v in pairs}
        if _TUPLE in value and isinstance(value[_TUPLE], list):
            return tuple(_unpack_value(v, arrays) for v in value[_TUPLE])
        return {k: _unpack_value(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpack_value(v, arrays) for v in value]
    return value


def _hashable(key: Any) -> Any:
    if isinstance(key, str | int | float | bool | bytes | tuple) or key is None:
        return key
    raise StateFormatError(f"state metadata has an unusable map key of type {type(key).__name__}")


__all__ = ["FORMAT", "RUN_EXTRA", "StateFormatError", "TrainingState", "pack_state", "unpack_state"]
