"""The ``Averaging`` gRPC servicer: routes each RPC to the component that owns it.

``JoinGroup`` goes to matchmaking, ``Reduce`` to the all-reduce service, ``DownloadState``
to state sharing. The servicer holds no state of its own; before
:meth:`~swarmavg.averaging.averager.Averager.start` (and after shutdown) every call is
refused with ``UNAVAILABLE``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from swarmavg.proto import averaging_pb2, averaging_pb2_grpc

if TYPE_CHECKING:  # the components import this module for the outbound call helpers
    from swarmavg.averaging.matchmaking import Matchmaker
    from swarmavg.averaging.reduce_service import AllReduceService
    from swarmavg.averaging.state_sharing import StateSharer

Components = tuple["Matchmaker", "AllReduceService", "StateSharer"]

_SERVICE = "/swarmavg.v1.Averaging/"


def join_group_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """Outbound ``JoinGroup`` on ``channel`` (typed; the generated stub is not)."""
    return channel.unary_stream(
        _SERVICE + "JoinGroup",
        request_serializer=averaging_pb2.JoinRequest.SerializeToString,
        response_deserializer=averaging_pb2.JoinResponse.FromString,
    )


def download_state_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """Outbound ``DownloadState`` on ``channel``."""
    return channel.unary_stream(
        _SERVICE + "DownloadState",
        request_serializer=averaging_pb2.StateRequest.SerializeToString,
        response_deserializer=averaging_pb2.StateResponse.FromString,
    )


class AveragingServicer(averaging_pb2_grpc.AveragingServicer):
    """Adapter from the generated servicer to the averager's components."""

    def __init__(self, components: Callable[[], Components | None]) -> None:
        self._components = components

    async def _get(self, context: grpc.aio.ServicerContext[Any, Any]) -> Components:
        found = self._components()
        if found is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "averager is not running")
            raise AssertionError("unreachable: abort raises")
        return found

    async def JoinGroup(
        self, request: averaging_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[averaging_pb2.JoinResponse]:
        matchmaker, _, _ = await self._get(context)
        async for response in matchmaker.rpc_join_group(request, context):
            yield response

    async def Reduce(
        self,
        request_iterator: AsyncIterator[averaging_pb2.ReduceRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        _, allreduce, _ = await self._get(context)
        await allreduce.rpc_reduce(request_iterator, context)

    async def DownloadState(
        self, request: averaging_pb2.StateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[averaging_pb2.StateResponse]:
        _, _, sharer = await self._get(context)
        async for response in sharer.rpc_download_state(request, context):
            yield response


def add_to_server(servicer: AveragingServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server`` (before the server starts)."""
    averaging_pb2_grpc.add_AveragingServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
