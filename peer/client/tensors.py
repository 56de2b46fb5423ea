"""Tensors between a training process and its daemon: type conversion and byte framing.

The client accepts torch tensors or numpy arrays and returns the same kind. torch is
imported only when the caller's input is a torch tensor (detected by module name), so the
daemon and numpy-only users never load it. CUDA tensors are copied to the CPU and their
results moved back to the same device.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from swarmavg.compression.dtypes import bfloat16, is_bfloat16
from swarmavg.peer.client.errors import ValidationError
from swarmavg.peer.client.validation import (
    MAX_TOTAL_BYTES,
    dtype_from_proto,
    dtype_to_proto,
    validate_layout,
)
from swarmavg.proto import control_pb2

CHUNK_BYTES = 1 << 20
"""Bytes per TensorBytes message (well under gRPC's 4 MiB message cap)."""


@dataclass(frozen=True)
class Origin:
    """Where an input tensor came from, to give the result back in the same form."""

    is_torch: bool
    torch_dtype: Any = None
    device: Any = None


def _is_torch_tensor(value: object) -> bool:
    return type(value).__module__.startswith("torch") and "torch" in sys.modules


def to_numpy(tensors: object) -> tuple[list[np.ndarray], list[Origin]]:
    """Convert inputs to C-contiguous numpy arrays (copies only what must be copied).

    Raises:
        ValidationError: not a list/tuple, an element that is neither a numpy array nor
            a torch tensor, or an unsupported dtype.
    """
    if isinstance(tensors, np.ndarray) or not isinstance(tensors, list | tuple):
        raise ValidationError("tensors must be a list (or tuple) of arrays/tensors")
    arrays: list[np.ndarray] = []
    origins: list[Origin] = []
    for i, value in enumerate(tensors):
        if isinstance(value, np.ndarray):
            arrays.append(np.ascontiguousarray(value))
            origins.append(Origin(is_torch=False))
        elif _is_torch_tensor(value):
            array, origin = _torch_to_numpy(value, i)
            arrays.append(array)
            origins.append(origin)
        else:
            raise ValidationError(
                f"tensor {i}: expected a numpy.ndarray or torch.Tensor, got {type(value).__name__}"
            )
    return arrays, origins


def _torch_to_numpy(tensor: Any, index: int) -> tuple[np.ndarray, Origin]:
    import torch  # the input already is a torch tensor, so torch is loaded anyway

    t = tensor.detach()
    origin = Origin(is_torch=True, torch_dtype=t.dtype, device=t.device)
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        array = t.view(torch.int16).numpy().view(bfloat16())
    elif t.dtype in (torch.float32, torch.float16, torch.float64):
        array = t.numpy()
    else:
        raise ValidationError(
            f"tensor {index}: unsupported dtype {t.dtype}; supported: torch.float32, "
            "torch.float16, torch.bfloat16, torch.float64"
        )
    return array, origin


def from_numpy(arrays: Sequence[np.ndarray], origins: Sequence[Origin]) -> list[Any]:
    """Give results back in the inputs' form (torch dtype and device, or numpy)."""
    out: list[Any] = []
    for array, origin in zip(arrays, origins, strict=True):
        if not origin.is_torch:
            out.append(array)
            continue
        import torch

        if is_bfloat16(array.dtype):
            tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(array)
        if origin.device is not None and origin.device.type != "cpu":
            tensor = tensor.to(origin.device)
        out.append(tensor)
    return out


def _byte_view(array: np.ndarray) -> memoryview:
    """The raw bytes of a C-contiguous array, without a copy."""
    data: Any = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return memoryview(data)


def specs_of(arrays: Sequence[np.ndarray]) -> list[control_pb2.TensorSpec]:
    """The wire layout of ``arrays`` (dtypes must already be validated)."""
    return [
        control_pb2.TensorSpec(
            dtype=dtype_to_proto(a.dtype, f"tensor {i}"),  # type: ignore[arg-type]
            shape=a.shape,
        )
        for i, a in enumerate(arrays)
    ]


def layout_from_specs(
    specs: Sequence[control_pb2.TensorSpec],
) -> tuple[list[np.dtype[np.generic]], list[tuple[int, ...]], int]:
    """Validate a received layout; return dtypes, shapes and the total byte size."""
    dtypes = [dtype_from_proto(s.dtype, f"tensor {i}") for i, s in enumerate(specs)]
    shapes = [tuple(int(d) for d in s.shape) for s in specs]
    total = validate_layout(dtypes, shapes)
    return dtypes, shapes, total


def iter_bytes(
    arrays: Sequence[np.ndarray], chunk: int = CHUNK_BYTES
) -> Iterator[control_pb2.TensorBytes]:
    """Frame the arrays' raw bytes as TensorBytes messages of at most ``chunk`` bytes."""
    for index, array in enumerate(arrays):
        flat = _byte_view(array)
        for offset in range(0, len(flat), chunk):
            yield control_pb2.TensorBytes(
                index=index, offset=offset, data=bytes(flat[offset : offset + chunk])
            )


class TensorAssembler:
    """Rebuilds arrays from TensorBytes messages, checking every piece before copying it.

    Allocation happens once, from a layout that ``layout_from_specs`` has capped. The
    pieces of each tensor must arrive in order (as ``iter_bytes`` sends them).
    """

    def __init__(self, dtypes: Sequence[np.dtype[np.generic]], shapes: Sequence[tuple[int, ...]]):
        self.arrays = [np.empty(shape, dtype) for dtype, shape in zip(dtypes, shapes, strict=True)]
        self._views = [_byte_view(a) for a in self.arrays]
        self._missing = sum(a.nbytes for a in self.arrays)
        self._filled = [0] * len(self.arrays)

    def add(self, piece: control_pb2.TensorBytes) -> None:
        """Copy one piece in place.

        Raises:
            ValidationError: unknown tensor index, out-of-range bytes, or more bytes than
                the layout holds.
        """
        if piece.index >= len(self._views):
            raise ValidationError(f"tensor bytes for unknown tensor {piece.index}")
        view = self._views[piece.index]
        if piece.offset != self._filled[piece.index]:
            raise ValidationError(f"tensor {piece.index}: bytes out of order")
        end = piece.offset + len(piece.data)
        if end > len(view):
            raise ValidationError(f"tensor {piece.index}: bytes beyond its size")
        self._filled[piece.index] = end
        view[piece.offset : end] = piece.data
        self._missing -= len(piece.data)

    @property
    def complete(self) -> bool:
        return self._missing == 0

    def finish(self) -> list[np.ndarray]:
        """The arrays; ``ValidationError`` when bytes are missing."""
        if not self.complete:
            raise ValidationError(f"tensor bytes incomplete: {self._missing} bytes missing")
        return self.arrays


__all__ = [
    "CHUNK_BYTES",
    "MAX_TOTAL_BYTES",
    "Origin",
    "TensorAssembler",
    "from_numpy",
    "iter_bytes",
    "layout_from_specs",
    "specs_of",
    "to_numpy",
]
