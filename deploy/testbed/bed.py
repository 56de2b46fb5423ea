"""A multi-host network on one machine: one network namespace per host, joined by a bridge.

Topology (every name below lives inside namespaces this test bed creates; nothing is added to
the root namespace, so the host machine's own network is never touched)::

    <prefix>-sw            switch namespace: bridge br0, one port p-<host> per site
      |- <prefix>-<host>   public host: eth0 = 10.77.<n>.(10+i)/24
      |- <prefix>-<host>-gw   NAT router: wan0 = 10.77.<n>.(100+i)/24, lan0 = 10.78.<i>.1/24,
           |                  iptables MASQUERADE out of wan0, nothing forwarded in unless
           |                  it belongs to a connection the LAN side opened, and what
           |                  arrives for the router itself unasked dropped (no reset)
           '- <prefix>-<host>  host behind NAT: eth0 = 10.78.<i>.2/24, default route via lan0

A host's *link* is the veth pair from its eth0 to the switch (or to its router). A rate limit
shapes both ends of that pair, so the host is limited in both directions; cutting the link
takes the far end down, so the host and everyone talking to it see silence, not resets.
A link with propagation delay, jitter or loss is two TAP devices instead, of the same names,
joined by a compiled userspace wire process (``deploy.testbed.wire``); rate limits and cuts
work on it the same way.

Cleanup: :meth:`TestBed.close` (also run by ``with``, on exceptions and KeyboardInterrupt, and
from ``atexit``) stops the wires and every process inside the namespaces and deletes them;
interfaces and iptables rules live inside the namespaces and disappear with them (a wire lives
in its host's namespace, so it goes with it even when its owner was killed). Leftovers of a
process that was SIGKILLed are removed by the next test bed
(:func:`deploy.testbed._system.sweep_stale`).
"""

from __future__ import annotations

import atexit
import json
import re
import secrets
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from deploy.testbed import _system, shaping, wire
from deploy.testbed._system import TestBedError
from deploy.testbed.wire import LinkImpairment, Wire

_HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_MAX_HOSTS = 80
MIN_MTU = 576
"""The smallest MTU a host may ask for: every IPv4 host must accept datagrams this large."""
MAX_MTU = 9000
"""The largest: the common jumbo frame (a veth takes more, real switches seldom do)."""
TAP_QUEUE_FRAMES = 10_000
_live_beds: set[TestBed] = set()


@dataclass(frozen=True)
class HostSpec:
    """What one host of the test bed looks like.

    Attributes:
        name: 1-12 characters, lowercase letters and digits, starting with a letter.
        rate_mbit: limit of the host's link in megabits per second, both directions;
            None for no limit.
        nat: the host sits behind its own NAT router and can only dial out.
        nat_random_ports: the router maps every connection to a random public port
            (MASQUERADE ``--random-fully``, a "symmetric" NAT): the port a peer learns for a
            connection says nothing about the next one, so hole punching cannot work.
            Otherwise it keeps the host's port where it can, like most home routers.
        mtu: the MTU of every link of the host (its own and, behind NAT, its router's
            LAN), both ends; None keeps the kernel's 1500. Hosts that exchange traffic
            should share one: the switch forwards no frame larger than the port it leaves
            by, and sends no ICMP about it, as a real switch does not.
        delay_ms: one-way propagation delay of the host's link, each direction: the
            round-trip time between hosts a and b is ``2 * (a.delay_ms + b.delay_ms)``.
        jitter_ms: the link's delay varies within ``delay_ms +- jitter_ms`` (at most
            ``delay_ms``); frames keep their order (``deploy.testbed.wire``).
        loss: probability that the link drops a frame, each frame and direction: a packet
            from a to b is lost with ``1 - (1 - a.loss) * (1 - b.loss)``.
    """

    name: str
    rate_mbit: float | None = None
    nat: bool = False
    nat_random_ports: bool = False
    mtu: int | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    @property
    def impairment(self) -> LinkImpairment:
        """The link's delay, jitter and loss (raises ValueError when out of range)."""
        return LinkImpairment(self.delay_ms, self.jitter_ms, self.loss)


@dataclass(frozen=True)
class Host:
    """A running host of a test bed.

    Attributes:
        name: the name from its :class:`HostSpec`.
        namespace: its network namespace (``ip netns exec <namespace> ...``).
        address: its own IPv4 address (a private one behind NAT).
        public_address: the address other hosts see its connections come from: ``address``,
            or its router's WAN address behind NAT. Only public hosts can be dialled.
        nat: whether it sits behind NAT.
        rate_mbit: its link limit (None: unlimited), as last set.
    """

    name: str
    namespace: str
    address: str
    public_address: str
    nat: bool
    rate_mbit: float | None
    link_ends: tuple[tuple[str, str], tuple[str, str]]
    """``(namespace, device)`` of the host's end and of the far end of its link."""
    impairment: LinkImpairment = field(default_factory=LinkImpairment)
    """The link's delay, jitter and loss (a userspace wire when any is set)."""

    @property
    def exec_prefix(self) -> list[str]:
        """The argv prefix that runs a command inside this host."""
        return ["ip", "netns", "exec", self.namespace]

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` as a command that runs inside this host."""
        return [*self.exec_prefix, *args]

    def swarmavg_command(self) -> list[str]:
        """The ``swarmavg`` CLI inside this host, for ``ProcessPool.start(executable=...)``."""
        return self.command([sys.executable, "-m", "swarmavg.peer.cli"])

    def popen(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        stdin: int | IO[bytes] | None = subprocess.DEVNULL,
        stdout: int | IO[bytes] | None = None,
        stderr: int | IO[bytes] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``args`` inside this host. ``ip netns exec`` execs the program itself, so
        the returned process is the program (signals reach it directly). The environment
        is inherited unless ``env`` is given."""
        return subprocess.Popen(
            self.command(args),
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
        )

    def link_bytes(self) -> tuple[int, int]:
        """Bytes this host has sent and received on its link so far (Ethernet frames,
        headers included: what a rate limit counts)."""
        done = _system.run(["ip", "-n", self.namespace, "-j", "-s", "link", "show", "dev", "eth0"])
        [info] = json.loads(done.stdout)
        stats = info["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def run(
        self, args: Sequence[str], *, timeout: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` inside this host to completion; text output is captured.

        Raises:
            subprocess.CalledProcessError: ``check`` and the command failed.
            subprocess.TimeoutExpired: it ran longer than ``timeout`` (it is killed).
        """
        return subprocess.run(
            self.command(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            stdin=subprocess.DEVNULL,
        )


class TestBed:
    """K hosts in network namespaces on one bridge, optionally rate limited or behind NAT.

    Use as a context manager::

        with TestBed([HostSpec("a", rate_mbit=100), HostSpec("b", nat=True)]) as bed:
            bed["a"].popen([...])

    Raises:
        ValueError: invalid or duplicate host specs.
        TestBedError: building the network failed (everything made so far is removed).
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, hosts: Sequence[HostSpec]) -> None:
        if not hosts:
            raise ValueError("a test bed needs at least one host")
        if len(hosts) > _MAX_HOSTS:
            raise ValueError(f"at most {_MAX_HOSTS} hosts, got {len(hosts)}")
        names = [spec.name for spec in hosts]
        for name in names:
            if not _HOST_NAME.match(name):
                raise ValueError(f"host name {name!r} must match {_HOST_NAME.pattern}")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate host names in {names}")
        for spec in hosts:
            if spec.rate_mbit is not None and not spec.rate_mbit > 0:
                raise ValueError(f"host {spec.name}: rate_mbit must be positive")
            if spec.mtu is not None and not MIN_MTU <= spec.mtu <= MAX_MTU:
                raise ValueError(f"host {spec.name}: mtu must be in [{MIN_MTU}, {MAX_MTU}]")
            try:
                spec.impairment  # noqa: B018 (validates the delay, jitter and loss)
            except ValueError as exc:
                raise ValueError(f"host {spec.name}: {exc}") from exc
        self.specs = tuple(hosts)
        self.prefix = _system.new_prefix()
        self.subnet = f"10.77.{secrets.randbelow(256)}"
        self.hosts: dict[str, Host] = {}
        self.namespaces: list[str] = []
        self.wires: dict[str, Wire] = {}
        """Host name -> the wire of its link, for hosts with delay, jitter or loss."""
        self._closed = False
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> TestBed:
        """Build the network. Idempotent; raises after :meth:`close`.

        Raises:
            TestBedError: the machine lacks what the test bed needs, or a command failed;
                whatever was built is removed before this propagates.
        """
        if self._closed:
            raise TestBedError("this test bed was closed")
        if self._started:
            return self
        reason = _system.missing_requirements()
        if reason is None and any(spec.impairment.active for spec in self.specs):
            reason = wire.missing_requirements()
        if reason is not None:
            raise TestBedError(reason)
        _system.sweep_stale()
        self._started = True
        _live_beds.add(self)
        try:
            switch = self._add_namespace("sw")
            _system.run(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
            _system.run(["ip", "-n", switch, "link", "set", "br0", "up"])
            for index, spec in enumerate(self.specs):
                self.hosts[spec.name] = self._add_host(index, spec, switch)
        except BaseException:  # KeyboardInterrupt too: remove what was built, re-raise
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process in the test bed's namespaces and delete them. Idempotent;
        safe to call on a partly built test bed."""
        if self._closed:
            return
        self._closed = True
        _live_beds.discard(self)
        for link in self.wires.values():  # stopping a wire removes its two devices
            link.close()
        # Hosts first, switch last: processes die before the links they use.
        for namespace in reversed(self.namespaces):
            _system.delete_namespace(namespace)

    def __enter__(self) -> TestBed:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- access and faults -------------------------------------------------------------------

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def cut_link(self, name: str) -> None:
        """Take the far end of ``name``'s link down: from now on its packets go nowhere and
        nothing reaches it; peers see silence (no resets). Idempotent."""
        namespace, device = self.hosts[name].link_ends[1]
        _system.run(["ip", "-n", namespace, "link", "set", device, "down"])

    def restore_link(self, name: str) -> None:
        """Undo :meth:`cut_link` (the rate limit, if any, still applies)."""
        namespace, device = self.hosts[name].link_ends[1]
        _system.run(["ip", "-n", namespace, "link", "set", device, "up"])

    def set_rate(self, name: str, rate_mbit: float | None) -> None:
        """Change (or with None remove) the limit of ``name``'s link, both directions."""
        host = self.hosts[name]
        if host.rate_mbit is not None or rate_mbit is not None:
            for command in shaping.link_limit_commands(host.link_ends, rate_mbit):
                _system.run(command, check=rate_mbit is not None)
        self.hosts[name] = Host(
            host.name,
            host.namespace,
            host.address,
            host.public_address,
            host.nat,
            rate_mbit,
            host.link_ends,
            host.impairment,
        )

    def count_forwarded_from(self, name: str, source_ip: str) -> None:
        """Count, from now on, the bytes ``name``'s NAT router forwards to its host from
        ``source_ip`` (a rule with no verdict at the top of its FORWARD chain)."""
        router = self._router(name)
        _system.run(
            [
                "ip", "netns", "exec", router, "iptables", "-I", "FORWARD", "1",
                "-i", "wan0", "-s", f"{source_ip}/32",
                "-m", "comment", "--comment", "testbed-count",
            ]
        )  # fmt: skip

    def forwarded_from(self, name: str, source_ip: str) -> int:
        """Bytes (IP packets) counted by :meth:`count_forwarded_from` so far."""
        done = _system.run(["ip", "netns", "exec", self._router(name), "iptables-save", "-c"])
        for line in done.stdout.splitlines():
            if "testbed-count" in line and f"-s {source_ip}/32" in line:
                counters = line.split("]", 1)[0].lstrip("[")
                return int(counters.split(":")[1])
        raise TestBedError(f"no counter for {source_ip} on {name}'s router")

    def _router(self, name: str) -> str:
        host = self.hosts[name]
        if not host.nat:
            raise ValueError(f"host {name} has no NAT router")
        return host.link_ends[1][0]

    # -- construction ------------------------------------------------------------------------

    def _add_namespace(self, suffix: str) -> str:
        name = f"{self.prefix}-{suffix}"
        self.namespaces.append(name)  # recorded first: close() removes it even if add fails
        _system.run(["ip", "netns", "add", name])
        _system.run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def _add_link(
        self, spec: HostSpec, host_end: tuple[str, str], far_end: tuple[str, str]
    ) -> None:
        """The host's link: a veth pair, or two TAP devices and a wire when it has delay,
        jitter or loss. Either way both ends exist, down, with the spec's MTU."""
        impairment = spec.impairment
        if not impairment.active:
            self._add_veth(host_end, far_end, spec.mtu)
            return
        command = wire.wire_command(
            wire.binary(),
            host_end,
            far_end,
            impairment,
            rate_mbit=spec.rate_mbit,
            seed=len(self.wires) + 1,
        )
        self.wires[spec.name] = Wire(command)
        for namespace, device in (host_end, far_end):
            # A TAP holds TAP_QUEUE_FRAMES frames the wire has not read yet (500 by default)
            # and drops the next: room for the wire to wait for a CPU on a busy machine
            # without losses the link was not asked for. The tbf ahead of it still bounds
            # the queue of a rate-limited link.
            settings = ["txqueuelen", str(TAP_QUEUE_FRAMES)]
            if spec.mtu is not None:
                settings += ["mtu", str(spec.mtu)]
            _system.run(["ip", "-n", namespace, "link", "set", device, *settings])

    def _add_veth(self, a: tuple[str, str], b: tuple[str, str], mtu: int | None = None) -> None:
        # Both ends are created directly inside their namespaces: no name ever appears in the
        # root namespace, so parallel test beds can reuse eth0, lan0, ... freely.
        _system.run(
            [
                "ip",
                "link",
                "add",
                a[1],
                "netns",
                a[0],
                "type",
                "veth",
                "peer",
                "name",
                b[1],
                "netns",
                b[0],
            ]
        )
        if mtu is not None:
            for namespace, device in (a, b):
                _system.run(["ip", "-n", namespace, "link", "set", device, "mtu", str(mtu)])

    def _add_host(self, index: int, spec: HostSpec, switch: str) -> Host:
        port = (switch, f"p-{spec.name}")
        if spec.nat:
            router = self._add_namespace(f"{spec.name}-gw")
            wan_address = f"{self.subnet}.{100 + index}"
            self._add_veth((router, "wan0"), port, spec.mtu)
            self._plug_into_bridge(port)
            self._configure_address(router, "wan0", f"{wan_address}/24")
            namespace = self._add_namespace(spec.name)
            lan = f"10.78.{index}"
            self._add_link(spec, (namespace, "eth0"), (router, "lan0"))
            self._configure_address(router, "lan0", f"{lan}.1/24")
            self._configure_address(namespace, "eth0", f"{lan}.2/24")
            _system.run(["ip", "-n", namespace, "route", "add", "default", "via", f"{lan}.1"])
            self._configure_nat(router, f"{lan}.0/24", random_ports=spec.nat_random_ports)
            host = Host(
                spec.name,
                namespace,
                f"{lan}.2",
                wan_address,
                True,
                None,
                ((namespace, "eth0"), (router, "lan0")),
                spec.impairment,
            )
        else:
            namespace = self._add_namespace(spec.name)
            address = f"{self.subnet}.{10 + index}"
            self._add_link(spec, (namespace, "eth0"), port)
            self._plug_into_bridge(port)
            self._configure_address(namespace, "eth0", f"{address}/24")
            # Like a real machine, a public host has a default route, so software that finds
            # "my address" by routing towards the internet (e.g. `swarmavg peer --listen
            # 0.0.0.0:PORT`) finds eth0. Packets to anything else only reach the bridge.
            _system.run(["ip", "-n", namespace, "route", "add", "default", "dev", "eth0"])
            host = Host(
                spec.name,
                namespace,
                address,
                address,
                False,
                None,
                ((namespace, "eth0"), port),
                spec.impairment,
            )
        self.hosts[spec.name] = host
        if spec.rate_mbit is not None:
            self.set_rate(spec.name, spec.rate_mbit)
        return self.hosts[spec.name]

    @staticmethod
    def _plug_into_bridge(port: tuple[str, str]) -> None:
        namespace, device = port
        _system.run(["ip", "-n", namespace, "link", "set", device, "master", "br0", "up"])

    @staticmethod
    def _configure_address(namespace: str, device: str, cidr: str) -> None:
        _system.run(["ip", "-n", namespace, "addr", "add", cidr, "dev", device])
        _system.run(["ip", "-n", namespace, "link", "set", device, "up"])

    @staticmethod
    def _configure_nat(router: str, lan_cidr: str, *, random_ports: bool = False) -> None:
        def iptables(*args: str) -> None:
            _system.run(["ip", "netns", "exec", router, "iptables", *args])

        # ip_forward is per network namespace; this sets the router's only.
        _system.run(
            ["ip", "netns", "exec", router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"]
        )
        masquerade = ["-j", "MASQUERADE", *(["--random-fully"] if random_ports else [])]
        iptables("-t", "nat", "-A", "POSTROUTING", "-s", lan_cidr, "-o", "wan0", *masquerade)
        # A home router: replies to connections the LAN opened come in; nothing else does,
        # even from a peer that adds a route to the private range.
        iptables(
            "-A", "FORWARD", "-i", "wan0", "-o", "lan0",
            "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT",
        )  # fmt: skip
        iptables("-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-j", "DROP")
        # And, like a home router, it drops (never resets) what arrives for itself unasked:
        # a hole-punching SYN that comes before the host's own has left is lost silently, so
        # the host's SYN can still open the way (a reset would end the peer's attempt).
        iptables(
            "-A", "INPUT", "-i", "wan0",
            "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT",
        )  # fmt: skip
        iptables("-A", "INPUT", "-i", "wan0", "-j", "DROP")


@atexit.register
def _close_live_beds() -> None:
    """Last resort for a test bed whose owner never closed it (e.g. an interpreter exit
    while a ``with`` block was suspended in a generator)."""
    for bed in list(_live_beds):
        bed.close()
