"""``swarmavg dht``: a bare DHT node, e.g. a long-lived bootstrap peer for a public run.

Same ``--listen/--announce/--join/--identity/--run-id`` flags and ready line as
``swarmavg peer``, without the averager or a control endpoint (``"control": null``).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from swarmavg.dht import BootstrapError, ChannelPool, DHTNode, Identity
from swarmavg.dht.ranges import split_host
from swarmavg.dht.tasks import TaskSet, bounded_step
from swarmavg.peer.config import PeerConfig
from swarmavg.peer.daemon import (
    StartupError,
    bootstrap_message,
    load_tls,
    node_dht_config,
    start_public_server,
)
from swarmavg.peer.daemon_log import narrate
from swarmavg.peer.nat.agent import NatAgent
from swarmavg.peer.nat.limits import MiB, RelayLimits
from swarmavg.peer.netutil import announce_address

log = logging.getLogger(__name__)


class BareDHT:
    """A DHT node with its own public server. ``start`` once; ``shutdown`` is idempotent."""

    def __init__(self, config: PeerConfig) -> None:
        if config.client_mode:
            raise ValueError("a bare DHT node serves others; --client-mode makes no sense here")
        self.config = config
        self.address: str | None = None
        self.node: DHTNode | None = None
        self._identity: Identity | None = None
        self._server: grpc.aio.Server | None = None
        self._channels: ChannelPool | None = None
        self._nat: NatAgent | None = None
        self._tasks = TaskSet()  # the narrator (peers joining and leaving, summaries)
        self._stopped = False

    def ready_record(self) -> dict[str, Any]:
        if self._identity is None:
            raise RuntimeError("not started")
        return {
            "event": "ready",
            "peer_id": self._identity.peer_id_hex,
            "address": self.address,
            "control": None,
            "run_id": self.config.run_id,
        }

    async def start(self) -> None:
        """Bind and bootstrap. Raises ``StartupError`` with a one-line reason."""
        try:
            await self._start()
        except BaseException:
            await self.shutdown(0.0)
            raise

    async def _start(self) -> None:
        cfg = self.config
        try:
            self._identity = (
                Identity.load_or_create(cfg.identity) if cfg.identity else Identity.generate()
            )
        except (OSError, ValueError) as exc:
            raise StartupError(f"identity file {cfg.identity}: {exc}") from None
        tls = load_tls(cfg, self._identity)
        self._channels = ChannelPool(tls=tls)
        self.node = DHTNode(node_dht_config(cfg), self._identity, self._channels)
        node = self.node
        # A bootstrap node is what NATed peers ask first: it answers dial-backs and relays
        # (docs/peer.md, "Behind NAT"). It is taken as public: behind NAT it is of no use.
        nat = NatAgent(
            self._channels,
            self._identity.peer_id,
            cfg.relay,
            split_host(cfg.listen),
            RelayLimits(bytes_per_second_per_source=cfg.relay_rate * MiB),
        )
        self._nat = nat

        def register(server: grpc.aio.Server) -> None:
            node.add_to_server(server)
            nat.service.add_to_server(server)

        self._server, port = await start_public_server(cfg.listen, register, tls)
        self.address = announce_address(cfg.listen, port, cfg.announce)
        await nat.settle(
            port=port,
            announced=self.address,
            join=[],
            explicit_announce=True,
            signer=node.signer,
            authenticator=node.authenticator,
            routing=lambda: [c.address for c in node.routing],
            on_move=lambda _: None,
        )
        try:
            await self.node.start(self.address)
        except BootstrapError as exc:
            raise StartupError(bootstrap_message(exc, cfg.private)) from None
        log.debug("DHT node %s ready at %s", self._identity.peer_id_hex, self.address)
        self._tasks.spawn(
            narrate(
                lambda: [(c.peer_id.hex(), c.address) for c in node.routing],
                None,
                cfg.summary_interval,
            ),
            name="narrator",
        )

    async def shutdown(self, grace: float | None = None) -> None:
        """Leave the DHT and close the server and channels (idempotent, bounded)."""
        if self._stopped:
            return
        self._stopped = True
        await self._tasks.close()
        if self.node is not None:
            await bounded_step(self.node.shutdown(), 1.0, "DHT shutdown")
        if self._nat is not None:
            await bounded_step(self._nat.close(), 1.0, "relay")
        if self._server is not None:
            await bounded_step(self._server.stop(0.2), 1.0, "server")
        if self._channels is not None:
            await bounded_step(self._channels.close(), 2.0, "channels")
