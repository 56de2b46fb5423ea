"""Limits of a public gRPC server: streams, keepalive, connection lifetime, concurrency.

gRPC's own defaults let one connection open an unbounded number of streams (the C core
advertises ``SETTINGS_MAX_CONCURRENT_STREAMS`` = 2^31 - 1), keep an idle connection
forever, and run any number of handlers at once. A stranger can then pin a daemon's
memory with cheap connections (issue 17). Every daemon and bare DHT node builds its
public server from :class:`ServerLimits`; the defaults are sized so that honest 16-peer
groups never reach them (a member holds at most a few streams to one peer at a time: one
``Reduce`` per round, a ``JoinGroup``, a state download, DHT calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

__all__ = ["ServerLimits", "make_server"]


@dataclass(frozen=True)
class ServerLimits:
    """Resource limits of one public gRPC server (grpc core channel arguments).

    Attributes:
        max_concurrent_streams: streams one HTTP/2 connection may have open at once
            (``grpc.max_concurrent_streams``); more wait for a free one on the client.
        max_concurrent_rpcs: handlers running at once on the whole server; more are
            refused with ``RESOURCE_EXHAUSTED`` (``grpc.aio.server`` argument).
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
    keepalive_time_ms: int = 60_000
    keepalive_timeout_ms: int = 20_000
    min_ping_interval_ms: int = 10_000
    max_ping_strikes: int = 2
    permit_keepalive_without_calls: bool = False
    max_connection_idle_ms: int = 300_000
    max_connection_age_ms: int = 1_800_000
    max_connection_age_grace_ms: int = 300_000
    max_message_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, int) and not isinstance(value, bool) and value < 1:
                raise ValueError(f"{name} must be >= 1")

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


def make_server(
    limits: ServerLimits | None = None, interceptors: Sequence[Any] | None = None
) -> grpc.aio.Server:
    """A ``grpc.aio`` server with ``limits`` (default :class:`ServerLimits`) and
    ``interceptors``. Call it inside the running loop."""
    limits = limits or ServerLimits()
    return grpc.aio.server(
        options=limits.options(),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
        interceptors=list(interceptors) if interceptors else None,
    )
