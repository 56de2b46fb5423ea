"""The ``Averaging`` gRPC servicer: routes each RPC to the component that owns it.

``JoinGroup`` goes to matchmaking, ``Reduce`` to the all-reduce service, ``DownloadState``
to state sharing. The servicer holds no state of its own; before
:meth:`~swarmavg.averaging.averager.Averager.start` (and after shutdown) every call is
refused with ``UNAVAILABLE``. ``JoinGroup`` and ``DownloadState`` first pass rate limits
(dht/ratelimit.py, as the DHT service does): their address range's, from the connection,
before anything else; then, once the request's signature verified, the verified sender's.
Over either a request gets ``RESOURCE_EXHAUSTED`` before any component works for it. The id
is never taken from the header before the signature checks out: a limit keyed by a claimed
id let anyone throttle the peer it named. ``Reduce`` streams belong to a formed
group and are bounded by the all-reduce service itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.allreduce.wire import Request, deserialize_request, serialize_pieces
from swarmavg.averaging.matchmaking.matchmaker import Matchmaker
from swarmavg.averaging.state.sharer import StateSharer
from swarmavg.averaging.stubs import DOWNLOAD_STATE, JOIN_GROUP
from swarmavg.dht.auth import AuthenticationError, message_digest
from swarmavg.dht.identity import HeaderError
from swarmavg.dht.ranges import RangeRateLimiter, grpc_peer_host, limited_range
from swarmavg.dht.ratelimit import RateLimiter, RateLimits
from swarmavg.proto import averaging_pb2, averaging_pb2_grpc

Components = tuple[Matchmaker, AllReduceService, StateSharer]


class AveragingServicer(averaging_pb2_grpc.AveragingServicer):
    """Adapter from the generated servicer to the averager's components."""

    def __init__(
        self,
        components: Callable[[], Components | None],
        rate_limits: RateLimits | None = None,
    ) -> None:
        self._components = components
        limits = rate_limits or RateLimits()
        self.rate_limiter = RateLimiter(limits)  # per verified peer id
        self.range_limiter = RangeRateLimiter(limits)  # per source range, before verifying

    async def _admit_range(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Refuse the request with RESOURCE_EXHAUSTED when the address range it connects
        from is over its rate (loopback and private ranges have no range budget). Nothing of
        the request is read: before its signature is checked it proves nothing."""
        host = grpc_peer_host(context.peer())
        refusal = self.range_limiter.admit(limited_range(host, False) if host else None)
        if refusal is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)

    async def _admit_sender(
        self,
        request: averaging_pb2.JoinRequest | averaging_pb2.StateRequest,
        method: str,
        allreduce: AllReduceService,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Verify the request's signature (without using its nonce up: the component's
        own check does that) and refuse it with RESOURCE_EXHAUSTED when its verified sender
        is over its rate. A request that does not verify is refused UNAUTHENTICATED, as the
        component would; a structural fault (another run) is left to the component's
        answer."""
        try:
            peer_id = allreduce.authenticator.verify(
                request.header, method, message_digest(request)
            )
        except AuthenticationError as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
            raise AssertionError("unreachable: abort raises") from None
        except HeaderError:
            return
        refusal = self.rate_limiter.admit(peer_id, None)
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
        await self._admit_range(context)
        matchmaker, allreduce, _ = await self._get(context)
        await self._admit_sender(request, JOIN_GROUP, allreduce, context)
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
        await self._admit_range(context)
        _, allreduce, sharer = await self._get(context)
        await self._admit_sender(request, DOWNLOAD_STATE, allreduce, context)
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
