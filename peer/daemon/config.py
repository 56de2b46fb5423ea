"""``PeerConfig``: the daemon's settings as one tree, and how it maps onto the components.

The tree has one section per component, each a small frozen dataclass of the settings a
user may need, mapping onto one component config:

- ``[peer]``: ``PeerConfig``'s own fields: the daemon (``peer/daemon/daemon.py``), its run and
  addresses;
- ``[dht]``: ``config.dht`` -> :class:`~swarmavg.dht.config.DHTConfig`;
- ``[averaging]``: ``config.averaging`` -> :class:`~swarmavg.averaging.averager.AveragerConfig`;
- ``[allreduce]``: ``config.allreduce`` ->
  :class:`~swarmavg.averaging.allreduce.config.AllReduceConfig` (with the data plane);
- ``[state]``: ``config.state`` -> :class:`~swarmavg.averaging.state.config.StateSharingConfig`.

:meth:`PeerConfig.dht_config` and :meth:`PeerConfig.averager_config` build the component
configs; every component field no section reaches is listed in :data:`INTERNAL` (on
purpose: see there). Defaults are the component configs' own, so the two cannot drift.
Where each setting comes from (flag, ``SWARMAVG_*`` env var, TOML key) is
:mod:`swarmavg.peer.daemon.settings`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from swarmavg.averaging.allreduce.config import MAX_STREAMS_PER_SENDER, AllReduceConfig
from swarmavg.averaging.allreduce.congestion import AUTO, check_name
from swarmavg.averaging.averager import AveragerConfig
from swarmavg.averaging.group import Mode
from swarmavg.averaging.matchmaking.config import MatchmakerConfig
from swarmavg.averaging.matchmaking.keys import validate_bits
from swarmavg.averaging.state.config import StateSharingConfig
from swarmavg.compression import get_codec
from swarmavg.dht.config import DHTConfig

DEFAULT_LISTEN = "0.0.0.0:31337"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_BANDWIDTH = 1e6
"""MB/s; a set bandwidth above 1 TB/s is a typo (the unit is MB/s, not bit/s)."""


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    """Raise ``ValueError`` naming the setting unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} {value!r}: {expected}")


@dataclass(frozen=True)
class DHTSettings:
    """``[dht]``: the DHT node (:class:`~swarmavg.dht.config.DHTConfig`).

    Attributes:
        bootstrap_timeout: seconds to keep retrying the initial peers before giving up.
        auth_window: seconds a signed message stays acceptable either side of this peer's
            clock (docs/security.md); peers' clocks must agree within it.
    """

    bootstrap_timeout: float = DHTConfig.bootstrap_timeout
    auth_window: float = DHTConfig.auth_window

    def __post_init__(self) -> None:
        _check(
            0 < self.bootstrap_timeout <= 3600,
            "bootstrap_timeout",
            self.bootstrap_timeout,
            "(0, 3600] seconds",
        )
        _check(1 <= self.auth_window <= 3600, "auth_window", self.auth_window, "[1, 3600] seconds")


@dataclass(frozen=True)
class AveragingSettings:
    """``[averaging]``: matchmaking and rounds
    (:class:`~swarmavg.averaging.averager.AveragerConfig`).

    Attributes:
        group_size: the target group size when a caller passes ``group_size=None``.
        bandwidth: MB/s this peer advertises; parts of a round are sized in proportion to
            the members' bandwidths. ``None``: measured from this peer's rounds, starting
            from a conservative 10 MB/s
            (:class:`~swarmavg.averaging.allreduce.throughput.ThroughputEstimator`).
        default_codec: codec of the groups this peer leads when a caller names none.
        matchmaking_time: seconds a leader waits for more peers before it closes a group
            that is not full (it closes at once when full).
        group_bits: initial Moshpit group bits (a string of 0/1, docs/averaging.md);
            empty: every peer of the run meets under one key.
    """

    group_size: int = AveragerConfig.target_group_size
    bandwidth: float | None = AveragerConfig.bandwidth
    default_codec: str = AveragerConfig.default_codec
    matchmaking_time: float = AveragerConfig.matchmaking_time
    group_bits: str = AveragerConfig.group_bits

    def __post_init__(self) -> None:
        _check(2 <= self.group_size <= 256, "group_size", self.group_size, "between 2 and 256")
        if self.bandwidth is not None:
            _check(
                math.isfinite(self.bandwidth) and 0 < self.bandwidth <= MAX_BANDWIDTH,
                "bandwidth",
                self.bandwidth,
                f"MB/s, > 0 and <= {MAX_BANDWIDTH:g} (unset: measured)",
            )
        try:
            get_codec(self.default_codec)
        except ValueError as exc:
            raise ValueError(f"default_codec {self.default_codec!r}: {exc}") from None
        _check(
            0 < self.matchmaking_time <= 300,
            "matchmaking_time",
            self.matchmaking_time,
            "(0, 300] seconds",
        )
        try:
            validate_bits(self.group_bits)
        except ValueError as exc:
            raise ValueError(f"group_bits {self.group_bits!r}: {exc}") from None


@dataclass(frozen=True)
class AllReduceSettings:
    """``[allreduce]``: the all-reduce and its data plane
    (:class:`~swarmavg.averaging.allreduce.config.AllReduceConfig`).

    Attributes:
        data_port: TCP port of the data plane (all-reduce streams over plain TCP on the
            listen host; the announced host is advertised with it): 0 picks a free port,
            -1 turns it off (all-reduce streams then use the gRPC port only).
        executor_threads: threads for codec work and reduction, off the event loop; 0 runs
            it on the loop. ``None``: 0 on machines with at most 2 cores, else 2.
        min_stall: seconds without progress after which a sender or reducer counts as
            stalled and is dropped (longer on slow links; see ``AllReduceConfig``).
        weight_bound: under the mean, a sender's weight counts as at most this many times
            the median weight of the part's senders (the robust aggregation
            rules bound it by the median).
        congestion_control: TCP congestion control algorithm of the data plane's
            connections (``cubic``, ``bbr``, ...); ``auto`` (the default): BBR on paths
            of 75 ms of round trip or more where the daemon may use it, the kernel's
            default elsewhere; ``kernel`` or ``None``: the kernel's default. The daemon
            refuses to start with a name the kernel does not let it use.
        streams_per_reducer: data-plane connections a part goes over to its reducer at
            once, 1 to 8 (when more help and when they hurt: ``AllReduceConfig``).
    """

    data_port: int = AllReduceConfig.data_port
    executor_threads: int | None = None
    min_stall: float = AllReduceConfig.min_stall
    weight_bound: float = AllReduceConfig.weight_bound
    congestion_control: str | None = AUTO
    streams_per_reducer: int = AllReduceConfig.streams_per_reducer

    def __post_init__(self) -> None:
        _check(
            -1 <= self.data_port <= 65535,
            "data_port",
            self.data_port,
            "a TCP port, 0 (any free) or -1 (off)",
        )
        if self.executor_threads is not None:
            _check(
                0 <= self.executor_threads <= 64,
                "executor_threads",
                self.executor_threads,
                "between 0 (on the event loop) and 64",
            )
        _check(0 < self.min_stall <= 600, "min_stall", self.min_stall, "(0, 600] seconds")
        _check(1 <= self.weight_bound <= 1e6, "weight_bound", self.weight_bound, "in [1, 1e6]")
        if self.congestion_control is not None:
            check_name(self.congestion_control)  # the kernel is asked when the daemon starts
        _check(
            1 <= self.streams_per_reducer <= MAX_STREAMS_PER_SENDER,
            "streams_per_reducer",
            self.streams_per_reducer,
            f"between 1 and {MAX_STREAMS_PER_SENDER}",
        )


@dataclass(frozen=True)
class StateSettings:
    """``[state]``: publishing and loading state
    (:class:`~swarmavg.averaging.state.config.StateSharingConfig`).

    Attributes:
        max_state_bytes: the largest state ``load_state`` accepts (checked on the manifest
            before anything is downloaded).
        max_uploads: downloads of this peer's published state served at once; more are
            refused and go to other donors.
        keep_loaded_chunks: keep the last loaded state's chunks, so that the next load
            fetches only the chunks that changed (costs one copy of the state in memory).
    """

    max_state_bytes: int = StateSharingConfig.max_state_bytes
    max_uploads: int = StateSharingConfig.max_uploads
    keep_loaded_chunks: bool = StateSharingConfig.keep_loaded_chunks

    def __post_init__(self) -> None:
        _check(self.max_state_bytes >= 1, "max_state_bytes", self.max_state_bytes, ">= 1 byte")
        _check(1 <= self.max_uploads <= 1024, "max_uploads", self.max_uploads, "1..1024")


@dataclass
class PeerConfig:
    """Settings of one ``swarmavg peer`` daemon (its own fields are the ``[peer]`` section).

    Attributes:
        listen: ``HOST:PORT`` the public gRPC server binds; port 0 picks a free port.
        announce: ``HOST:PORT`` other peers should dial; ``None``: derived from ``listen``.
        join: initial peers (``HOST:PORT``); empty starts a new swarm.
        run_id: the collaboration's name; everything stored or averaged is namespaced by it.
        control: control endpoint (unix socket path or ``127.0.0.1:PORT``); ``None``: the
            default socket for ``run_id``.
        client_mode: accept no incoming connections (behind NAT or a firewall). Without it a
            peer finds out itself whether others can dial it (dial-back) and, behind NAT,
            is reached through a relay (docs/peer.md, "Behind NAT").
        relay: when this peer is publicly reachable, relay connections for NATed peers
            (bounded: peer/nat/limits.py).
        relay_rate: MiB/s that one source (a dialer's address range) may push through this
            peer's relay, both directions together; a faster one is slowed, not cut.
        hole_punching: when this peer is relayed, punch direct connections to the other
            relayed peers it dials (docs/peer.md, "Hole punching"); off: always the relay.
        identity: file holding the Ed25519 key; ``None``: a fresh identity per start.
        run_file: a private run's run file (``swarmavg run init``): the run id and the run
            authority's certificate. With ``credential``: mutual TLS on the gRPC port and the
            data plane, and only peers holding a credential of the run are admitted
            (docs/private-runs.md). ``None``: a public run.
        credential: this peer's credential in the private run (``swarmavg run invite``),
            issued for ``identity``'s peer id.
        revocations: a private run's revocation list (``swarmavg run revoke``): the peers it
            names are refused on every path; the file is read again when it changes, and the
            list spreads to every peer of the run through the DHT (docs/private-runs.md).
        metrics: ``HOST:PORT`` for the Prometheus endpoint; ``None``: no metrics server.
        log_level: Python logging level name.
        local_window: the longest a round waits for the other local training processes
            (those seen recently) to call with the same key before the daemon contributes
            their combined tensors; a lone process never waits.
        shutdown_grace: seconds the first SIGINT/SIGTERM gives rounds in flight.
        summary_interval: seconds between the daemon's summary log lines; 0: none.
        dht: the ``[dht]`` section.
        averaging: the ``[averaging]`` section.
        allreduce: the ``[allreduce]`` section.
        state: the ``[state]`` section.
    """

    listen: str = DEFAULT_LISTEN
    announce: str | None = None
    join: list[str] = field(default_factory=list)
    run_id: str = "default"
    control: str | None = None
    client_mode: bool = False
    relay: bool = True
    relay_rate: float = 32.0
    hole_punching: bool = True
    identity: str | None = None
    run_file: str | None = None
    credential: str | None = None
    revocations: str | None = None
    metrics: str | None = None
    log_level: str = "INFO"
    local_window: float = 0.5
    shutdown_grace: float = 2.0
    summary_interval: float = 60.0
    dht: DHTSettings = field(default_factory=DHTSettings)
    averaging: AveragingSettings = field(default_factory=AveragingSettings)
    allreduce: AllReduceSettings = field(default_factory=AllReduceSettings)
    state: StateSettings = field(default_factory=StateSettings)

    def __post_init__(self) -> None:
        self.join = split_addresses(self.join)
        self.log_level = self.log_level.upper()
        self.validate()

    def validate(self) -> None:
        """Check the ``[peer]`` fields (sections check themselves when built).

        Raises:
            ValueError: naming the bad setting.
        """
        parse_host_port(self.listen, "listen", allow_port_zero=True)
        if self.announce is not None:
            parse_host_port(self.announce, "announce")
        for address in self.join:
            parse_host_port(address, "join")
        if self.metrics is not None:
            parse_host_port(self.metrics, "metrics", allow_port_zero=True)
        if not self.run_id or len(self.run_id) > 128 or "/" in self.run_id:
            raise ValueError(f"run_id {self.run_id!r}: 1-128 characters, no '/'")
        if (self.run_file is None) != (self.credential is None):
            raise ValueError(
                "a private run needs both run_file and credential (--run-file and --credential)"
            )
        if self.run_file is not None and self.identity is None:
            raise ValueError(
                "a private run needs identity (--identity FILE): the credential names the "
                "peer id of one identity"
            )
        if self.revocations is not None and self.run_file is None:
            raise ValueError(
                "a revocation list (--revocations) belongs to a private run: give --run-file "
                "and --credential too"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level {self.log_level!r}: one of {', '.join(LOG_LEVELS)}")
        if not 0 < self.relay_rate <= 1e6:
            raise ValueError(f"relay_rate {self.relay_rate}: MiB/s, above 0")
        if not 0 <= self.local_window <= 10:
            raise ValueError(f"local_window {self.local_window}: between 0 and 10 seconds")
        if not 0 <= self.shutdown_grace <= 60:
            raise ValueError(f"shutdown_grace {self.shutdown_grace}: between 0 and 60 seconds")
        if not 0 <= self.summary_interval <= 86400:
            raise ValueError(
                f"summary_interval {self.summary_interval}: between 0 (off) and 86400 seconds"
            )

    @property
    def private(self) -> bool:
        """Whether this peer belongs to a private run (it has a run file and a credential)."""
        return self.run_file is not None

    def dht_config(self) -> DHTConfig:
        """The DHT node's config: run, initial peers and client mode come from ``[peer]``."""
        return DHTConfig(
            run_id=self.run_id,
            initial_peers=tuple(self.join),
            client_mode=self.client_mode,
            bootstrap_timeout=self.dht.bootstrap_timeout,
            auth_window=self.dht.auth_window,
        )

    def averager_config(self) -> AveragerConfig:
        """The averager's config, with its all-reduce and state-sharing configs.

        Derived rather than set: ``mode`` from ``client_mode``; the data plane is on unless
        ``data_port`` is -1, and listens on the host of ``listen``.
        """
        listen_host, _ = parse_host_port(self.listen, "listen", allow_port_zero=True)
        averaging, allreduce, state = self.averaging, self.allreduce, self.state
        allreduce_config = AllReduceConfig(
            min_stall=allreduce.min_stall,
            weight_bound=allreduce.weight_bound,
            congestion_control=allreduce.congestion_control,
            streams_per_reducer=allreduce.streams_per_reducer,
            data_plane=allreduce.data_port >= 0,
            data_host=listen_host,
            data_port=max(allreduce.data_port, 0),
        )
        if allreduce.executor_threads is not None:  # else the default by core count
            allreduce_config = dataclasses.replace(
                allreduce_config, executor_threads=allreduce.executor_threads
            )
        return AveragerConfig(
            mode=Mode.CLIENT if self.client_mode else Mode.NODE,
            bandwidth=averaging.bandwidth,
            target_group_size=averaging.group_size,
            matchmaking_time=averaging.matchmaking_time,
            default_codec=averaging.default_codec,
            group_bits=averaging.group_bits,
            allreduce=allreduce_config,
            state=StateSharingConfig(
                max_state_bytes=state.max_state_bytes,
                max_uploads=state.max_uploads,
                keep_loaded_chunks=state.keep_loaded_chunks,
            ),
        )


INTERNAL: Mapping[type, tuple[str, ...]] = MappingProxyType(
    {
        # Kademlia's parameters and timers: k, alpha and b shape the whole swarm's routing
        # and must not differ per peer on a whim; the timers follow the paper (dht/config.py).
        DHTConfig: (
            "k",
            "alpha",
            "replication",
            "b",
            "request_timeout",
            "lookup_timeout",
            "bootstrap_backoff",
            "bootstrap_backoff_max",
            "refresh_interval",
            "republish_interval",
            "maintenance_interval",
            "rejoins_per_round",
            "cache_on_lookup",
            "get_quorum",
            "stale_after",
            # The replay cache's size cap: memory, not behaviour (dht/auth.py).
            "auth_max_nonces",
            "limits",
            "validators",
            # The run's protocol keys, set by the daemon (peer/daemon/daemon.py, node_dht_config).
            "key_classes",
            # Guards against hostile sources (docs/dht.md "Quotas and rate
            # limits"): defaults far above what honest peers use, the same on every peer.
            "contacts_per_range",
            "limit_local_ranges",
            "storage_quotas",
            "rate_limits",
            "signature_cache",
        ),
        # matchmaking_share splits the caller's own timeout (a per-call budget, not a
        # daemon property); user_data is a Python API; timeout_grace only closes streams.
        AveragerConfig: ("matchmaking_share", "user_data", "timeout_grace"),
        # Protocol timing: answered from local state, far above any real round trip;
        # initial_latency is only a first guess, replaced by measured latency at once.
        MatchmakerConfig: (
            "poll_interval",
            "join_timeout",
            "retry_after",
            "dht_timeout",
            "max_redirects",
            "initial_latency",
            "start_window",  # a protocol bound on declared starts
            # How many of a key's nearest nodes store and serve declarations.
            "read_quorum",
            "declaration_replicas",
            # Whom a family's first round expects: a rule every peer of a run shares
            # (docs/averaging.md, "When a group closes"); the Python API turns it off.
            "expect_run_members",
        ),
        # Sizes and patience measured in docs/benchmarks-data-path.md; min_stall is the one
        # a slow link needs, and it is in [allreduce].
        AllReduceConfig: (
            "chunk_bytes",
            "stall_factor",
            "registration_wait",
            "finalize_margin",
            "max_waiting_streams",
            # Resource bounds against strangers (docs/averaging.md, bounded resources).
            # Per address range and per sender: far above an honest member's
            # few streams; limit_local_ranges is for tests (127.x.y.z as networks).
            "max_waiting_per_range",
            "max_waiting_per_peer",
            # A member's checks of the others (docs/security.md): a forged part, a sender
            # that trickles. Factors against the round's own honest spread, the same on
            # every peer; None turns the part check off (it runs under robust rules only).
            "part_deviation_factor",
            "slow_sender_factor",
            "max_pending_per_range",
            "first_message_timeout",
            "limit_local_ranges",
            # Whether older peers' unkeyed streams are served: a rule of the run, for the
            # Python API until every peer of a run keys its streams.
            "keyed_streams_only",
            "write_timeout",
            "max_reply_backlog",
            "max_codec_instances",
            "data_connect_timeout",
            "data_retry_after",
        ),
        # Wire and retention details of state sharing (docs/averaging.md, state sharing).
        StateSharingConfig: (
            "chunk_size",
            "ttl",
            "batch_chunks",
            "message_timeout",
            "upload_timeout",
            "retain_versions",
            "retain_seconds",
        ),
    }
)
"""Component settings that no flag, env var or TOML key reaches, on purpose (the comments
say why). Python code can still set them on the component configs. The averager's ``AUX``
mode is also Python-only (``mode`` follows ``client_mode``)."""


def parse_host_port(text: str, what: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` too); raise ``ValueError`` naming ``what`` (with
    the address to write instead when ``text`` is a URL or a multiaddr)."""
    hint = address_hint(text)
    if hint is not None:
        raise ValueError(f"{what} {text!r}: expected HOST:PORT; {hint}")
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{what} {text!r}: expected HOST:PORT")
    port = int(port_text)
    if port > 65535 or (port == 0 and not allow_port_zero):
        raise ValueError(f"{what} {text!r}: port out of range")
    return host.strip("[]"), port


_MULTIADDR = re.compile(r"/(?:ip4|ip6|dns|dns4|dns6)/([^/]+)/(?:tcp|udp)/(\d+)(?:/.*)?")


def address_hint(text: str) -> str | None:
    """What to write instead of a URL (``http://host:port``) or a multiaddr
    (``/ip4/host/tcp/port``, hivemind's and libp2p's form); None for anything else."""
    scheme, sep, rest = text.partition("://")
    if sep:
        plain = rest.split("/", 1)[0]
        return f"drop the {scheme}:// scheme and write {plain!r}"
    if text.startswith("/"):
        match = _MULTIADDR.fullmatch(text)
        if match is None:
            return "multiaddrs are not supported: write the peer's HOST:PORT"
        host, port = match.groups()
        host = f"[{host}]" if ":" in host else host
        return f"multiaddrs are not supported: write {host}:{port}"
    return None


def split_addresses(values: str | list[str] | tuple[str, ...]) -> list[str]:
    """Flatten repeated and comma-separated addresses, dropping blanks and duplicates."""
    items = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return out
