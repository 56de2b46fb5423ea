"""``swarmavg dht``: a bare DHT node, e.g. a long-lived bootstrap peer for a public run.

Same ``--listen/--announce/--join/--identity/--run-id`` flags and ready line as
``swarmavg peer``, without the averager. Two optional endpoints: ``--metrics HOST:PORT``
(Prometheus: DHT size, routing table, stored records) and ``--control ENDPOINT``, which
``swarmavg status`` and ``swarmavg peers`` ask (peer/daemon/dht_control.py). The control endpoint
is off unless asked for (``"control": null`` in the ready line): a bootstrap node often
shares a machine with a peer of the same run, whose default socket it must not take.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import grpc

from swarmavg.dht import BootstrapError, ChannelPool, DHTNode, Identity
from swarmavg.dht.ranges import split_host
from swarmavg.dht.tasks import TaskSet, bounded_step
from swarmavg.peer.client.endpoint import ControlEndpoint
from swarmavg.peer.client.run_view import ThisPeer
from swarmavg.peer.daemon.config import PeerConfig
from swarmavg.peer.daemon.control_server import (
    ControlBindError,
    ControlServer,
    prepare_endpoint,
    start_control_server,
)
from swarmavg.peer.daemon.daemon import (
    StartupError,
    bootstrap_message,
    load_tls,
    node_dht_config,
    revocation_keeper,
    start_public_server,
)
from swarmavg.peer.daemon.dht_control import DHTControlService
from swarmavg.peer.daemon.narration import narrate
from swarmavg.peer.daemon.netutil import announce_address
from swarmavg.peer.daemon.run_gather import gather_view, read_value
from swarmavg.peer.nat.agent import NatAgent
from swarmavg.peer.nat.limits import MiB, RelayLimits
from swarmavg.peer.version import installed_version
from swarmavg.proto import control_pb2

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
        self.control: ControlEndpoint | None = None
        self._control_server: ControlServer | None = None
        self._metrics: Any = None
        self._metrics_address: str | None = None  # bound HOST:PORT (port 0 resolved)

        self._nat: NatAgent | None = None
        self._tasks = TaskSet()  # the narrator (peers joining and leaving, summaries), revocations
        self._started_at = time.monotonic()
        self._stopped = False

    def ready_record(self) -> dict[str, Any]:
        if self._identity is None:
            raise RuntimeError("not started")
        record: dict[str, Any] = {
            "event": "ready",
            "peer_id": self._identity.peer_id_hex,
            "address": self.address,
            "control": str(self.control) if self.control is not None else None,
            "run_id": self.config.run_id,
        }
        if self._metrics_address is not None:
            # only then: the ready line's fields are a contract (DESIGN 3.1)
            record["metrics"] = self._metrics_address  # the bound HOST:PORT (port 0 resolved)
        return record

    async def start(self) -> None:
        """Bind and bootstrap. Raises ``StartupError`` with a one-line reason."""
        try:
            await self._start()
        except BaseException:
            await self.shutdown(0.0)
            raise

    async def _start(self) -> None:
        cfg = self.config
        if cfg.control is not None:
            try:
                self.control = prepare_endpoint(cfg.control, cfg.run_id)
            except ControlBindError as exc:
                raise StartupError(str(exc)) from None
        try:
            self._identity = (
                Identity.load_or_create(cfg.identity) if cfg.identity else Identity.generate()
            )
        except (OSError, ValueError) as exc:
            raise StartupError(f"identity file {cfg.identity}: {exc}") from None
        tls = load_tls(cfg, self._identity)
        self._channels = ChannelPool(tls=tls)
        self.node = DHTNode(node_dht_config(cfg, tls), self._identity, self._channels)
        node = self.node
        keeper = revocation_keeper(cfg, tls, node)
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
        if keeper is not None:
            self._tasks.spawn(keeper.run(), name="revocations")
        if self.control is not None:
            service = DHTControlService(self)  # type: ignore[arg-type]  # no averaging calls
            try:
                self._control_server = await start_control_server(
                    self.control, service.add_to_server
                )
            except ControlBindError as exc:
                raise StartupError(str(exc)) from None
            self.control = self._control_server.endpoint
        if cfg.metrics is not None:
            await self._start_metrics(cfg.metrics)
        log.debug("DHT node %s ready at %s", self._identity.peer_id_hex, self.address)
        self._tasks.spawn(
            narrate(
                lambda: [(c.peer_id.hex(), c.address) for c in node.routing],
                None,
                cfg.summary_interval,
            ),
            name="narrator",
        )

    async def _start_metrics(self, address: str) -> None:
        from swarmavg.peer.daemon.metrics import MetricsServer

        node = self.node
        assert node is not None
        metrics = MetricsServer(
            address,
            None,
            dht_size=lambda: float(node.size_estimate()),
            known_peers=node.num_known_peers,
            stored_records=node.storage.num_records,
        )
        try:
            self._metrics_address = await asyncio.to_thread(metrics.start)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {address}: {exc.strerror}") from None
        self._metrics = metrics

    # ---- what the control endpoint answers (peer/daemon/dht_control.py) ----

    def status(self) -> control_pb2.StatusResponse:
        """The node's figures (``swarmavg status``): no rounds, no bytes of averaging."""
        node = self.node
        if node is None or self._identity is None:
            raise RuntimeError("the DHT node is not started")
        return control_pb2.StatusResponse(
            kind="dht",
            peer_id=self._identity.peer_id_hex,
            run_id=self.config.run_id,
            address=self.address or "",
            control=str(self.control) if self.control is not None else "",
            known_peers=node.num_known_peers(),
            dht_size_estimate=float(node.size_estimate()),
            stored_records=node.storage.num_records(),
            uptime=time.monotonic() - self._started_at,
            version=installed_version(),
            pid=os.getpid(),
        )

    async def peers(self, training_run: str) -> control_pb2.PeersResponse:
        """The run's view through this node (``swarmavg peers``)."""
        if self.node is None or self._identity is None:
            raise RuntimeError("the DHT node is not started")
        this = ThisPeer(self._identity.peer_id_hex, self.address)
        return await gather_view(self.node, self.config.run_id, training_run, this)

    async def dht_get(self, key: str) -> tuple[bool, Any]:
        if self.node is None:
            raise RuntimeError("the DHT node is not started")
        return await read_value(self.node, key)

    async def dht_store(self, key: str, value: Any, ttl: float, subkey: Any) -> bool:
        if self.node is None:
            raise RuntimeError("the DHT node is not started")
        return bool(await self.node.store(key, value, time.time() + ttl, subkey=subkey))

    async def shutdown(self, grace: float | None = None) -> None:
        """Leave the DHT and close the servers and channels (idempotent, bounded)."""
        if self._stopped:
            return
        self._stopped = True
        if self._control_server is not None:
            await bounded_step(self._control_server.stop(0.2), 1.0, "control server")
            self._control_server.remove_files()
        await self._tasks.close()
        if self._metrics is not None:
            await bounded_step(asyncio.to_thread(self._metrics.stop), 5.0, "metrics")
        if self.node is not None:
            await bounded_step(self.node.shutdown(), 1.0, "DHT shutdown")
        if self._nat is not None:
            await bounded_step(self._nat.close(), 1.0, "relay")
        if self._server is not None:
            await bounded_step(self._server.stop(0.2), 1.0, "server")
        if self._channels is not None:
            await bounded_step(self._channels.close(), 2.0, "channels")
