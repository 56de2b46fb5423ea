"""``Average`` calls that bypass the client library: what a client that skips its checks
could send a daemon (tests of the daemon's own defences)."""

from __future__ import annotations

import grpc
import numpy as np

from swarmavg.peer.client import shm
from swarmavg.proto import control_pb2, control_pb2_grpc, tensor_pb2


async def unchecked_shm_call(
    endpoint: str,
    values: list[np.ndarray],
    *,
    key: str,
    timeout: float = 5.0,
    **start: object,
) -> grpc.aio.AioRpcError | None:
    """One ``Average`` call over the unix socket ``endpoint`` with float32 ``values``
    written into a fresh shared-memory segment unchecked; ``start`` sets further
    ``AverageStart`` fields (``inputs_checked=True``, ``group_size=3``, ...). Returns the
    error the daemon answered with, ``None`` if the call succeeded."""
    dtypes = [v.dtype for v in values]
    shapes = [v.shape for v in values]
    segment = shm.ClientSegment(shm.segment_layout(dtypes, shapes)[1])
    try:
        for view, v in zip(segment.results(dtypes, shapes), values, strict=True):
            view[...] = v  # bypasses the client's checked copy
        fields: dict[str, object] = {"weight": 1, "min_group_size": 1, **start}
        message = control_pb2.AverageStart(
            key=key,
            timeout=timeout,
            shm_name=segment.name,
            shm_size=segment.size,
            tensors=[
                control_pb2.TensorSpec(dtype=tensor_pb2.FLOAT32, shape=v.shape) for v in values
            ],
            **fields,
        )
        async with grpc.aio.insecure_channel(f"unix:{endpoint}") as channel:
            stub = control_pb2_grpc.ControlStub(channel)
            try:
                async for _ in stub.Average(
                    iter([control_pb2.AverageRequest(start=message)]), timeout=timeout + 10
                ):
                    pass
            except grpc.aio.AioRpcError as error:
                return error
        return None
    finally:
        segment.unlink()
