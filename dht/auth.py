"""Sender authentication of every peer-to-peer message, with a bounded replay window.

A :class:`~swarmavg.proto.common_pb2.RequestHeader` names its sender by public key, and keys
are public, so the header alone proves nothing. Every request therefore carries an Ed25519
signature by the sender over what the request does::

    domain tag | run id | protocol version | sender id | receiver id | method
               | timestamp | nonce | address | sha256(the request without its header)

The digest of the request is recomputed by the receiver from the message it got and never
sent, so a signature cannot be moved onto another body (another group, another part,
other records). The receiver id and the method pin it to one peer and one RPC; the timestamp
and the nonce make it single-use: a request older or newer than ``window`` seconds by the
receiver's clock is refused, and a (sender, nonce) seen inside the window is refused as a
replay. The replay cache is bounded and kept per sender (:class:`ReplayCache`): what it
drops under a flood, and a timestamp far ahead, refuse only that sender's own older
messages, not another peer's (the one exception is a slot collision in a keyed
table that only a flood of many identities fills). A service's per-sender rate limit runs
between the signature check and the cache (``admit``), so a sender over its rate fills no
entry. Streams are authenticated once, by their first message; the rest of an HTTP/2 stream
or data-plane connection cannot be injected by an off-path third party (see
docs/security.md, "Message authentication").

Answers that the caller relies on (the DHT's) are signed the same way by the responder, with
the requester as receiver and the request's nonce inside the digest, so an answer is bound to
one request and needs no replay cache.

Costs: one Ed25519 signature per request sent (~25 us) and one verification per request or
stream received (~60 us); nothing per chunk.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TypeVar

from google.protobuf.message import Message

from swarmavg.dht.identity import (
    PROTOCOL_VERSION,
    HeaderError,
    Identity,
    verify_header,
    verify_signature,
)
from swarmavg.proto import common_pb2

NONCE_BYTES = 16
DIGEST_BYTES = 32
DEFAULT_AUTH_WINDOW = 120.0
"""Seconds a signed message stays acceptable either side of the receiver's clock."""
DEFAULT_MAX_NONCES = 200_000
"""Replay-cache entries kept at most (about 30 MB): ~1600 messages per second for 120 s;
as many horizons of senders without entries again, and, allocated on a flood of identities
only, a keyed table of about 4 times as many folded horizons (8 MB)."""

M = TypeVar("M", bound=Message)

_REQUEST_TAG = b"swarmavg.v1.request\x00"
_RESPONSE_TAG = b"swarmavg.v1.response\x00"

# Methods that may be sent before the sender knows whom it reaches (bootstrap by address).
# A relay reservation (peer/nat) is asked of a relay known only by the address that answered
# its dial-back. A hole punch is asked of a peer known by its relayed address; a punch
# replayed elsewhere only makes that peer connect to an address whose session check fails.
UNADDRESSED_METHODS = frozenset(
    {
        "/swarmavg.v1.DHT/Ping",
        "/swarmavg.v1.DHT/Find",
        "/swarmavg.v1.Relay/Reserve",
        "/swarmavg.v1.Relay/Punch",
    }
)


class AuthenticationError(HeaderError):
    """A message's signature is missing or wrong, stale, replayed, or meant for another peer.

    Services answer it with ``UNAUTHENTICATED``; the message says which check failed.
    """


def message_digest(
    message: Message, *, without: Iterable[str] = ("header",), bound_to: bytes = b""
) -> bytes:
    """sha256 of ``message`` serialised deterministically without the fields ``without``.

    ``bound_to`` (an answer's request nonce) is hashed in front, so an answer's signature
    covers the request it answers. Fields this code does not know (a newer peer's additions)
    are kept and serialised after the known ones, as the newer sender wrote them, so a field
    added later does not break the digest between versions.
    """
    stripped = type(message)()
    stripped.CopyFrom(message)
    for name in without:
        stripped.ClearField(name)
    hasher = hashlib.sha256(bound_to)
    hasher.update(stripped.SerializeToString(deterministic=True))
    return hasher.digest()


def _blob(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def signed_payload(header: common_pb2.RequestHeader, digest: bytes, *, response: bool) -> bytes:
    """The bytes a request's (or an answer's) signature covers; see the module docstring.

    Every variable-length field is length-prefixed, so no two headers share a payload.
    """
    return b"".join(
        (
            _RESPONSE_TAG if response else _REQUEST_TAG,
            _blob(header.run_id.encode()),
            struct.pack(">I", header.protocol_version),
            _blob(header.peer_id),
            _blob(header.receiver_id),
            _blob(header.method.encode()),
            struct.pack(">d", header.timestamp),
            _blob(header.nonce),
            _blob(header.address.encode()),
            _blob(digest),
        )
    )


def sign_request(
    identity: Identity,
    run_id: str,
    address: str,
    receiver_id: bytes,
    method: str,
    digest: bytes,
    *,
    response: bool = False,
    now: float | None = None,
) -> common_pb2.RequestHeader:
    """Return a header naming ``identity``, signed for one message to ``receiver_id``.

    Args:
        address: the sender's public HOST:PORT ("" in client mode).
        receiver_id: the peer the message is for; ``b""`` only for an unaddressed DHT
            ``Ping``/``Find`` (bootstrap by address).
        method: the full gRPC method name, e.g. ``/swarmavg.v1.DHT/Store``.
        digest: :func:`message_digest` of the message (for an answer, bound to the request's
            nonce).
        response: sign an answer (another domain tag, so a request can never pass for one).
        now: the timestamp (test seam); the current unix time by default.
    """
    header = common_pb2.RequestHeader(
        peer_id=identity.peer_id,
        run_id=run_id,
        protocol_version=PROTOCOL_VERSION,
        address=address,
        public_key=identity.public_key,
        receiver_id=receiver_id,
        method=method,
        timestamp=time.time() if now is None else now,
        nonce=os.urandom(NONCE_BYTES),
    )
    header.signature = identity.sign(signed_payload(header, digest, response=response))
    return header


class RequestSigner:
    """Signs this peer's outgoing messages: its identity, run and current public address.

    The address is read at each signature (``address`` callable), since a node learns or
    changes it after start.
    """

    def __init__(self, identity: Identity, run_id: str, address: Callable[[], str]) -> None:
        self.identity = identity
        self.run_id = run_id
        self._address = address

    @property
    def peer_id(self) -> bytes:
        return self.identity.peer_id

    def sign(self, receiver_id: bytes, method: str, digest: bytes) -> common_pb2.RequestHeader:
        """A header signed for one request (see :func:`sign_request`)."""
        return sign_request(
            self.identity, self.run_id, self._address(), receiver_id, method, digest
        )

    def signed(self, message: M, receiver_id: bytes, method: str) -> M:
        """``message`` with its ``header`` set, signed for ``receiver_id`` (in place)."""
        message.header.CopyFrom(self.sign(receiver_id, method, message_digest(message)))  # type: ignore[attr-defined]
        return message

    def sign_response(
        self, request: common_pb2.RequestHeader, method: str, digest: bytes
    ) -> common_pb2.RequestHeader:
        """A header signed for the answer to ``request``; ``digest`` is bound to its nonce."""
        return sign_request(
            self.identity,
            self.run_id,
            self._address(),
            bytes(request.peer_id),
            method,
            digest,
            response=True,
        )


class AdmissionError(Exception):
    """A verified message that ``admit`` (a per-sender rate limit) turned away.

    Not an authentication failure: services answer it with ``RESOURCE_EXHAUSTED``. Nothing
    of the message is remembered, so a sender over its rate fills no replay-cache entry.
    """


class _Sender:
    """One sender's remembered nonces (arrival order) and its replay horizon."""

    __slots__ = ("floor", "nonces")

    def __init__(self, floor: float) -> None:
        self.nonces: OrderedDict[bytes, float] = OrderedDict()  # nonce -> timestamp
        self.floor = floor


class ReplayCache:
    """The (sender, nonce) pairs accepted inside the window, bounded, kept per sender.

    A nonce is needed only while its timestamp is inside the window (older messages are
    refused as stale). When more than ``max_nonces`` are held, one is dropped and its
    timestamp becomes the **horizon of its own sender**: that sender's messages stamped at or
    before it are refused, so eviction never lets a replay through, and it never refuses
    anyone else's. The nonce dropped is the oldest of the sender that just went over its
    share (``max_nonces`` over the number of senders held), else of the least recently heard
    sender: a flooding identity displaces its own entries, not those of peers that are
    active, and an evicted honest entry only sets a horizon in that peer's own past.

    Horizons of senders that hold no nonce any more are kept too (at most ``max_nonces``,
    least recently set dropped first, each until it leaves the window). One dropped while
    still inside the window is folded into a table of ``spill_slots`` horizons indexed by a
    keyed hash of the sender (a secret key per cache, so nobody can aim at a given peer's
    slot): it can refuse another sender only when their slots collide, and refusing a sender
    whose slot was folded takes many identities, each sending a message that must be
    evicted while fresh, well over ``2 * max_nonces`` of them inside one window.
    """

    def __init__(self, window: float, max_nonces: int) -> None:
        self.window = window
        self.max_nonces = max_nonces
        self._senders: OrderedDict[bytes, _Sender] = OrderedDict()  # least recently heard first
        self._floors: OrderedDict[bytes, float] = OrderedDict()  # senders without nonces
        self._size = 0
        self._spill: array[float] | None = None  # allocated by the first fold
        self._spill_mask = (1 << max(12, (4 * max_nonces - 1).bit_length())) - 1
        self._spill_key = os.urandom(16)
        self.folded = 0
        """Horizons folded into the keyed table (a flood of identities; normally 0)."""

    def __len__(self) -> int:
        return self._size

    def _slot(self, sender: bytes) -> int:
        digest = hashlib.blake2b(sender, key=self._spill_key, digest_size=8).digest()
        return int.from_bytes(digest, "big") & self._spill_mask

    def horizon(self, sender: bytes) -> float:
        """The timestamp at or before which ``sender``'s messages are refused."""
        state = self._senders.get(sender)
        floor = state.floor if state is not None else self._floors.get(sender, -float("inf"))
        if self._spill is not None:
            floor = max(floor, self._spill[self._slot(sender)])
        return floor

    def refusal(self, sender: bytes, nonce: bytes, timestamp: float) -> str | None:
        """Why (``sender``, ``nonce``) stamped ``timestamp`` cannot be accepted, or None."""
        if timestamp <= self.horizon(sender):
            return (
                "the timestamp predates this peer's replay horizon for this sender (its "
                "older nonces were dropped); sign the message again"
            )
        state = self._senders.get(sender)
        if state is not None and nonce in state.nonces:
            return "replayed message: this nonce was already used"
        return None

    def add(self, sender: bytes, nonce: bytes, timestamp: float, now: float) -> None:
        """Remember an accepted nonce (after :meth:`refusal` said None)."""
        state = self._senders.get(sender)
        if state is not None:
            self._expire(sender, state, now)  # may leave it only a horizon
            state = self._senders.get(sender)
        if state is None:
            state = self._senders[sender] = _Sender(self._floors.pop(sender, -float("inf")))
        else:
            self._senders.move_to_end(sender)
        state.nonces[nonce] = timestamp
        self._size += 1
        self._sweep(now)
        while self._size > self.max_nonces:
            if len(state.nonces) * len(self._senders) >= self._size:
                self._evict(sender, state, now)  # over its share: its own oldest goes
            else:
                oldest = next(iter(self._senders))
                self._evict(oldest, self._senders[oldest], now)

    def _evict(self, sender: bytes, state: _Sender, now: float) -> None:
        _, timestamp = state.nonces.popitem(last=False)
        self._size -= 1
        if timestamp + self.window >= now:  # dropped while still fresh: the sender's horizon
            state.floor = max(state.floor, timestamp)
        if not state.nonces:
            self._retire(sender, state, now)

    def _expire(self, sender: bytes, state: _Sender, now: float) -> None:
        """Drop ``sender``'s nonces that left the window. Arrival order is only roughly
        timestamp order: this frees the front and lets a late straggler wait."""
        nonces = state.nonces
        while nonces:
            timestamp = next(iter(nonces.values()))
            if timestamp + self.window >= now:
                return
            nonces.popitem(last=False)
            self._size -= 1
        self._retire(sender, state, now)

    def _retire(self, sender: bytes, state: _Sender, now: float) -> None:
        """``sender`` holds no nonce any more: keep only its horizon, while it matters."""
        del self._senders[sender]
        if state.floor + self.window < now:
            return
        self._floors[sender] = state.floor
        if len(self._floors) > self.max_nonces:
            dropped, floor = self._floors.popitem(last=False)
            if floor + self.window >= now:
                self._fold(dropped, floor)

    def _fold(self, sender: bytes, floor: float) -> None:
        if self._spill is None:
            self._spill = array("d", [-float("inf")]) * (self._spill_mask + 1)
        slot = self._slot(sender)
        self._spill[slot] = max(self._spill[slot], floor)
        self.folded += 1

    def _sweep(self, now: float) -> None:
        """Expire the least recently heard sender's old nonces and horizons that left the
        window (amortised: each entry goes once)."""
        if self._senders:
            oldest = next(iter(self._senders))
            self._expire(oldest, self._senders[oldest], now)
        floors = self._floors
        while floors and next(iter(floors.values())) + self.window < now:
            floors.popitem(last=False)


class Authenticator:
    """The one check every service applies to a message's header (one per daemon).

    :meth:`check` verifies a request: structure (:func:`verify_header`), receiver, method,
    freshness, single use, signature; then it may ``admit`` the verified sender (a rate
    limit), and only then remembers the nonce. :meth:`verify` is the same without
    remembering. :meth:`check_response` verifies an answer to one of our requests. They raise
    :class:`AuthenticationError` (answer ``UNAUTHENTICATED``) or, for a structural fault such
    as another run, :class:`HeaderError`.

    The replay cache (:class:`ReplayCache`) keeps (sender, nonce) of every accepted request
    until its timestamp leaves the window, at most ``max_nonces`` entries, and when full it
    drops one and refuses that sender's messages stamped at or before it: the horizon is the
    sender's own, so neither a message stamped far ahead nor a flood of other messages can
    make this peer refuse an honest sender.
    """

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        window: float = DEFAULT_AUTH_WINDOW,
        max_nonces: int = DEFAULT_MAX_NONCES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not window > 0:
            raise ValueError("the authentication window must be positive")
        if max_nonces < 1:
            raise ValueError("max_nonces must be >= 1")
        self.peer_id = identity.peer_id
        self.run_id = run_id
        self.window = window
        self.max_nonces = max_nonces
        self.clock = clock
        """The receiver's unix time (a test seam)."""
        self.replays = ReplayCache(window, max_nonces)
        self.refused = 0
        # The last signature verified, with its payload: a service that verified a request
        # before admitting it (:meth:`verify`) hands it to the component's :meth:`check`,
        # which then costs no second Ed25519 verification.
        self._last_verified: tuple[bytes, bytes] = (b"", b"")

    def _check_common(
        self,
        header: common_pb2.RequestHeader,
        method: str,
        digest: bytes,
        *,
        response: bool,
    ) -> tuple[bytes, float]:
        sender = verify_header(header, self.run_id)
        if not header.signature:
            raise AuthenticationError("the message is not signed")
        if header.method != method:
            raise AuthenticationError(f"signed for method {header.method!r}, not {method!r}")
        if header.receiver_id:
            if header.receiver_id != self.peer_id:
                raise AuthenticationError("the message is for another receiver")
        elif response or method not in UNADDRESSED_METHODS:
            raise AuthenticationError("the message names no receiver")
        if len(header.nonce) != NONCE_BYTES:
            raise AuthenticationError(f"the nonce must have {NONCE_BYTES} bytes")
        now = self.clock()
        if not abs(header.timestamp - now) <= self.window:  # also refuses NaN
            raise AuthenticationError(
                f"the timestamp is {header.timestamp - now:+.1f} s from this peer's clock "
                f"(window {self.window:g} s)"
            )
        payload = signed_payload(header, digest, response=response)
        verified = (bytes(header.signature), payload)
        if verified != self._last_verified:
            if not verify_signature(header.public_key, header.signature, payload):
                raise AuthenticationError(
                    "the signature does not verify for this sender and message"
                )
            # the payload names the key (the sender id is its hash): same bytes, same result
            self._last_verified = verified
        if not response:  # answers are bound to our request's nonce: no cache
            refusal = self.replays.refusal(sender, bytes(header.nonce), header.timestamp)
            if refusal is not None:
                raise AuthenticationError(refusal)
        return sender, now

    def verify(self, header: common_pb2.RequestHeader, method: str, digest: bytes) -> bytes:
        """Every check of :meth:`check` (a replay included) without using the nonce up;
        return the sender's peer id. For a service that admits the sender before the
        component that owns the request calls :meth:`check`.

        Raises:
            AuthenticationError, HeaderError: as :meth:`check`.
        """
        try:
            sender, _ = self._check_common(header, method, digest, response=False)
        except AuthenticationError:
            self.refused += 1
            raise
        return sender

    def check(
        self,
        header: common_pb2.RequestHeader,
        method: str,
        digest: bytes,
        admit: Callable[[bytes], str | None] | None = None,
    ) -> bytes:
        """Verify a request (or a stream's first message); return the sender's peer id.

        Args:
            method: the full gRPC method the message arrived on.
            digest: :func:`message_digest` of the message as received.
            admit: called with the verified sender before its nonce is remembered; a
                string it returns (a rate limit's refusal) is raised as
                :class:`AdmissionError` and nothing is remembered.

        Raises:
            AuthenticationError: bad or missing signature, stale timestamp, replay, another
                receiver or method.
            HeaderError: another run or protocol version, a key that does not match the id.
            AdmissionError: ``admit`` refused the sender.
        """
        try:
            sender, now = self._check_common(header, method, digest, response=False)
        except AuthenticationError:
            self.refused += 1
            raise
        if admit is not None:
            refusal = admit(sender)
            if refusal is not None:
                raise AdmissionError(refusal)
        self.replays.add(sender, bytes(header.nonce), header.timestamp, now)
        return sender

    def check_response(
        self,
        header: common_pb2.RequestHeader,
        method: str,
        digest: bytes,
        expected_id: bytes | None = None,
    ) -> bytes:
        """Verify an answer to one of our requests; return the responder's peer id.

        ``digest`` must be bound to our request's nonce (``message_digest(...,
        bound_to=nonce)``), which makes the answer single-use without a cache.

        Raises:
            AuthenticationError / HeaderError: as :meth:`check`; also when the responder is
                not ``expected_id``.
        """
        responder, _ = self._check_common(header, method, digest, response=True)
        if expected_id is not None and responder != expected_id:
            raise AuthenticationError("answered as another peer")
        return responder

    def __len__(self) -> int:
        return len(self.replays)
