"""A daemon's part in NAT traversal: find out how it is reached, relay or keep a reservation.

``NatAgent.settle`` runs once after the public server is bound and before the DHT starts:

- with no initial peers (a new swarm) or an explicit ``announce``, the peer is taken as
  public (the user said so, or nobody could check);
- otherwise it asks the initial peers to dial it back (:mod:`dialback`): when a probe comes
  back it is public, announced at the host the others saw (which fixes a wildcard listen
  that resolved to a private address on a 1:1-NATed cloud machine); when none comes back it
  is NATed and reserves at a relay among the peers that answered (:mod:`reservation`), and
  announces the relayed address; when nobody answered (older peers) nothing changes.

A public peer with ``relay`` on serves reservations (:mod:`relay`). A relayed peer punches
holes to the other relayed peers it dials (:mod:`direct`) and answers their punches
(:mod:`responder`). ``describe`` is what ``swarmavg status`` shows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf.message import Message

from swarmavg.dht.auth import Authenticator, RequestSigner, message_digest
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.ranges import split_host
from swarmavg.peer.nat.dialback import (
    DialBackLimits,
    DialBackRules,
    HeaderFor,
    Reach,
    Reachability,
    TokenBook,
    check_reachability,
)
from swarmavg.peer.nat.direct import DirectRoutes
from swarmavg.peer.nat.limits import RelayLimits
from swarmavg.peer.nat.punch import Endpoint, parse_endpoint
from swarmavg.peer.nat.relay import RelayServer
from swarmavg.peer.nat.reservation import RESERVE_METHOD, RelayedAddress, ReservationKeeper
from swarmavg.peer.nat.responder import PUNCH_METHOD, PunchResponder
from swarmavg.peer.nat.service import RelayService
from swarmavg.proto import common_pb2, relay_pb2

log = logging.getLogger(__name__)

RESERVE_WAIT = 15.0
"""Seconds a NATed peer waits for its first reservation before it falls back to client mode."""


@dataclass(frozen=True)
class Settled:
    """What the daemon announces after :meth:`NatAgent.settle`.

    Attributes:
        address: the gRPC address to announce; None: client mode (NATed, no relay took it).
        data_port: the data-plane port to announce (0: the bound one).
    """

    address: str | None
    data_port: int = 0


@dataclass(frozen=True)
class PunchStatus:
    """Hole punching as ``swarmavg status`` shows it.

    Attributes:
        direct_peers: the peers this peer reaches directly after punching (``IP (relayed
            address)``).
        punches_succeeded: punched connections so far, as initiator or responder.
        punches_failed: punches that gave no connection.
    """

    direct_peers: list[str]
    punches_succeeded: int
    punches_failed: int


def spread(peer_id: bytes, relays: Sequence[str]) -> list[str]:
    """``relays`` in this peer's rendezvous order (highest sha256(peer id, address) first)."""
    return sorted(
        dict.fromkeys(relays),
        key=lambda address: hashlib.sha256(peer_id + address.encode()).digest(),
        reverse=True,
    )


def _with_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class NatAgent:
    """See the module docstring.

    Args:
        channels: the daemon's pool (TLS in private runs).
        peer_id: this peer's id.
        relay_enabled: ``[peer] relay``.
        bind_host: the listen host (relayed ports bind there; relayed connections are
            joined to local ports there, 127.0.0.1 for a wildcard).
    """

    def __init__(
        self,
        channels: ChannelPool,
        peer_id: bytes,
        relay_enabled: bool,
        bind_host: str,
        relay_limits: RelayLimits | None = None,
        dial_back_limits: DialBackLimits | None = None,
    ) -> None:
        self.channels = channels
        self.peer_id = peer_id
        self.relay_enabled = relay_enabled
        self.bind_host = bind_host
        self.relay_limits = relay_limits or RelayLimits()
        self.tokens = TokenBook()
        self.rules = DialBackRules(dial_back_limits or DialBackLimits())
        self.relay: RelayServer | None = None
        self.keeper: ReservationKeeper | None = None
        self.reachability: Reachability | None = None
        self.mode = "unknown"
        self._authenticator: Authenticator | None = None
        self._header: HeaderFor | None = None
        self.responder = PunchResponder(self._own_relay, self._local_port, self._data_port)
        self.routes: DirectRoutes | None = None
        """This peer's direct links after hole punching (set while it is relayed)."""
        self.service = RelayService(
            channels,
            self.rules,
            self.tokens,
            lambda: self._authenticator,
            lambda: self.relay,
            peer_id,
            self.responder,
            lambda: self._header,
        )

    def _own_relay(self) -> Endpoint | None:
        """This peer's relay's splice port while it holds a reservation."""
        keeper = self.keeper
        if keeper is None or keeper.current is None or not keeper.current.splice_port:
            return None
        try:
            return parse_endpoint(
                f"{split_host(keeper.current.relay)}:{keeper.current.splice_port}"
            )
        except ValueError:
            return None  # a relay known by name: no punching through it

    def _local_port(self, index: int) -> tuple[str, int] | None:
        keeper = self.keeper
        if keeper is None or index >= len(keeper.local) or keeper.local[index][1] == 0:
            return None
        return keeper.local[index]

    def _data_port(self) -> int:
        keeper = self.keeper
        return 0 if keeper is None or keeper.current is None else keeper.current.data_port

    @property
    def local_host(self) -> str:
        """Where this machine's own ports answer (for relayed connections)."""
        return "127.0.0.1" if self.bind_host in ("", "0.0.0.0", "::") else self.bind_host

    async def settle(
        self,
        *,
        port: int,
        announced: str,
        join: Sequence[str],
        explicit_announce: bool,
        signer: RequestSigner,
        authenticator: Authenticator,
        routing: Callable[[], Sequence[str]],
        on_move: Callable[[RelayedAddress], None],
    ) -> Settled:
        """Decide how this peer is announced; start the relay or a reservation to match."""
        self._authenticator = authenticator

        def header(request: Message, method: str) -> common_pb2.RequestHeader:
            return signer.sign(b"", method, message_digest(request))

        self._header = header
        if not join or explicit_announce:
            self.mode = "public"
            await self._offer_relay(split_host(announced))
            return Settled(announced)
        found = await check_reachability(self.channels, self.tokens, join, port, header=header)
        self.reachability = found
        for line in found.details:
            log.debug("dial-back %s", line)
        if found.reach is Reach.UNKNOWN:
            log.info(
                "no initial peer could check this peer's reachability; announcing %s", announced
            )
            self.mode = "unknown"
            return Settled(announced)
        if found.reach is Reach.PUBLIC:
            self.mode = "public"
            address = _with_port(found.observed_host, port) if found.observed_host else announced
            if address != announced:
                log.info(
                    "others reach this peer at %s (not %s): announcing that", address, announced
                )
            await self._offer_relay(split_host(address))
            return Settled(address)
        log.info(
            "this peer is behind NAT or a firewall (seen as %s; no dial-back came through): "
            "reserving at a relay",
            found.observed_host,
        )

        def sign(request: relay_pb2.ReserveRequest) -> common_pb2.RequestHeader:
            return signer.sign(b"", RESERVE_METHOD, message_digest(request))

        # Rendezvous order (a hash of this peer's id and the relay's address): NATed peers
        # given the same initial peers spread over them instead of all reserving at the
        # first, and each keeps its order across moves.
        public = spread(self.peer_id, found.public_peers)

        def candidates() -> list[str]:
            return public + spread(self.peer_id, [a for a in routing() if a not in public])

        keeper = ReservationKeeper(
            self.channels,
            sign,
            [(self.local_host, port), (self.local_host, 0)],
            candidates,
            on_move,
        )
        self.keeper = keeper
        try:
            relayed = await keeper.start(RESERVE_WAIT)
        except TimeoutError:
            await keeper.close()
            self.keeper = None
            self.mode = "client"
            log.warning(
                "behind NAT and no relay took a reservation within %.0f s: running in client "
                "mode (forward the port, or pass --announce, to be reachable)",
                RESERVE_WAIT,
            )
            return Settled(None)
        self.mode = "relayed"

        def sign_punch(request: relay_pb2.PunchRequest) -> common_pb2.RequestHeader:
            return signer.sign(b"", PUNCH_METHOD, message_digest(request))

        self.routes = DirectRoutes(self.channels, self._own_relay, sign_punch)
        return Settled(relayed.address, relayed.data_port)

    def set_data_port(self, port: int) -> None:
        """The bound data-plane port, which relayed port 1 leads to."""
        if self.keeper is not None:
            self.keeper.set_local(1, self.local_host, port)

    async def _offer_relay(self, public_host: str) -> None:
        if self.relay_enabled:
            relay = RelayServer(self.bind_host, public_host, self.relay_limits)
            await relay.start()
            self.relay = relay

    async def close(self) -> None:
        if self.routes is not None:
            await self.routes.close()
        await self.responder.close()
        if self.keeper is not None:
            await self.keeper.close()
        if self.relay is not None:
            await self.relay.close()

    def describe(self) -> dict[str, object]:
        """How this peer is reachable, for ``swarmavg status``."""
        info: dict[str, object] = {"reachability": self.mode}
        if self.reachability is not None:
            info["observed_host"] = self.reachability.observed_host
        if self.keeper is not None:
            info.update(self.keeper.status())
        if self.relay is not None:
            info["relaying"] = self.relay.status()
        info.update(dataclasses.asdict(self.punch_status()))
        return info

    def punch_status(self) -> PunchStatus:
        """Hole punching's part of the status: the peers reached directly, punches tried."""
        routes = self.routes
        responder = self.responder
        if routes is None:
            return PunchStatus([], responder.succeeded, responder.failed)
        return PunchStatus(
            routes.direct_peers(),
            routes.succeeded + responder.succeeded,
            routes.failed + responder.failed,
        )
