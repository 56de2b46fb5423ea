"""Limits of a public gRPC server: streams, keepalive, connection lifetime, concurrency.

gRPC's own defaults let one connection open an unbounded number of streams (the C core
advertises ``SETTINGS_MAX_CONCURRENT_STREAMS`` = 2^31 - 1), keep an idle connection
forever, and run any number of handlers at once. A stranger can then pin a daemon's
memory with cheap connections. Every daemon and bare DHT node builds its
public server from :class:`ServerLimits`; the defaults are sized so that honest 16-peer
groups never reach them (a member holds at most a few streams to one peer at a time: one
``Reduce`` per round, a ``JoinGroup``, a state download, DHT calls).

The handler pool (``max_concurrent_rpcs``) is server-wide, and grpc.aio offers no way to
bound it per source: one address could hold every handler with silent streams, and an
honest DHT ``Ping`` was then refused. :class:`RangeShareInterceptor` bounds
it in our handlers instead: each handler counts against its connection's address range
(dht/ranges.py) first, and a range already holding ``max_rpcs_per_range`` handlers is
answered ``RESOURCE_EXHAUSTED`` at once, so the refused call frees its handler at once and
one range never holds more than its share of the pool.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from swarmavg.dht.ranges import grpc_peer_host, limited_range

__all__ = ["RangeShareInterceptor", "ServerLimits", "make_server"]


@dataclass(frozen=True)
class ServerLimits:
    """Resource limits of one public gRPC server (grpc core channel arguments).

    Attributes:
        max_concurrent_streams: streams one HTTP/2 connection may have open at once
            (``grpc.max_concurrent_streams``); more wait for a free one on the client.
        max_concurrent_rpcs: handlers running at once on the whole server; more are
            refused with ``RESOURCE_EXHAUSTED`` (``grpc.aio.server`` argument).
        max_rpcs_per_range: handlers running at once for callers of one address range
            (an IPv4 /24, an IPv6 /48; :class:`RangeShareInterceptor`); more are refused
            with ``RESOURCE_EXHAUSTED`` at once, so that one range cannot hold the whole
            pool. At most ``max_concurrent_rpcs``.
        limit_local_ranges: count loopback and private sources per range too (off: they
            share the server-wide pool only, like ``DHTConfig.limit_local_ranges``; tests
            turn it on to stand for distinct networks on 127.x.y.z).
        keepalive_time_ms / keepalive_timeout_ms: the server pings a connection idle for
            ``keepalive_time_ms`` and closes it when the ping is not answered within
            ``keepalive_timeout_ms`` (a peer that vanished without a FIN).
        min_ping_interval_ms: the least interval between a client's pings that the server
            tolerates (``grpc.http2.min_recv_ping_interval_without_data_ms``); a ping
            sooner is a strike.
        max_ping_strikes: strikes before the server sends GOAWAY (``too_many_pings``).
        permit_keepalive_without_calls: whether clients may ping a connection without
            calls in flight (``grpc.keepalive_permit_without_calls``).
        max_connection_idle_ms: a connection without calls for this long is closed.
        max_connection_age_ms / max_connection_age_grace_ms: a connection is closed this
            long after it opened (GOAWAY; calls in flight get the grace to finish), so that
            no stranger holds one connection, and what it buffers, forever.
        max_message_bytes: largest message received or sent.
    """

    max_concurrent_streams: int = 128
    max_concurrent_rpcs: int = 2048
    max_rpcs_per_range: int = 256
    keepalive_time_ms: int = 60_000
    keepalive_timeout_ms: int = 20_000
    min_ping_interval_ms: int = 10_000
    max_ping_strikes: int = 2
    permit_keepalive_without_calls: bool = False
    max_connection_idle_ms: int = 300_000
    max_connection_age_ms: int = 1_800_000
    max_connection_age_grace_ms: int = 300_000
    max_message_bytes: int = 8 << 20
    limit_local_ranges: bool = False

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_rpcs_per_range > self.max_concurrent_rpcs:
            raise ValueError("max_rpcs_per_range must be <= max_concurrent_rpcs")

    def options(self) -> list[tuple[str, int]]:
        """The channel arguments that enforce these limits."""
        return [
            # grpc enables SO_REUSEPORT by default, which would let a second daemon "bind" a
            # port that is in use and split its traffic with the first.
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(self.permit_keepalive_without_calls)),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", self.min_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
            ("grpc.max_connection_idle_ms", self.max_connection_idle_ms),
            ("grpc.max_connection_age_ms", self.max_connection_age_ms),
            ("grpc.max_connection_age_grace_ms", self.max_connection_age_grace_ms),
        ]


class RangeShareInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # no stubs
    """Bounds the handlers that callers of one address range hold at once.

    The count is taken when the handler starts, before anything of the request is read
    (an unverified request proves nothing about its sender: only the connection's address
    says where it comes from), and given back when the handler ends. A call over the share
    is aborted ``RESOURCE_EXHAUSTED`` at once: its handler is free again within the same
    step, so the pool a range holds is its share, not the server's whole pool. Exempt
    (local, unless ``limit_local``) and address-less callers count against the server-wide
    pool only.
    """

    def __init__(self, per_range: int, limit_local: bool = False) -> None:
        self.per_range = per_range
        self.limit_local = limit_local
        self.held: collections.Counter[str] = collections.Counter()
        """Handlers running now per range (tests, status)."""
        self.refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return self._wrap(handler)

    async def _admit(self, context: Any) -> str | None:
        """Count the call against its range and return the range (None: not counted), or
        abort the call (``RESOURCE_EXHAUSTED``) when the range's share is used."""
        host = grpc_peer_host(context.peer())
        key = limited_range(host, self.limit_local) if host else None
        if key is None:
            return None
        if self.held[key] >= self.per_range:
            self.refused += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many calls in flight from address range {key} (more than "
                f"{self.per_range}); try again later",
            )
            raise AssertionError("unreachable: abort raises")
        self.held[key] += 1
        return key

    def _leave(self, key: str | None) -> None:
        if key is not None:
            self.held[key] -= 1
            if self.held[key] <= 0:
                del self.held[key]

    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._coroutine(handler.unary_unary), **kwargs
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._coroutine(handler.stream_unary), **kwargs
            )
        if handler.unary_stream is not None:
            inner = handler.unary_stream
            wrapped = self._generator(inner) if inspect.isasyncgenfunction(inner) else None
            return grpc.unary_stream_rpc_method_handler(wrapped or self._coroutine(inner), **kwargs)
        inner = handler.stream_stream
        wrapped = self._generator(inner) if inspect.isasyncgenfunction(inner) else None
        return grpc.stream_stream_rpc_method_handler(wrapped or self._coroutine(inner), **kwargs)

    def _coroutine(self, inner: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def behavior(request: Any, context: Any) -> Any:
            key = await self._admit(context)
            try:
                return await inner(request, context)
            finally:
                self._leave(key)

        return behavior

    def _generator(self, inner: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
        async def behavior(request: Any, context: Any) -> AsyncIterator[Any]:
            key = await self._admit(context)
            try:
                async for response in inner(request, context):
                    yield response
            finally:
                self._leave(key)

        return behavior


def make_server(
    limits: ServerLimits | None = None, interceptors: Sequence[Any] | None = None
) -> grpc.aio.Server:
    """A ``grpc.aio`` server with ``limits`` (default :class:`ServerLimits`) and
    ``interceptors``, behind a :class:`RangeShareInterceptor` (first, so that a refused
    call costs no other work). Call it inside the running loop."""
    limits = limits or ServerLimits()
    share = RangeShareInterceptor(limits.max_rpcs_per_range, limits.limit_local_ranges)
    return grpc.aio.server(
        options=limits.options(),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
        interceptors=[share, *(interceptors or ())],
    )
