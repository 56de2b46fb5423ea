"""Settings of one DHT node (one dataclass; the CLI and the peer config map onto it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from swarmavg.dht.auth import DEFAULT_AUTH_WINDOW, DEFAULT_MAX_NONCES
from swarmavg.dht.quotas import StorageQuotas
from swarmavg.dht.ratelimit import RateLimits
from swarmavg.dht.validation import DHTLimits, KeyClass, RecordValidator


@dataclass
class DHTConfig:
    """How a DHT node behaves. Validated on construction (``ValueError`` with the reason).

    Attributes:
        run_id: the run this node belongs to; requests from other runs are rejected.
        initial_peers: HOST:PORT addresses to bootstrap from; empty starts a new DHT.
        client_mode: use the DHT without serving it (behind NAT): no server, never put into
            other nodes' routing tables.
        k: bucket size and default replication (paper: k=20).
        alpha: parallel requests per lookup (paper: alpha=3).
        replication: how many of the nearest nodes store each record (None: k).
        b: bucket-splitting relaxation of paper section 4.2 (see routing.py).
        request_timeout: deadline of one RPC, seconds.
        lookup_timeout: deadline of one whole lookup (all keys of one traversal), seconds.
        bootstrap_timeout: how long :meth:`DHTNode.start` keeps retrying the initial peers.
        bootstrap_backoff, bootstrap_backoff_max: first and largest pause between bootstrap
            rounds (doubling, jittered by +-50%).
        refresh_interval: a bucket without a lookup for this long is refreshed (paper 2.3:
            an hour; shorter here because volunteer swarms churn faster).
        republish_interval: records are re-stored on their current nearest nodes this often,
            unless someone else stored them to us in the meantime (paper 2.5).
        maintenance_interval: how often the background task wakes up to sweep expired
            records, refresh, republish and re-ping the initial peers.
        rejoins_per_round: how many nodes of the whole swarm, on average, rejoin through
            each initial peer per maintenance round: a node does so with probability
            ``rejoins_per_round / size_estimate`` (always in a swarm that small). Bounds an
            initial peer's maintenance load whatever the swarm's size, while a restarted
            bootstrap node still hears from that many nodes each round (dht/node.py).
        cache_on_lookup: after a successful get, cache the record on the nearest queried node
            that lacked it (paper 2.3).
        get_quorum: a non-``latest`` get stops once this many nodes returned the key.
        stale_after: a contact without a replacement waiting is dropped after this many
            failed requests in a row (paper 4.1); with a replacement, after one.
        auth_window: seconds a signed message stays acceptable either side of the receiver's
            clock (:mod:`swarmavg.dht.auth`); older or newer ones are refused, and nonces are
            remembered this long against replays. Peers' clocks must agree within it.
        auth_max_nonces: size cap of the replay cache (see
            :class:`~swarmavg.dht.auth.Authenticator`).
        limits: size caps on keys, values, batches and storage.
        validators: extra record checks (e.g. :class:`~swarmavg.dht.validation.SchemaValidator`).
        key_classes: keys that accept only owner-signed dictionary entries
            (:class:`~swarmavg.dht.validation.KeyClass`); the first matching class applies.
            The peer daemon registers the averaging layer's protocol keys here.
        contacts_per_range: most contacts of one address range (IPv4 /24, IPv6 /48) in one
            bucket, and again in its replacement cache, against eclipse attacks (ids are
            cheap, networks are not; dht/routing.py). 0: no limit.
        limit_local_ranges: apply the range limits (routing table, storage quotas, request
            rates) to loopback and private addresses too. Off by default: a test swarm runs
            hundreds of nodes on 127.0.0.1 and a LAN cluster shares one private /24, and an
            outsider cannot put nodes there (a public sender that claims a local address is
            not learned, see dht/protocol.py). Turn it on to test the limits on 127.x.y.z.
        storage_quotas: bytes, records and subkeys per key that one source (peer id and
            address range) may hold here (dht/quotas.py); over a quota a store gets FULL.
        rate_limits: requests per second per source on the DHT service (dht/ratelimit.py);
            over the limit a request gets RESOURCE_EXHAUSTED.
        signature_cache: verified record signatures remembered, so that records seen again
            (republished, cached, answered by several replicas) cost no Ed25519 work.
    """

    run_id: str = "default"
    initial_peers: Sequence[str] = ()
    client_mode: bool = False
    k: int = 20
    alpha: int = 3
    replication: int | None = None
    b: int = 5
    request_timeout: float = 3.0
    lookup_timeout: float = 10.0
    bootstrap_timeout: float = 30.0
    bootstrap_backoff: float = 0.5
    bootstrap_backoff_max: float = 8.0
    refresh_interval: float = 600.0
    republish_interval: float = 600.0
    maintenance_interval: float = 30.0
    rejoins_per_round: int = 32
    cache_on_lookup: bool = True
    get_quorum: int = 1
    stale_after: int = 3
    auth_window: float = DEFAULT_AUTH_WINDOW
    auth_max_nonces: int = DEFAULT_MAX_NONCES
    limits: DHTLimits = field(default_factory=DHTLimits)
    validators: tuple[RecordValidator, ...] = ()
    key_classes: tuple[KeyClass, ...] = ()
    contacts_per_range: int = 2
    limit_local_ranges: bool = False
    storage_quotas: StorageQuotas = field(default_factory=StorageQuotas)
    rate_limits: RateLimits = field(default_factory=RateLimits)
    signature_cache: int = 65536

    def __post_init__(self) -> None:
        if isinstance(self.initial_peers, str):
            raise ValueError("initial_peers is a sequence of HOST:PORT strings, not one string")
        self.initial_peers = tuple(self.initial_peers)
        self.key_classes = tuple(self.key_classes)
        for address in self.initial_peers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"initial peer {address!r} is not HOST:PORT")
        if not self.run_id:
            raise ValueError("run_id must not be empty")
        for name in (
            "k",
            "alpha",
            "b",
            "get_quorum",
            "stale_after",
            "auth_max_nonces",
            "rejoins_per_round",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.contacts_per_range < 0 or self.signature_cache < 0:
            raise ValueError("contacts_per_range and signature_cache must be >= 0")
        if self.replication is not None and self.replication < 1:
            raise ValueError("replication must be >= 1 (or None for k)")
        for name in (
            "request_timeout",
            "lookup_timeout",
            "bootstrap_timeout",
            "bootstrap_backoff",
            "bootstrap_backoff_max",
            "refresh_interval",
            "republish_interval",
            "maintenance_interval",
            "auth_window",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")

    @property
    def num_replicas(self) -> int:
        return self.k if self.replication is None else self.replication
