"""Address ranges: which contacts count as "the same network" for the anti-eclipse limits.

An attacker can make any number of peer ids, but not any number of networks. So the routing
table limits how many contacts of one address range one bucket holds (routing.py), and the
rate limits and storage quotas count per range as well as per id (ratelimit.py, storage.py).

A range is an IPv4 /24 or an IPv6 /48 (the usual allocation to one site). Hosts that are not
IP literals (DNS names) all share one range, :data:`NAMES_RANGE`: the table never resolves
names, and anyone can point any number of names at one address, so a name says nothing about
the network behind it (when each name was its own range, 40 names filled a
bucket that one /24 may hold 2 places of). ``localhost`` and ``*.localhost`` are local.

Loopback, private (RFC 1918, fc00::/7) and link-local addresses are *local*. Whether they are
limited is the caller's choice (``DHTConfig.limit_local_ranges``, off by default): test swarms
run hundreds of nodes on 127.0.0.1 and a LAN cluster shares one private /24, and neither is a
network an outside attacker can put nodes in. An outsider can still *claim* a local address in
its requests; protocol.py refuses to learn a local address from a request that came from a
public one, so that claim does not bypass the limit.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import time
from collections.abc import Callable
from functools import lru_cache
from urllib.parse import unquote

from swarmavg.dht.ratelimit import RateLimiter, RateLimits

IPV4_PREFIX = 24
IPV6_PREFIX = 48
NAMES_RANGE = "dns-names"
"""The one range of every host that is a DNS name (not a network: never an IP literal)."""
LOCALHOST_RANGE = "localhost"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def split_host(address: str) -> str:
    """The host part of ``HOST:PORT`` (``[v6]:PORT`` too), lower-cased, brackets removed."""
    host = address.rpartition(":")[0] if ":" in address else address
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.lower()


def parse_ip(host: str) -> IPAddress | None:
    """``host`` as an IP address, or None for a DNS name (IPv4-mapped IPv6 becomes IPv4)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_local(ip: IPAddress) -> bool:
    """Loopback, private or link-local: not a network an outsider can put nodes in."""
    return ip.is_loopback or ip.is_private or ip.is_link_local


@lru_cache(maxsize=65536)
def host_range(host: str) -> tuple[str, bool]:
    """(range name, local?) of a bare host (an IP literal or a DNS name).

    The name is the /24 or /48 network (``"203.0.113.0/24"``); every DNS name is
    :data:`NAMES_RANGE`, except ``localhost`` and ``*.localhost``, which are the local range
    ``"localhost"``.
    """
    ip = parse_ip(host)
    if ip is None:
        if host == "localhost" or host.endswith(".localhost"):
            return LOCALHOST_RANGE, True
        return NAMES_RANGE, False
    prefix = IPV4_PREFIX if ip.version == 4 else IPV6_PREFIX
    network = ipaddress.ip_network(f"{ip}/{prefix}", strict=False)
    return str(network), is_local(ip)


def grpc_peer_host(peer: str) -> str:
    """The host of a gRPC ``context.peer()`` string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``)."""
    kind, _, rest = unquote(peer).partition(":")  # newer grpcio percent-encodes brackets
    if kind not in ("ipv4", "ipv6"):
        return ""  # unix sockets and the like: no network address
    return split_host(rest)


def address_range(address: str) -> tuple[str, bool]:
    """(range name, local?) of a ``HOST:PORT`` address; see :func:`host_range`."""
    return host_range(split_host(address))


def limited_range(host: str, limit_local: bool) -> str | None:
    """The range a bare host counts against, or None when it is exempt (a local address and
    ``limit_local`` is False)."""
    name, local = host_range(host)
    if local and not limit_local:
        return None
    return name


def is_name(host: str) -> bool:
    """Whether a bare host is a DNS name rather than an IP literal."""
    return parse_ip(host) is None


class RangeRateLimiter:
    """Requests per second per address range alone: the range half of a
    :class:`~swarmavg.dht.ratelimit.RateLimiter` with the same settings
    (``per_range_factor`` times the per-id rate and burst).

    For the check that runs before a request's signature is verified: then the only thing
    known about its source is the address its connection comes from, never the id it claims
    (a limit keyed by a claimed id lets anyone throttle that id). The per-id budget
    is taken after verification, by the verified id.
    """

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = limits.per_source_rate * limits.per_range_factor
        self._limiter = RateLimiter(
            dataclasses.replace(
                limits,
                per_source_rate=self.rate,
                per_source_burst=limits.per_source_burst * limits.per_range_factor,
                per_range_factor=1.0,
            ),
            clock,
        )

    @property
    def refused(self) -> int:
        return self._limiter.refused

    def admit(self, range_name: str | None) -> str | None:
        """Take one request from ``range_name`` (None: an exempt range, always admitted).

        Returns:
            None when admitted, else why not (for the ``RESOURCE_EXHAUSTED`` details).
        """
        if range_name is None or self._limiter.admit(range_name.encode(), None) is None:
            return None
        return (
            f"too many requests from address range {range_name} (more than "
            f"{self.rate:.0f}/s); slow down"
        )
