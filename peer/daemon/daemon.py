"""``Peer``: one daemon composing the DHT, the averager and the control service.

One process, one event loop. The DHT and Averaging services share one public
gRPC server; the control service has its own server on the local endpoint. Use it in
process as ``async with Peer(PeerConfig(...)) as peer:`` (``peer.client()`` talks to it), or
through ``swarmavg peer`` (``swarmavg.peer.cli``).

Start order: control endpoint checked first (fail fast when another daemon owns it), then
the public server is bound, the DHT bootstraps, the averager starts, the control service
opens. Shutdown (docs/peer.md): stop accepting control calls, let rounds in flight finish
within the grace period (then cancel them), leave the DHT, close servers and channels.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import grpc
import numpy as np

from swarmavg.averaging.allreduce.congestion import (
    CongestionControlError,
    check_congestion_control,
)
from swarmavg.averaging.averager import Averager
from swarmavg.averaging.errors import DataPlaneBindError, InvalidTensorsError
from swarmavg.averaging.matchmaking.matchmaker import MatchmakingEvent
from swarmavg.averaging.protocol_keys import protocol_key_classes
from swarmavg.averaging.request import RoundRequest
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.run_records.trainers import LocalTrainers, trainers_key
from swarmavg.averaging.transfer_progress import TransferProgress
from swarmavg.dht import (
    BootstrapError,
    ChannelPool,
    DHTConfig,
    DHTNode,
    Identity,
)
from swarmavg.dht.credentials import CredentialError, RunFile, load_peer_credentials
from swarmavg.dht.dial_failures import NOT_SWARMAVG, REFUSED
from swarmavg.dht.ranges import split_host
from swarmavg.dht.revocation import read_revocations
from swarmavg.dht.revocation_keeper import RevocationKeeper
from swarmavg.dht.server_limits import ServerLimits
from swarmavg.dht.tasks import TaskSet, bounded_step
from swarmavg.dht.tls import REVOKED_DETAILS, PeerTLS, bind_port, new_server
from swarmavg.peer.client import shm
from swarmavg.peer.client.client import AsyncClient
from swarmavg.peer.client.endpoint import ControlEndpoint
from swarmavg.peer.client.run_view import ThisPeer
from swarmavg.peer.daemon.combiner import LocalCombiner
from swarmavg.peer.daemon.config import DEFAULT_LISTEN, PeerConfig
from swarmavg.peer.daemon.control import ControlService, classify
from swarmavg.peer.daemon.control_server import (
    ControlBindError,
    ControlServer,
    prepare_endpoint,
    release_claim,
    start_control_server,
)
from swarmavg.peer.daemon.narration import narrate
from swarmavg.peer.daemon.netutil import announce_address, bind_problem, explain_bind_failure
from swarmavg.peer.daemon.round_reports import RoundLog, publish_rounds
from swarmavg.peer.daemon.run_gather import gather_view, read_value
from swarmavg.peer.daemon.stats import PeerStats
from swarmavg.peer.nat.agent import NatAgent
from swarmavg.peer.nat.limits import MiB, RelayLimits
from swarmavg.peer.nat.reservation import RelayedAddress
from swarmavg.peer.version import installed_version
from swarmavg.proto import control_pb2

# The room's name, not the module's: a user reads "swarmavg.peer.daemon: ..." in the log.
log = logging.getLogger("swarmavg.peer.daemon")

SHM_SWEEP_INTERVAL = 5.0
FREE_PORT_LISTEN = "0.0.0.0:0"
"""What a daemon listens on when the default port is taken."""


class StartupError(RuntimeError):
    """The daemon cannot start; the message is one line meant for the user."""


def node_dht_config(cfg: PeerConfig, tls: PeerTLS | None = None) -> DHTConfig:
    """The DHT config of a daemon or bare DHT node: ``cfg``'s DHT settings plus the run's
    protocol keys (averaging/protocol_keys.py), so that every node of the run refuses, and
    ignores in answers, any record there that is not an owner-signed entry of their schema.
    In a private run (``tls``) also its revocation key, which takes only lists signed by the
    run's authority (dht/revocation.py).
    """
    key_classes = protocol_key_classes(cfg.run_id)
    if tls is not None:
        key_classes = (tls.revocations.key_class(), *key_classes)
    return dataclasses.replace(cfg.dht_config(), key_classes=key_classes)


def revocation_keeper(
    cfg: PeerConfig, tls: PeerTLS | None, node: DHTNode
) -> RevocationKeeper | None:
    """What keeps a private run's revocation list current on ``node`` (its file and the DHT;
    None in a public run). Made before ``node`` joins, so that it never takes a revoked peer
    into its routing table; the caller runs its ``run()`` in a task it owns once joined."""
    if tls is None:
        return None
    run = RunFile(tls.credentials.run_id, tls.credentials.authority_pem)
    return RevocationKeeper(node, tls.revocations, run, cfg.revocations)


def bootstrap_message(exc: BootstrapError, private: bool = False) -> str:
    """One line naming every initial peer and why it did not answer, headed by what the
    user got wrong where the reasons tell it (another run id, a wrong address), with a hint
    about private runs where a failed handshake could be one."""
    reasons = "; ".join(f"{address}: {reason}" for address, reason in exc.failures.items())
    failures = list(exc.failures.values())
    if any("run id differs" in reason for reason in failures):
        return (
            f"could not join the swarm: the run ids differ ({reasons}; after "
            f"{exc.attempts} attempt(s)); every peer of a "
            "run must use the same --run-id (SWARMAVG_RUN_ID): ask the run's organiser for it"
        )
    if any(REVOKED_DETAILS in reason for reason in failures):
        return (
            f"could not join the swarm ({reasons}); the run's organiser has revoked this "
            "peer's credential"
        )
    if any("protocol version" in reason for reason in failures):
        return (
            f"could not join the swarm ({reasons}); the peers run another swarmavg version: "
            "install the run's version"
        )
    message = (
        f"could not join the swarm: no initial peer answered after {exc.attempts} "
        f"attempt(s) ({reasons})"
    )
    if all(reason in (REFUSED, NOT_SWARMAVG) for reason in failures):
        return message + "; check the --join address (the HOST:PORT another peer's banner prints)"
    if private:
        return message + (
            " (a private run: are the initial peers of the same run, and is this credential "
            "still valid?)"
        )
    return message + (
        " (if the run is private, start with --run-file, --credential and --identity: "
        "see docs/private-runs.md)"
    )


def load_tls(cfg: PeerConfig, identity: Identity) -> PeerTLS | None:
    """The peer's TLS setup in a private run (None in a public run), holding the revocation
    list of ``cfg.revocations`` when given.

    Raises:
        StartupError: a credential that is missing, expired, of another run or of another
            identity, a run file of another run, or a revocation list that is unreadable, of
            another run or not signed by its authority (one line saying which).
    """
    if cfg.run_file is None or cfg.credential is None or cfg.identity is None:
        return None
    try:
        credentials = load_peer_credentials(
            cfg.run_file, cfg.credential, identity, cfg.identity, cfg.run_id
        )
    except CredentialError as exc:
        raise StartupError(str(exc)) from None
    log.info(
        "private run %s: TLS with credential %s (valid until %s UTC)",
        cfg.run_id,
        cfg.credential,
        f"{credentials.not_after:%Y-%m-%d %H:%M}",
    )
    tls = PeerTLS(credentials)
    if cfg.revocations is not None:
        run = RunFile(credentials.run_id, credentials.authority_pem)
        try:
            tls.revocations.adopt(read_revocations(cfg.revocations, run))
        except CredentialError as exc:
            raise StartupError(str(exc)) from None
    return tls


async def start_public_server(
    listen: str, register: Callable[[grpc.aio.Server], None], tls: PeerTLS | None = None
) -> tuple[grpc.aio.Server, int]:
    """Bind ``listen``, let ``register`` add the public services, start; return server, port.

    In a private run (``tls``) the port is mutual TLS and every request's header must name
    the peer of its credential (:mod:`swarmavg.dht.tls`).

    Raises:
        StartupError: the address cannot be bound (the message says why and what to do).
    """
    problem = bind_problem(listen)
    if problem is None:
        server = new_server(ServerLimits(), tls)
        register(server)
        try:
            port = bind_port(server, listen, tls)
        except RuntimeError:
            port = 0
        if port == 0:
            await server.stop(None)
            problem = explain_bind_failure(listen)
    if problem is not None:
        raise StartupError(
            f"cannot listen on {listen}: {problem}; "
            "choose another with --listen HOST:PORT (port 0 picks a free one)"
        )
    await server.start()
    return server, port


class Peer:
    """A swarmavg peer daemon.

    ``start`` once, then ``shutdown`` (idempotent). ``address`` is the announced public
    address (``None`` in client mode), ``control`` the bound control endpoint.
    """

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.stats = PeerStats()
        self.round_log = RoundLog()  # published for monitors: peer/daemon/round_reports.py
        self.address: str | None = None
        self.control: ControlEndpoint | None = None
        self.identity: Identity | None = None
        self.dht: DHTNode | None = None
        self.averager: Averager | None = None
        self.combiner = LocalCombiner(self._average, config.local_window)
        self.segments = shm.DaemonSegmentCache()
        self._averager_config = config.averager_config()
        self._control_service: ControlService | None = None
        self._public_server: grpc.aio.Server | None = None
        self._control_server: ControlServer | None = None
        self._channels: ChannelPool | None = None
        self._tls: PeerTLS | None = None
        self.revocation_keeper: RevocationKeeper | None = None
        """In a private run, what keeps its revocation list current (its file and the DHT)."""
        self.nat: NatAgent | None = None
        self._metrics: Any = None
        self._metrics_address: str | None = None
        self._tasks = TaskSet()  # shm sweeper, metrics sync, revocation list
        self._started_at = 0.0
        self.local_trainers = LocalTrainers()
        self._stopped = False
        self._failed_start = False  # then the start's error is the user's last line

    @property
    def peer_id(self) -> str:
        """This peer's id (hex)."""
        if self.identity is None:
            raise RuntimeError("the peer is not started")
        return self.identity.peer_id_hex

    def ready_record(self) -> dict[str, Any]:
        """The JSON ready line's fields (docs/peer.md)."""
        record: dict[str, Any] = {
            "event": "ready",
            "peer_id": self.peer_id,
            "address": self.address,
            "control": str(self.control),
            "run_id": self.config.run_id,
        }
        if self._metrics_address is not None:
            # only then, as for a bare DHT node: the ready line's fields are a contract
            record["metrics"] = self._metrics_address  # the bound HOST:PORT (port 0 resolved)
        return record

    async def start(self) -> None:
        """Bind, bootstrap and start serving.

        Raises:
            StartupError: the control endpoint belongs to a live daemon, the port is taken,
                no initial peer answered, or another reason to give up (one-line message).
        """
        cfg = self.config
        self._started_at = time.monotonic()
        try:
            await self._start(cfg)
        except BaseException:
            self._failed_start = True
            await self.shutdown(grace=0.0)
            raise

    async def _start(self, cfg: PeerConfig) -> None:
        congestion = self._averager_config.allreduce.congestion_control
        if congestion is not None and self._averager_config.allreduce.data_plane:
            try:  # before binding anything: a name the kernel refuses is a usage mistake
                check_congestion_control(congestion)
            except CongestionControlError as exc:
                raise StartupError(str(exc)) from None
        try:
            self.control = prepare_endpoint(cfg.control, cfg.run_id)
        except ControlBindError as exc:
            raise StartupError(str(exc)) from None
        try:
            self.identity = (
                Identity.load_or_create(cfg.identity) if cfg.identity else Identity.generate()
            )
        except (OSError, ValueError) as exc:
            raise StartupError(f"identity file {cfg.identity}: {exc}") from None
        tls = self._tls = load_tls(cfg, self.identity)
        self._channels = ChannelPool(tls=tls)
        self._build_members(cfg)
        # One budget for joining: the dial-back asks the initial peers too, and a --join
        # that points at a silent port must cost the bootstrap timeout, not that plus more.
        join_deadline = asyncio.get_running_loop().time() + cfg.dht.bootstrap_timeout
        if not cfg.client_mode:
            cfg = await self._serve_public(cfg, tls)
        assert self.dht is not None  # built above
        assert self.averager is not None
        try:
            await self.dht.start(self.address, deadline=join_deadline)
        except BootstrapError as exc:
            raise StartupError(bootstrap_message(exc, cfg.private)) from None
        self._report_unreachable(cfg.join)
        if self.revocation_keeper is not None:
            self._tasks.spawn(self.revocation_keeper.run(), name="revocations")
        try:
            await self.averager.start()
        except DataPlaneBindError as exc:
            raise StartupError(str(exc)) from None
        if self.nat is not None:
            self.nat.set_data_port(self.averager.data_port)
            self._route_direct(self.nat)
        await self._start_control()
        if cfg.metrics:
            await self._start_metrics(cfg.metrics)
        self._tasks.spawn(self._sweep_shm(), name="shm-sweeper")
        self._tasks.spawn(
            publish_rounds(self.dht, cfg.run_id, self.peer_id, self.round_log), name="rounds"
        )
        self._tasks.spawn(
            narrate(self._contacts, self.stats, cfg.summary_interval), name="narrator"
        )
        log.debug(
            "peer %s ready: address=%s control=%s run=%s known_peers=%d",
            self.peer_id,
            self.address,
            self.control,
            cfg.run_id,
            self.dht.num_known_peers(),
        )

    def _build_members(self, cfg: PeerConfig) -> None:
        """The DHT node and the averager for ``cfg`` (not started)."""
        assert self.identity is not None  # set in _start
        assert self._channels is not None
        self.dht = DHTNode(node_dht_config(cfg, self._tls), self.identity, self._channels)
        self.revocation_keeper = revocation_keeper(cfg, self._tls, self.dht)
        self._averager_config = cfg.averager_config()
        self.averager = Averager(
            self.dht, self._averager_config, self._channels, observer=self._on_matchmaking
        )

    async def _serve_public(self, cfg: PeerConfig, tls: PeerTLS | None) -> PeerConfig:
        """Bind the public server, find out how others reach this peer (dial-back) and
        announce accordingly: directly, through a relay, or not at all (client mode, the
        returned config says so). Returns the config the daemon runs with."""
        assert self.identity is not None
        assert self._channels is not None
        dht, averager = self.dht, self.averager
        assert dht is not None
        assert averager is not None
        listen_host = split_host(cfg.listen)
        nat = NatAgent(
            self._channels,
            self.identity.peer_id,
            cfg.relay,
            listen_host,
            RelayLimits(bytes_per_second_per_source=cfg.relay_rate * MiB),
        )
        self.nat = nat

        def register(server: grpc.aio.Server) -> None:
            dht.add_to_server(server)
            averager.add_to_server(server)
            nat.service.add_to_server(server)

        try:
            self._public_server, port = await start_public_server(cfg.listen, register, tls)
        except StartupError:
            if cfg.listen != DEFAULT_LISTEN:
                raise
            why = explain_bind_failure(cfg.listen)
            # A second peer on this machine (one per GPU, or swarmavg launch): the default
            # port is the first one's, and any free port serves as well, being announced.
            cfg = dataclasses.replace(cfg, listen=FREE_PORT_LISTEN)
            self.config = cfg
            self._public_server, port = await start_public_server(cfg.listen, register, tls)
            log.info(
                "cannot listen on %s (%s): listening on port %d instead", DEFAULT_LISTEN, why, port
            )
        settled = await nat.settle(
            port=port,
            announced=announce_address(cfg.listen, port, cfg.announce),
            join=cfg.join,
            explicit_announce=cfg.announce is not None,
            signer=dht.signer,
            authenticator=dht.authenticator,
            routing=lambda: [address for _, address in self._contacts()],
            on_move=self._on_relay_moved,
        )
        if settled.address is not None:
            self.address = settled.address
            averager.announced_data_port = settled.data_port
            return cfg
        # NATed and no relay: nobody can dial in, so serve nothing, as --client-mode would.
        await self._public_server.stop(None)
        self._public_server = None
        cfg = dataclasses.replace(cfg, client_mode=True)
        self.config = cfg
        self._build_members(cfg)
        return cfg

    def _route_direct(self, nat: NatAgent) -> None:
        """A relayed peer's channels and data-plane connections to other relayed peers take
        their direct links once punched (peer/nat/direct.py)."""
        routes, channels = nat.routes, self._channels
        if not self.config.hole_punching:
            return
        if routes is None or channels is None or self.averager is None:
            return
        channels.route = routes.grpc_target
        routes.retire = channels.retire
        connector = self.averager.data_connector
        if connector is not None:
            connector.route = routes.data_target
            routes.forget_data = connector.forget

    def _on_relay_moved(self, relayed: RelayedAddress) -> None:
        """The reservation moved to another relay: announce the new address from now on."""
        self.address = relayed.address
        if self.dht is not None:
            self.dht.protocol.set_address(relayed.address)
        if self.averager is not None:
            self.averager.relocate(relayed.address, relayed.data_port)
        log.info("now reachable through relay %s as %s", relayed.relay, relayed.address)

    def _contacts(self) -> list[tuple[str, str]]:
        """The routing table as ``(peer id hex, address)`` pairs (for the narrator)."""
        return [] if self.dht is None else [(c.peer_id.hex(), c.address) for c in self.dht.routing]

    def _report_unreachable(self, initial: list[str]) -> None:
        """Warn about initial peers that are not in the routing table after joining
        (the DHT's maintenance keeps retrying them, so a swarm split by them re-merges)."""
        if self.dht is None or not initial:
            return
        known = {contact.address for contact in self.dht.routing}
        missing = [a for a in initial if a not in known and a != self.address]
        if missing:
            log.warning(
                "initial peer(s) %s did not answer; joined through the others (%d known peers)",
                ", ".join(missing),
                self.dht.num_known_peers(),
            )

    async def _start_control(self) -> None:
        assert self.control is not None  # set in _start
        service = self._control_service = ControlService(self)
        try:
            self._control_server = await start_control_server(self.control, service.add_to_server)
        except ControlBindError as exc:
            raise StartupError(str(exc)) from None
        self.control = self._control_server.endpoint

    async def _start_metrics(self, address: str) -> None:
        from swarmavg.peer.daemon.metrics import MetricsServer

        dht = self.dht
        assert dht is not None
        metrics = MetricsServer(
            address,
            self.stats,
            dht_size=lambda: float(dht.size_estimate()),
            known_peers=dht.num_known_peers,
            stored_records=dht.storage.num_records,
        )
        try:
            self._metrics_address = await asyncio.to_thread(metrics.start)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {address}: {exc.strerror}") from None
        self._metrics = metrics
        self._tasks.spawn(self._sync_metrics(metrics), name="metrics-sync")

    async def _sweep_shm(self) -> None:
        """Drop mappings and unlink files of client processes that have exited."""
        while True:
            self.segments.sweep()
            await asyncio.to_thread(shm.sweep_stale)
            await asyncio.sleep(SHM_SWEEP_INTERVAL)

    async def _sync_metrics(self, metrics: Any) -> None:
        while True:
            metrics.sync()
            await asyncio.sleep(1.0)

    def _on_matchmaking(self, event: MatchmakingEvent, key: str, peer_id: bytes) -> None:
        # Per-round lines stay at DEBUG: the narrator's summary says how rounds went.
        if event is MatchmakingEvent.GROUP_FORMED:
            log.debug("group formed under %s", key)
        else:
            log.debug("matchmaking %s under %s: %s", event.value, key, peer_id.hex()[:12])

    # ---- what the control service calls ----

    async def _average(
        self,
        arrays: list[np.ndarray],
        request: RoundRequest,
        *,
        out: list[np.ndarray] | None = None,
        inputs_ready: Awaitable[object] | None = None,
        checked_by_client: bool = False,
    ) -> AveragingResult:
        """One swarm round for a local batch; counts it in the stats under the codec the
        group used (its leader's choice). ``out``: where the result goes (a client's shared
        memory), else new arrays. ``inputs_ready``: the check of ``arrays`` still running;
        ``checked_by_client``: only the client checked them (:meth:`Averager.run`)."""
        if self.averager is None:
            raise RuntimeError("the peer is not started")
        started = time.monotonic()
        try:
            result = await self.averager.run(
                arrays,
                request,
                out=out,
                inputs_ready=inputs_ready,
                checked_by_client=checked_by_client,
            )
        except asyncio.CancelledError:
            self.stats.record_failure("cancelled")
            self.round_log.round_failed(request.key, "cancelled")
            raise
        except Exception as exc:
            if _is_outcome_of(inputs_ready, exc) or (
                checked_by_client and isinstance(exc, InvalidTensorsError)
            ):
                raise  # the caller's own tensors, refused: the control service counts it
            reason = classify(exc)[1]
            self.stats.record_failure(reason)
            self.round_log.round_failed(request.key, reason)
            log.info("round %s failed (%s): %s", request.key, reason, exc)
            raise
        log.debug(
            "round %s done: %d peers, codec %s, %d bytes sent%s",
            request.key,
            result.group_size,
            result.codec,
            result.bytes_sent,
            " (partial)" if result.partial else "",
        )
        self.stats.record_round(
            result.codec,
            time.monotonic() - started,
            result.bytes_sent,
            result.bytes_received,
            result.timings,
            partial=result.partial,
        )
        self.round_log.round_done(
            request.key, result.group_id, result.group_size, partial=result.partial
        )
        return result

    def record_failure(self, reason: str) -> None:
        self.stats.record_failure(reason)

    async def dht_store(self, key: str, value: Any, ttl: float, subkey: Any) -> bool:
        if self.dht is None:
            raise RuntimeError("the peer is not started")
        if key == trainers_key(self.config.run_id):  # a local trainer: for the status
            self.local_trainers.remember(subkey, value, time.monotonic() + ttl)
        return bool(await self.dht.store(key, value, time.time() + ttl, subkey=subkey))

    async def dht_get(self, key: str) -> tuple[bool, Any]:
        if self.dht is None:
            raise RuntimeError("the peer is not started")
        return await read_value(self.dht, key)

    async def publish_state(self, arrays: list[np.ndarray], metadata: bytes) -> None:
        if self.averager is None:
            raise RuntimeError("the peer is not started")
        await self.averager.publish_state(arrays, metadata)

    async def load_state(
        self, timeout: float, max_bytes: int | None = None
    ) -> tuple[bytes, list[np.ndarray]]:
        if self.averager is None:
            raise RuntimeError("the peer is not started")
        metadata, tensors = await self.averager.load_state(timeout, max_bytes)
        return bytes(metadata), list(tensors)

    def state_progress(self) -> TransferProgress | None:
        """The newest state download's progress (for the LoadState call that waits on it)."""
        return None if self.averager is None else self.averager.state_progress

    async def peers(self, training_run: str) -> control_pb2.PeersResponse:
        """Every peer of the run and its progress (``swarmavg peers``): the progress records
        of ``training_run`` (default: this daemon's run) read through the DHT, joined with
        the routing table for addresses."""
        if self.dht is None:
            raise RuntimeError("the peer is not started")
        this = ThisPeer(self.peer_id, self.address)
        return await gather_view(self.dht, self.config.run_id, training_run, this)

    def status(self) -> control_pb2.StatusResponse:
        """The daemon's figures (``active_calls`` is filled in by the control service)."""
        s = self.stats
        dht = self.dht
        response = control_pb2.StatusResponse(
            peer_id=self.peer_id,
            run_id=self.config.run_id,
            address=self.address or "",
            control=str(self.control),
            client_mode=self.config.client_mode,
            known_peers=dht.num_known_peers() if dht is not None else 0,
            kind="peer",
            stored_records=dht.storage.num_records() if dht is not None else 0,
            dht_size_estimate=float(dht.size_estimate()) if dht is not None else 0.0,
            rounds_done=s.rounds_done,
            rounds_failed=s.rounds_failed,
            rounds_partial=s.rounds_partial,
            bytes_sent=s.bytes_sent,
            bytes_received=s.bytes_received,
            failures=dict(s.failures),
            uptime=time.monotonic() - self._started_at,
            version=installed_version(),
            pid=os.getpid(),
        )
        self._fill_reachability(response)
        response.trainers.extend(
            control_pb2.LocalTrainer(run=t.run, method=t.method, alone=t.alone)
            for t in self.local_trainers.live(time.monotonic())
        )
        if self.averager is not None:
            response.bandwidth = self.averager.bandwidth.value
            response.bandwidth_measured = self.averager.bandwidth.measured
            response.bandwidth_samples = self.averager.bandwidth.samples
        for name, figures in s.codecs.items():
            response.codecs[name].CopyFrom(
                control_pb2.CodecStats(
                    rounds=figures.rounds,
                    bytes_sent=figures.bytes_sent,
                    bytes_received=figures.bytes_received,
                    seconds=figures.seconds,
                )
            )
        if shm.shm_available():
            info = os.stat(shm.SHM_DIR)
            response.shm_dir = str(shm.SHM_DIR)
            response.shm_dev = info.st_dev
            response.shm_ino = info.st_ino
        return response

    def _fill_reachability(self, response: control_pb2.StatusResponse) -> None:
        nat = self.nat
        if self.config.client_mode:
            response.reachability = "client"
        if nat is None:
            return
        response.reachability = nat.mode
        if nat.reachability is not None:
            response.observed_host = nat.reachability.observed_host
        if nat.keeper is not None and nat.keeper.current is not None:
            response.relay = nat.keeper.current.relay
            response.relay_id = nat.keeper.current.relay_id.hex()
            response.relay_moves = nat.keeper.moves
        if nat.relay is not None:
            relay = nat.relay.status()
            response.relaying_reservations = relay["reservations"]
            response.relayed_bytes = relay["relayed_bytes"]
            response.relayed_connections = relay["relayed_connections"]
        punching = nat.punch_status()
        response.direct_peers.extend(punching.direct_peers)
        response.punches_succeeded = punching.punches_succeeded
        response.punches_failed = punching.punches_failed

    def client(self) -> AsyncClient:
        """An :class:`AsyncClient` for this peer (``async with peer.client() as c:``)."""
        if self.control is None:
            raise RuntimeError("the peer is not started")
        return AsyncClient(str(self.control))

    # ---- lifecycle ----

    async def shutdown(self, grace: float | None = None) -> None:
        """Stop: refuse new calls, give rounds in flight ``grace`` seconds (default: the
        config's ``shutdown_grace``), cancel the rest, leave the DHT, close everything.

        Idempotent. The whole sequence shares one deadline, ``grace + 2`` seconds away, so
        a Ctrl+C always ends the daemon within a few seconds however slow a step is.
        """
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.shutdown_grace if grace is None else grace
        deadline = time.monotonic() + grace + 2.0

        def left(cap: float) -> float:
            return min(cap, max(deadline - time.monotonic(), 0.1))

        if self._control_service is not None:
            self._control_service.stop_accepting()
        if self.averager is not None:
            await bounded_step(
                self.averager.shutdown(grace), left(grace + 0.5), "averager shutdown"
            )
        await bounded_step(self.combiner.close(), left(1.0), "local rounds")
        if self._control_server is not None:
            await bounded_step(self._control_server.stop(0.2), left(1.0), "control server")
        await self._tasks.close()
        self.segments.close()
        if self.dht is not None:
            await bounded_step(self.dht.shutdown(), left(1.0), "DHT shutdown")
        if self.nat is not None:
            await bounded_step(self.nat.close(), left(1.0), "relay")
        if self._public_server is not None:
            await bounded_step(self._public_server.stop(0.2), left(1.0), "public server")
        if self._channels is not None:
            # Closing the pool also cancels its sweeper task: give it a real chance.
            await bounded_step(self._channels.close(), max(left(2.0), 0.5), "channels")
        if self._metrics is not None:
            await asyncio.to_thread(self._metrics.stop)
        if self._control_server is not None:
            self._control_server.remove_files()
        release_claim(self.control.path if self.control is not None else None)
        log.log(logging.DEBUG if self._failed_start else logging.INFO, "peer stopped")

    async def __aenter__(self) -> Peer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()


def _is_outcome_of(future: Awaitable[object] | None, exc: BaseException) -> bool:
    """Whether ``exc`` is what the finished ``future`` raised."""
    return (
        isinstance(future, asyncio.Future)
        and future.done()
        and not future.cancelled()
        and future.exception() is exc
    )
