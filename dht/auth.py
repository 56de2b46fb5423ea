"""Sender authentication of every peer-to-peer message, with a bounded replay window (issue 16).

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
replay. Streams are authenticated once, by their first message; the rest of an HTTP/2
stream or data-plane connection cannot be injected by an off-path third party (see
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
"""Replay-cache entries kept at most (about 30 MB): ~1600 messages per second for 120 s."""

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


class Authenticator:
    """The one check every service applies to a message's header (one per daemon).

    :meth:`check` verifies a request: structure (:func:`verify_header`), receiver, method,
    freshness, signature, and single use. :meth:`check_response` verifies an answer to one
    of our requests. Both raise :class:`AuthenticationError` (answer ``UNAUTHENTICATED``)
    or, for a structural fault such as another run, :class:`HeaderError`.

    The replay cache holds (sender, nonce) of every accepted request until its timestamp
    leaves the window, at most ``max_nonces`` entries. When it is full, the oldest entry is
    dropped and its timestamp becomes a floor: a request stamped at or before the floor is
    refused, so evicting never lets a replay through (under a flood, honest requests older
    than the floor are refused too, and the sender retries with a fresh stamp).
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
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # sender+nonce -> timestamp
        self._floor = -float("inf")
        self.refused = 0

    def _check_common(
        self, header: common_pb2.RequestHeader, method: str, digest: bytes, *, response: bool
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
        if not verify_signature(header.public_key, header.signature, payload):
            raise AuthenticationError("the signature does not verify for this sender and message")
        return sender, now

    def check(self, header: common_pb2.RequestHeader, method: str, digest: bytes) -> bytes:
        """Verify a request (or a stream's first message); return the sender's peer id.

        Args:
            method: the full gRPC method the message arrived on.
            digest: :func:`message_digest` of the message as received.

        Raises:
            AuthenticationError: bad or missing signature, stale timestamp, replay, another
                receiver or method.
            HeaderError: another run or protocol version, a key that does not match the id.
        """
        try:
            sender, now = self._check_common(header, method, digest, response=False)
            self._remember(sender + bytes(header.nonce), header.timestamp, now)
        except AuthenticationError:
            self.refused += 1
            raise
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

    def _remember(self, key: bytes, timestamp: float, now: float) -> None:
        if timestamp <= self._floor:
            raise AuthenticationError(
                "the timestamp predates this peer's replay horizon (it is flooded); "
                "sign the message again"
            )
        if key in self._seen:
            raise AuthenticationError("replayed message: this nonce was already used")
        seen = self._seen
        # Entries leave once their timestamp is out of the window; insertion order is only
        # roughly timestamp order, so this frees the front and lets a late straggler wait.
        while seen:
            oldest_key, oldest = next(iter(seen.items()))
            if oldest + self.window >= now and len(seen) < self.max_nonces:
                break
            del seen[oldest_key]
            if oldest + self.window >= now:
                self._floor = max(self._floor, oldest)  # evicted while still fresh
        seen[key] = timestamp

    def __len__(self) -> int:
        return len(self._seen)
