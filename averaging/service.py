"""The ``Averaging`` gRPC servicer: routes each RPC to the component that owns it.

``JoinGroup`` goes to matchmaking, ``Reduce`` to the all-reduce service, ``DownloadState``
to state sharing. The servicer holds no state of its own; before
:meth:`~swarmavg.averaging.averager.Averager.start` (and after shutdown) every call is
refused with ``UNAVAILABLE``. ``JoinGroup`` and ``DownloadState`` first pass a per-source
rate limit (dht/ratelimit.py, the same one the DHT service uses): a flood gets
``RESOURCE_EXHAUSTED`` before any component works for it. ``Reduce`` streams belong to a
formed group and are bounded by the all-reduce service itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.allreduce.wire import Request, deserialize_request, serialize_pieces
from swarmavg.averaging.matchmaking.matchmaker import Matchmaker
from swarmavg.averaging.state.sharer import StateSharer
from swarmavg.dht.ranges import grpc_peer_host, limited_range
from swarmavg.dht.ratelimit import RateLimiter, RateLimits
from swarmavg.proto import averaging_pb2, averaging_pb2_grpc, common_pb2

Components = tuple[Matchmaker, AllReduceService, StateSharer]


class AveragingServicer(averaging_pb2_grpc.AveragingServicer):
    """Adapter from the generated servicer to the averager's components."""

    def __init__(
        self,
        components: Callable[[], Components | None],
        rate_limits: RateLimits | None = None,
    ) -> None:
        self._components = components
        self.rate_limiter = RateLimiter(rate_limits or RateLimits())

    async def _admit(
        self, header: common_pb2.RequestHeader, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Refuse the request with RESOURCE_EXHAUSTED when its source is over its rate.

        Keyed by the claimed peer id (checked later by the component) and by the address
        range it connects from; loopback and private ranges have no range budget.
        """
        host = grpc_peer_host(context.peer())
        refusal = self.rate_limiter.admit(
            bytes(header.peer_id), limited_range(host, False) if host else None
        )
        if refusal is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)

    async def _get(self, context: grpc.aio.ServicerContext[Any, Any]) -> Components:
        found = self._components()
        if found is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "averager is not running")
            raise AssertionError("unreachable: abort raises")
        return found

    async def JoinGroup(
        self, request: averaging_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[averaging_pb2.JoinResponse]:
        await self._admit(request.header, context)
        matchmaker, _, _ = await self._get(context)
        async for response in matchmaker.rpc_join_group(request, context):
            yield response

    async def Reduce(  # raw wire messages: see add_to_server
        self,
        request_iterator: AsyncIterator[Request],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        _, allreduce, _ = await self._get(context)
        await allreduce.rpc_reduce(request_iterator, context)

    async def DownloadState(
        self, request: averaging_pb2.StateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        await self._admit(request.header, context)
        _, _, sharer = await self._get(context)
        await sharer.rpc_download_state(request, context)


def reduce_method_handler(
    behavior: Callable[[AsyncIterator[Request], grpc.aio.ServicerContext[Any, Any]], Any],
) -> grpc.RpcMethodHandler:
    """The ``Reduce`` handler: requests scanned in place, replies joined from their
    prebuilt wire pieces."""
    return grpc.stream_stream_rpc_method_handler(
        behavior, request_deserializer=deserialize_request, response_serializer=serialize_pieces
    )


def add_reduce_to_server(service: AllReduceService, server: grpc.aio.Server) -> None:
    """Serve only ``Reduce``, by ``service`` (a reducer without matchmaking: tests, benchmarks)."""
    handlers = {"Reduce": reduce_method_handler(service.rpc_reduce)}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarmavg.v1.Averaging", handlers),)
    )
    server.add_registered_method_handlers("swarmavg.v1.Averaging", handlers)


def add_to_server(servicer: AveragingServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server`` (before the server starts).

    ``Reduce`` carries the bulk of a round's bytes, so its messages skip the generated
    classes: requests are scanned in place and replies are written as prebuilt wire
    bytes (:mod:`~swarmavg.averaging.allreduce.wire`). The wire format is unchanged.
    """
    handlers = {
        "JoinGroup": grpc.unary_stream_rpc_method_handler(
            servicer.JoinGroup,
            request_deserializer=averaging_pb2.JoinRequest.FromString,
            response_serializer=averaging_pb2.JoinResponse.SerializeToString,
        ),
        "Reduce": reduce_method_handler(servicer.Reduce),
        "DownloadState": grpc.unary_stream_rpc_method_handler(
            servicer.DownloadState,
            request_deserializer=averaging_pb2.StateRequest.FromString,
            response_serializer=averaging_pb2.StateResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarmavg.v1.Averaging", handlers),)
    )
    server.add_registered_method_handlers("swarmavg.v1.Averaging", handlers)
