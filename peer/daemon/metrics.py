"""Prometheus export of a daemon's figures (``--metrics HOST:PORT``, docs/peer.md).

prometheus-client is imported only here, and this module only when metrics are enabled.
Counters come from :class:`~swarmavg.peer.daemon.stats.PeerStats`; gauges (DHT size, known peers,
stored records) are read when Prometheus scrapes. A bare DHT node (``swarmavg dht
--metrics``) has no rounds: it exports the gauges only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from swarmavg.peer.daemon.config import parse_host_port
from swarmavg.peer.daemon.stats import PeerStats

log = logging.getLogger(__name__)

PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class MetricsServer:
    """An HTTP endpoint serving the daemon's metrics in the Prometheus text format.

    ``start`` binds (raising ``OSError`` when the port is taken); ``stop`` is idempotent.
    """

    def __init__(
        self,
        address: str,
        stats: PeerStats | None,
        dht_size: Callable[[], float],
        known_peers: Callable[[], int],
        stored_records: Callable[[], int] | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.host, self.port = parse_host_port(address, "metrics", allow_port_zero=True)
        self._stats = stats
        self.registry = CollectorRegistry(auto_describe=True)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        reg = self.registry
        dht = Gauge("swarmavg_dht_size", "Estimated number of DHT nodes", registry=reg)
        dht.set_function(dht_size)
        peers = Gauge("swarmavg_known_peers", "Peers in the routing table", registry=reg)
        peers.set_function(lambda: float(known_peers()))
        if stored_records is not None:
            stored = Gauge(
                "swarmavg_dht_stored_records", "DHT records this node stores", registry=reg
            )
            stored.set_function(lambda: float(stored_records()))
        self._seen: dict[str, float] = {}
        if stats is not None:
            self._add_round_metrics()

    def _add_round_metrics(self) -> None:
        from prometheus_client import Counter, Histogram

        reg = self.registry
        self._rounds = Counter("swarmavg_rounds", "Averaging rounds", ["outcome"], registry=reg)
        self._partial = Counter(
            "swarmavg_partial_rounds",
            "Successful rounds that ended partial (also counted as done)",
            registry=reg,
        )
        self._failures = Counter(
            "swarmavg_round_failures", "Failed rounds by reason", ["reason"], registry=reg
        )
        self._bytes = Counter(
            "swarmavg_averaging_bytes", "Bytes moved by averaging", ["direction"], registry=reg
        )
        self._phase = Histogram(
            "swarmavg_round_phase_seconds",
            "Round duration by phase",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=reg,
        )

    def sync(self) -> None:
        """Move the counters' increments since the last call into Prometheus."""
        s = self._stats
        if s is None:
            return
        self._bump(self._rounds.labels("done"), "done", s.rounds_done)
        self._bump(self._rounds.labels("failed"), "failed", s.rounds_failed)
        self._bump(self._partial, "partial", s.rounds_partial)
        self._bump(self._bytes.labels("sent"), "sent", s.bytes_sent)
        self._bump(self._bytes.labels("received"), "received", s.bytes_received)
        for reason, count in s.failures.items():
            self._bump(self._failures.labels(reason), "failure:" + reason, count)
        for phase, samples in s.drain_phase_samples().items():
            for value in samples:
                self._phase.labels(phase).observe(value)

    def _bump(self, counter: Any, name: str, total: float) -> None:
        delta = total - self._seen.get(name, 0.0)
        if delta > 0:
            counter.inc(delta)
            self._seen[name] = total

    def start(self) -> str:
        """Bind and serve in a background thread; return the bound ``HOST:PORT``."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(
            self.port, addr=self.host, registry=self.registry
        )
        self.port = int(self._server.server_port)
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
