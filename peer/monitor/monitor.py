"""``swarmavg monitor``: a light peer that records a run over time (docs/peer.md, "Monitor").

The monitor joins the run's DHT in client mode (it serves nothing to the swarm and takes no
part in averaging), reads the run's view every ``interval`` seconds (the progress records
of every trainer and its routing table, as ``swarmavg peers`` does:
:mod:`swarmavg.peer.daemon.run_gather`, and the daemons' round reports:
:mod:`swarmavg.peer.daemon.round_reports`), keeps the newest samples in a ring buffer
(:mod:`swarmavg.peer.monitor.series`), writes each sample to the sinks asked for (CSV,
TensorBoard, wandb: :mod:`swarmavg.peer.monitor.sinks`) and serves a dashboard that plots
them (:mod:`swarmavg.peer.monitor.http_server`).

It has the daemons' lifecycle (``start``, ``ready_record``, ``shutdown``), so the CLI runs it
like them: one JSON ready line on stdout, the first Ctrl+C stops it (within a few seconds:
every step of the shutdown is bounded), a second exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmavg.dht import BootstrapError, ChannelPool, DHTNode, Identity
from swarmavg.dht.tasks import TaskSet, bounded_step
from swarmavg.peer.client.run_view import ThisPeer, view_to_dict
from swarmavg.peer.daemon.config import DHTSettings, PeerConfig, parse_host_port
from swarmavg.peer.daemon.daemon import (
    StartupError,
    bootstrap_message,
    load_tls,
    node_dht_config,
    revocation_keeper,
)
from swarmavg.peer.daemon.round_reports import parse_reports, rounds_key
from swarmavg.peer.daemon.run_gather import gather_view, read_value
from swarmavg.peer.monitor.health import health_json, round_totals
from swarmavg.peer.monitor.http_server import DashboardServer
from swarmavg.peer.monitor.page import render_page
from swarmavg.peer.monitor.series import DEFAULT_HISTORY, History, Sample, sample_from_view
from swarmavg.peer.monitor.sinks import Sink, SinkUnavailable, close_sinks, open_sinks, write_all

# The room's name, not the module's: a user reads "swarmavg.peer.monitor: ..." in the log.
log = logging.getLogger("swarmavg.peer.monitor")

DEFAULT_INTERVAL = 5.0
"""Seconds between polls: a poll costs three DHT lookups (docs/benchmarks.md, "Peer")."""
DEFAULT_HTTP = "127.0.0.1:8470"
"""Where the dashboard listens unless told otherwise (loopback: see ``--http``)."""
MAX_INTERVAL = 3600.0


@dataclass(frozen=True)
class MonitorSettings:
    """What ``swarmavg monitor`` was asked to do.

    Attributes:
        run_id: the run to join (its DHT refuses other runs' nodes).
        join: initial peers, ``HOST:PORT``; at least one (a monitor alone sees nothing).
        training_run: the run id the trainers report progress under; empty: ``run_id``.
        interval: seconds between polls.
        history: samples the dashboard keeps (older ones leave the ring buffer; the CSV,
            TensorBoard and wandb logs keep everything).
        http: ``HOST:PORT`` of the dashboard; None: no dashboard.
        csv: a CSV file to append every sample to.
        tensorboard: a TensorBoard log folder.
        wandb_project: a wandb project to log to.
        bootstrap_timeout: seconds to retry the initial peers.
        poll_timeout: the longest one poll (three DHT lookups, in parallel) may take.
        log_level: the logging level name.
        identity: the monitor's Ed25519 identity file (None: a fresh identity per start).
        run_file, credential: a private run's run file and the monitor's credential in it
            (both, with ``identity``, or neither; docs/private-runs.md): the monitor then
            dials the run's peers over mutual TLS, presenting its credential, as any
            client-mode peer of the run does.
        revocations: the private run's revocation list (``swarmavg run revoke``), as for a
            peer: the monitor refuses the peers it names and passes it on.

    Raises:
        ValueError: a setting out of range or an address that is not ``HOST:PORT`` (the
            message says which and what to write).
    """

    run_id: str
    join: list[str]
    training_run: str = ""
    interval: float = DEFAULT_INTERVAL
    history: int = DEFAULT_HISTORY
    http: str | None = DEFAULT_HTTP
    csv: Path | None = None
    tensorboard: Path | None = None
    wandb_project: str | None = None
    bootstrap_timeout: float = 30.0
    poll_timeout: float = 20.0
    log_level: str = "INFO"
    identity: str | None = None
    run_file: str | None = None
    credential: str | None = None
    revocations: str | None = None
    peer_config: PeerConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval) and 0.1 <= self.interval <= MAX_INTERVAL):
            raise ValueError(
                f"--interval must be between 0.1 and {MAX_INTERVAL:.0f} s, got {self.interval}"
            )
        if self.history < 2:
            raise ValueError(f"--history must keep at least 2 samples, got {self.history}")
        if not (math.isfinite(self.poll_timeout) and self.poll_timeout > 0):
            raise ValueError(f"poll_timeout must be positive, got {self.poll_timeout}")
        if self.http is not None:
            parse_host_port(self.http, "--http", allow_port_zero=True)
        # PeerConfig checks the run id and the initial peers' addresses like a daemon's.
        config = PeerConfig(
            run_id=self.run_id,
            join=list(self.join),
            client_mode=True,
            log_level=self.log_level,
            identity=self.identity,
            run_file=self.run_file,
            credential=self.credential,
            revocations=self.revocations,
            dht=DHTSettings(bootstrap_timeout=self.bootstrap_timeout),
        )
        if not config.join:
            raise ValueError(
                "a monitor needs at least one initial peer of the run: "
                "--initial-peers HOST:PORT (a running peer's or bootstrap node's address)"
            )
        object.__setattr__(self, "peer_config", config)


class Monitor:
    """A running monitor. ``start`` once; ``shutdown`` is idempotent and bounded."""

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        self.history = History(settings.run_id, settings.history)
        self.health: dict[str, Any] = {}  # the newest poll's peers, rounds and alerts
        self.node: DHTNode | None = None
        self.dashboard: DashboardServer | None = None
        self.polls_failed = 0
        self._identity = Identity.generate()
        self._channels: ChannelPool | None = None
        self._sinks: list[Sink] = []
        self._tasks = TaskSet()  # the poll loop, the revocation list
        self._last_logged: tuple[float, float] | None = None
        self._stopped = False

    @property
    def peer_id(self) -> str:
        return self._identity.peer_id_hex

    def ready_record(self) -> dict[str, Any]:
        return {
            "event": "ready",
            "peer_id": self.peer_id,
            "address": None,
            "control": None,
            "run_id": self.settings.run_id,
            "dashboard": self.dashboard.url if self.dashboard is not None else None,
        }

    async def start(self) -> None:
        """Open the sinks, join the DHT, bind the dashboard, start polling.

        Raises:
            StartupError: a sink cannot be opened, no initial peer answered, or the
                dashboard's address cannot be bound (one line saying what to do).
        """
        try:
            await self._start()
        except BaseException:
            await self.shutdown()
            raise

    async def _start(self) -> None:
        s = self.settings
        try:
            self._sinks = await asyncio.to_thread(
                open_sinks, s.run_id, s.csv, s.tensorboard, s.wandb_project
            )
        except SinkUnavailable as exc:
            raise StartupError(str(exc)) from None
        except OSError as exc:
            raise StartupError(f"cannot write {exc.filename}: {exc.strerror}") from None
        if s.http is not None:
            dashboard = DashboardServer(
                s.http, render_page(s.run_id, min(s.interval, 5.0)), self.data
            )
            try:
                await dashboard.start()
            except OSError as exc:
                raise StartupError(
                    f"cannot serve the dashboard on {s.http}: {exc.strerror or exc}; choose "
                    "another with --http HOST:PORT (port 0 picks a free one)"
                ) from None
            self.dashboard = dashboard
        cfg = s.peer_config
        if cfg.identity is not None:
            try:
                self._identity = await asyncio.to_thread(Identity.load_or_create, cfg.identity)
            except (OSError, ValueError) as exc:
                raise StartupError(f"identity file {cfg.identity}: {exc}") from None
        # A private run's peers refuse any handshake without a credential of the run: the
        # monitor presents its own on every channel it opens (it serves nothing).
        tls = load_tls(cfg, self._identity)
        self._channels = ChannelPool(tls=tls)
        self.node = DHTNode(node_dht_config(cfg, tls), self._identity, self._channels)
        keeper = revocation_keeper(cfg, tls, self.node)
        try:
            await self.node.start(None)
        except BootstrapError as exc:
            raise StartupError(bootstrap_message(exc, cfg.private)) from None
        if keeper is not None:
            self._tasks.spawn(keeper.run(), name="revocations")
        self._tasks.spawn(self._poll_forever(), name="monitor-poll")

    async def poll_once(self) -> Sample:
        """Read the run's view once, keep it and write it to the sinks.

        Raises:
            TimeoutError: the DHT lookups took longer than ``poll_timeout``.
        """
        node = self.node
        if node is None:
            raise RuntimeError("the monitor is not started")
        s = self.settings
        async with asyncio.timeout(s.poll_timeout):
            view, (found, raw_reports) = await asyncio.gather(
                gather_view(node, s.run_id, s.training_run, ThisPeer(self.peer_id, None)),
                read_value(node, rounds_key(s.run_id)),
            )
        view_dict = view_to_dict(view)
        reports, ignored = parse_reports(raw_reports if found else None)
        sample = sample_from_view(view_dict, time.time())
        if reports:  # none found is no news, not a run whose counters fell to 0
            sample = Sample(sample.time, {**sample.values, **round_totals(reports)})
        self.health = health_json(view_dict, reports, ignored)
        step = self.history.total
        self.history.add(sample)
        if self._sinks:
            await asyncio.to_thread(write_all, self._sinks, sample, step)
        self._narrate(sample)
        return sample

    def data(self) -> dict[str, Any]:
        """``/data.json``: the history's columns, the newest poll's health, the poll
        interval and the monitor's clock (the page judges staleness against both)."""
        return self.history.to_json() | {
            "health": self.health,
            "interval": self.settings.interval,
            "now": time.time(),
        }

    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.poll_once()
            except (TimeoutError, asyncio.TimeoutError):
                self.polls_failed += 1
                log.warning(
                    "monitor: reading the run's records took over %.0f s; retrying",
                    self.settings.poll_timeout,
                )
            except Exception as exc:  # a monitor outlives a bad poll: log it and poll again
                self.polls_failed += 1
                log.warning("monitor: a poll failed (%s: %s); retrying", type(exc).__name__, exc)
            await asyncio.sleep(max(self.settings.interval - (loop.time() - started), 0.0))

    def _narrate(self, sample: Sample) -> None:
        """An INFO line when the number of peers or the epoch changes (not every poll)."""
        now = (sample.values.get("peers", 0.0), sample.values.get("epoch", -1.0))
        if now != self._last_logged:
            self._last_logged = now
            sps = sample.values.get("samples_per_second")
            log.info(
                "run %s: %d peer(s), epoch %s, %s samples/s",
                self.settings.run_id,
                int(now[0]),
                int(now[1]) if now[1] >= 0 else "-",
                f"{sps:.1f}" if sps is not None else "-",
            )

    async def shutdown(self, grace: float | None = None) -> None:
        """Stop polling, leave the DHT, close the dashboard and the sinks (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        await self._tasks.close()
        if self.dashboard is not None:
            await bounded_step(self.dashboard.stop(), 2.0, "dashboard")
        if self.node is not None:
            await bounded_step(self.node.shutdown(), 1.0, "DHT shutdown")
        if self._channels is not None:
            await bounded_step(self._channels.close(), 2.0, "channels")
        sinks, self._sinks = self._sinks, []
        if sinks:
            await bounded_step(asyncio.to_thread(close_sinks, sinks), 5.0, "sinks")
