"""A cache of grpc.aio channels: one per remote address, closed when idle.

Opening a channel costs a TCP (and HTTP/2) handshake, so every outbound call of the DHT and
the averager fetches its channel from one shared :class:`ChannelPool`. Channels idle for longer
than ``idle_timeout`` are closed by a sweeper task that the pool owns.

In a private run the pool holds the peer's :class:`~swarmavg.dht.tls.PeerTLS`: every channel is
then a mutual-TLS ``secure_channel``, and the data plane dials with the same setup
(``pool.tls``). In a public run (``tls`` None) channels are insecure, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from swarmavg.dht.tasks import TaskSet
from swarmavg.dht.tls import PeerTLS, channel_options

log = logging.getLogger(__name__)

_Key = tuple[str, bytes | None]  # (address, peer id the server must prove)

DEFAULT_OPTIONS: tuple[tuple[str, int], ...] = (
    # Keep gRPC's 4 MiB default receive cap explicitly; sending is capped by callers.
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.max_send_message_length", 4 * 1024 * 1024),
    # Don't let a dead peer keep a connection attempt alive for minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
    # Every call has its own deadline; gRPC's transparent retries would only blur it.
    ("grpc.enable_retries", 0),
)


class ChannelPool:
    """One cached ``grpc.aio.Channel`` per remote address.

    Callers must fetch the channel for each call (``pool.channel(addr).unary_unary(...)``) and
    not keep it: a channel unused for ``idle_timeout`` seconds is closed, which is safe because
    every call's deadline is much shorter than ``idle_timeout``.

    Create and use the pool inside the running event loop. :meth:`close` is idempotent.
    """

    def __init__(
        self,
        idle_timeout: float = 120.0,
        options: tuple[tuple[str, int], ...] = DEFAULT_OPTIONS,
        tls: PeerTLS | None = None,
    ) -> None:
        if idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be positive, got {idle_timeout}")
        self.idle_timeout = idle_timeout
        self.tls = tls
        """This peer's TLS setup in a private run; None: insecure channels (a public run)."""
        self._options: list[tuple[str, int | str]] = list(options)
        self._credentials: grpc.ChannelCredentials | None = None
        if tls is not None:
            self._credentials = tls.channel_credentials()
        # Keyed by (address, peer id the server must prove, None: any member of the run);
        # the peer id only in a private run, a public run keeps one channel per address.
        self._channels: dict[_Key, grpc.aio.Channel] = {}
        self._last_used: dict[_Key, float] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = TaskSet()  # channel.close() of discarded channels: awaited, not cancelled
        self._closed = False
        self.route: Callable[[str], str] | None = None
        """Where a new channel to an address connects (None: the address itself). A NATed
        peer's direct links after hole punching set it (peer/nat/direct.py): the channel stays
        filed under the address dialled, which is what every caller checks answers against."""

    def channel(self, address: str, peer_id: bytes | None = None) -> grpc.aio.Channel:
        """Return the channel to ``address`` (HOST:PORT), opening it on first use.

        Args:
            peer_id: in a private run, the peer the caller means to reach: the server's TLS
                credential must be that peer's (else the call fails ``UNAVAILABLE``, the
                handshake refused). None: any member of the run (an address whose peer
                is not known yet). Ignored in a public run.

        Raises:
            RuntimeError: the pool is closed.
        """
        if self._closed:
            raise RuntimeError("ChannelPool is closed")
        key = (address, (peer_id or None) if self._credentials is not None else None)
        self._last_used[key] = time.monotonic()
        channel = self._channels.get(key)
        if channel is None:
            target = address if self.route is None else self.route(address)
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(target, options=self._options)
            else:
                options = [*self._options, *channel_options(key[1])]
                channel = grpc.aio.secure_channel(target, self._credentials, options=options)
            self._channels[key] = channel
            if self._sweeper is None:
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return channel

    def _keys(self, address: str) -> list[_Key]:
        return [k for k in self._channels if k[0] == address]

    def discard(self, address: str) -> None:
        """Close the channels to ``address`` now (e.g. the peer is known to be gone)."""
        for key in self._keys(address) or [(address, None)]:
            channel = self._channels.pop(key, None)
            self._last_used.pop(key, None)
            if channel is not None:
                self._close_later(channel)

    def retire(self, address: str, grace: float = 30.0) -> None:
        """Open new channels to ``address`` on their next use (its route changed); calls in
        flight on the old ones get ``grace`` seconds to finish."""
        for key in self._keys(address):
            channel = self._channels.pop(key, None)
            if channel is not None:
                self._closing.spawn(channel.close(grace), name="retire-channel")

    def __len__(self) -> int:
        return len(self._channels)

    def __contains__(self, address: object) -> bool:
        return any(k[0] == address for k in self._channels)

    async def close(self) -> None:
        """Close every channel and stop the sweeper. Calls in flight fail with CANCELLED."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        channels = list(self._channels.values())
        self._channels.clear()
        self._last_used.clear()
        await asyncio.gather(*(ch.close() for ch in channels))
        await self._closing.join()

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        self._closing.spawn(channel.close(), name="close-channel")

    def close_idle(self, now: float | None = None) -> list[str]:
        """Close the channels unused for more than ``idle_timeout``; return their addresses.

        ``now`` is a ``time.monotonic()`` reading (default: the current one). Called by the
        pool's sweeper task; public so that tests need not wait.
        """
        now = time.monotonic() if now is None else now
        idle = [k for k, t in self._last_used.items() if now - t > self.idle_timeout]
        for key in idle:
            log.debug("closing idle channel to %s", key[0])
            channel = self._channels.pop(key, None)
            self._last_used.pop(key, None)
            if channel is not None:
                self._close_later(channel)
        return list(dict.fromkeys(k[0] for k in idle))

    async def _sweep(self) -> None:
        period = max(self.idle_timeout / 4, 0.05)
        while True:
            await asyncio.sleep(period)
            self.close_idle()
