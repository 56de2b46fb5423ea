"""Reachability by dial-back: "can you reach me?", asked of public peers.

The asker sends its listening port and a random token; the asked peer dials the asker back
at the IP **it saw the request come from** (never a host the asker names, so a dial-back
cannot be aimed at a third party) and calls ``Probe``, which the asker answers only for a
token it issued itself (so another process at that address cannot answer for it). The
answer says whether the probe came back and the IP observed, which is the asker's public IP.

Bounded: an asked peer runs at most ``max_in_flight`` dial-backs at once, ``rate`` per second
in all (burst ``burst``) and ``per_source_rate`` per second per asker's address range; each
probe has a ``probe_timeout`` deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import grpc
from google.protobuf.message import Message

from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.ranges import host_range
from swarmavg.dht.ratelimit import TokenBucket
from swarmavg.proto import common_pb2, relay_pb2, relay_pb2_grpc

TOKEN_BYTES = 16
DIAL_BACK_METHOD = "/swarmavg.v1.Relay/DialBack"
PROBE_METHOD = "/swarmavg.v1.Relay/Probe"


@dataclass(frozen=True)
class DialBackLimits:
    """How many dial-backs a peer does for others; see the module docstring."""

    rate: float = 20.0
    burst: float = 40.0
    per_source_rate: float = 0.5
    per_source_burst: float = 4.0
    max_in_flight: int = 16
    probe_timeout: float = 3.0
    max_sources: int = 4096


def relay_stub(channel: grpc.aio.Channel) -> Any:
    """The generated client of the ``Relay`` service (protoc writes it unannotated)."""
    return relay_pb2_grpc.RelayStub(channel)  # type: ignore[no-untyped-call]


class DialBackRules:
    """Whether to dial back now, and where (pure except for the clock)."""

    def __init__(self, limits: DialBackLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._all = TokenBucket(limits.rate, limits.burst, clock())
        self._sources: OrderedDict[str, TokenBucket] = OrderedDict()
        self.in_flight = 0
        self.refused = 0

    def target(self, observed_host: str, port: int) -> str:
        """The one address a dial-back may go to: the observed IP with the asked port.

        Raises:
            ValueError: no usable IP was observed, or the port is out of range.
        """
        if not 0 < port < 65536:
            raise ValueError(f"port {port} out of range")
        try:
            ip = ipaddress.ip_address(observed_host)
        except ValueError:
            raise ValueError(f"no IP address observed ({observed_host!r})") from None
        if ip.is_multicast or ip.is_unspecified:
            raise ValueError(f"cannot dial back {ip}")
        return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"

    def admit(self, observed_host: str) -> str | None:
        """Take one dial-back for an asker at ``observed_host``; None if allowed, else why not.
        An admitted dial-back must be followed by :meth:`done`."""
        limits = self.limits
        if self.in_flight >= limits.max_in_flight:
            self.refused += 1
            return f"{limits.max_in_flight} dial-backs in flight; ask later"
        now = self.clock()
        source = host_range(observed_host)[0]
        bucket = self._sources.get(source)
        if bucket is None:
            bucket = TokenBucket(limits.per_source_rate, limits.per_source_burst, now)
            self._sources[source] = bucket
            while len(self._sources) > limits.max_sources:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(source)
        if not bucket.take(now):
            self.refused += 1
            return f"too many dial-backs for {source}; ask later"
        if not self._all.take(now):
            self.refused += 1
            return "too many dial-backs; ask later"
        self.in_flight += 1
        return None

    def done(self) -> None:
        self.in_flight -= 1


class TokenBook:
    """The tokens this peer issued for its own dial-backs; ``Probe`` answers only these."""

    def __init__(self, max_tokens: int = 256) -> None:
        self._tokens: OrderedDict[bytes, None] = OrderedDict()
        self._max = max_tokens

    def issue(self) -> bytes:
        token = os.urandom(TOKEN_BYTES)
        self._tokens[token] = None
        while len(self._tokens) > self._max:
            self._tokens.popitem(last=False)
        return token

    def knows(self, token: bytes) -> bool:
        return token in self._tokens

    def retire(self, token: bytes) -> None:
        self._tokens.pop(token, None)


HeaderFor = Callable[[Message, str], common_pb2.RequestHeader]
"""Signs a request's header for a method (the daemon's DHT signer): a private run's server
admits only requests whose header names the peer of the call's TLS credential."""


async def probe(
    channels: ChannelPool,
    target: str,
    token: bytes,
    timeout: float,
    header: HeaderFor | None = None,
) -> str | None:
    """Call ``Probe`` at ``target`` with a deadline; None when the token came back, else why
    not (for the answer's detail)."""
    stub = relay_stub(channels.channel(target))
    request = relay_pb2.ProbeRequest(token=token)
    if header is not None:
        request.header.CopyFrom(header(request, PROBE_METHOD))
    try:
        answer = await stub.Probe(request, timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        # The channel stays in the pool (its idle sweep closes it): other calls may share it.
        return f"{target}: {exc.code().name} {exc.details() or ''}".strip()
    if answer.token != token:
        return f"{target} answered for another peer"
    return None


class Reach(Enum):
    """How a peer can be reached, as its dial-backs found."""

    PUBLIC = "public"
    NATED = "nated"
    UNKNOWN = "unknown"  # nobody answered the question


@dataclass(frozen=True)
class Reachability:
    """The outcome of asking peers to dial back.

    Attributes:
        reach: public, NATed, or unknown (no peer answered).
        observed_host: this peer's IP as the others see it ('' when none answered).
        public_peers: the asked peers that answered (public: candidate relays).
        details: one line per peer asked.
    """

    reach: Reach
    observed_host: str
    public_peers: tuple[str, ...]
    details: tuple[str, ...]


async def check_reachability(
    channels: ChannelPool,
    tokens: TokenBook,
    peers: Iterable[str],
    port: int,
    timeout: float = 5.0,
    header: HeaderFor | None = None,
) -> Reachability:
    """Ask each of ``peers`` (at most 4) to dial this peer back on ``port``.

    Public when any probe came back; NATed when peers answered and none could reach it.
    Every call has a deadline of ``timeout`` seconds.
    """
    asked = list(dict.fromkeys(peers))[:4]

    async def ask(address: str) -> tuple[str, relay_pb2.DialBackResponse | str]:
        token = tokens.issue()
        try:
            stub = relay_stub(channels.channel(address))
            request = relay_pb2.DialBackRequest(port=port, token=token)
            if header is not None:
                request.header.CopyFrom(header(request, DIAL_BACK_METHOD))
            return address, await stub.DialBack(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return address, f"{exc.code().name} {exc.details() or ''}".strip()
        finally:
            tokens.retire(token)

    answers = await asyncio.gather(*(ask(a) for a in asked))
    observed = ""
    reachable = False
    public: list[str] = []
    details: list[str] = []
    for address, answer in answers:
        if isinstance(answer, str):
            details.append(f"{address}: no answer ({answer})")
            continue
        public.append(address)
        observed = observed or answer.observed_host
        reachable = reachable or answer.reachable
        details.append(
            f"{address}: {'reached' if answer.reachable else 'not reached'} at "
            f"{answer.observed_host}:{port}{'' if answer.reachable else ' (' + answer.detail + ')'}"
        )
    reach = Reach.UNKNOWN if not public else Reach.PUBLIC if reachable else Reach.NATED
    return Reachability(reach, observed, tuple(public), tuple(details))


class DialBackRefused(Exception):
    """A dial-back this peer did not try (a bad request, or over its limits).

    Not an answer: an answer says whether the asker could be reached, and a refusal knows
    nothing about that. Answered with ``status`` instead (the service aborts with it), so
    the asker counts the peer as not having answered. Answering "not reached" instead made
    every public peer past the rate limit (eight daemons started at once on one host)
    believe it was behind NAT and relay all its traffic.
    """

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status


async def dial_back(
    rules: DialBackRules,
    channels: ChannelPool,
    observed_host: str,
    port: int,
    token: bytes,
    header: HeaderFor | None = None,
) -> relay_pb2.DialBackResponse:
    """Serve one dial-back: the rules, then the probe (bounded by ``probe_timeout``).

    Raises:
        DialBackRefused: not tried (bad port or token, no usable IP, over the limits).
    """
    answer = relay_pb2.DialBackResponse(observed_host=observed_host)
    try:
        target = rules.target(observed_host, port)
    except ValueError as exc:
        raise DialBackRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    if len(token) != TOKEN_BYTES:
        raise DialBackRefused(
            grpc.StatusCode.INVALID_ARGUMENT, f"the token must have {TOKEN_BYTES} bytes"
        )
    refusal = rules.admit(observed_host)
    if refusal is not None:
        raise DialBackRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(rules.limits.probe_timeout + 1.0):
                failure = await probe(channels, target, token, rules.limits.probe_timeout, header)
                answer.reachable = failure is None
                answer.detail = failure or ""
                return answer
        answer.detail = f"{target}: no answer within {rules.limits.probe_timeout:g} s"
        return answer
    finally:
        rules.done()
