"""Resumed keyed streams: the key of a later stream between two peers without a handshake.

A full handshake (keyed_stream.py) costs the stream one round trip before its first chunk:
the sender waits for the reducer's signed key. Measured in 64 MB rounds of 4 daemons on a
loaded 2-core machine, that wait was 20 ms at the median and 64 ms at the 90th percentile,
the largest part of what keys added to a round. The same two peers meet round after round,
so, as TLS 1.3 resumes a session, a full handshake also gives both ends a resumption secret
(HKDF of the stream's key under a label of its own: nothing of the stream's tags reveals
it) and a public ticket naming it. The sender's next stream to that reducer names the ticket
in its signed first message (the signature covers it) and sends its chunks at once, each
tagged under a key derived from the secret and a transcript of both ids, the round, the part
and the sender's fresh random key field: unique per stream, and known to the two ends only.
The reducer finds the secret by the sender's verified id and the ticket, derives the same
key and answers with tagged averages, no handshake. Replaying a resumed first message is
refused as any first message (the header's nonce, dht/auth.py).

A reducer that no longer holds the ticket (restarted, evicted, expired) refuses the stream
with ``UNAUTHENTICATED`` before reading a chunk; the sender forgets its secret and opens the
stream again with a full handshake (streams.py). Secrets live in memory only, for
:data:`LIFETIME` seconds from their handshake, at most :data:`MAX_PEERS` per role (least
recently used out); an entry is made only after a member of a round here ran a full
handshake, so strangers cannot fill the cache.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarmavg.averaging.allreduce.stream_keys import MAC_KEY_BYTES, transcript

__all__ = ["LIFETIME", "MAX_PEERS", "Resumption", "ResumptionCache", "resumed_key"]

LIFETIME = 600.0
"""Seconds a resumption secret serves from its full handshake: then a new handshake."""
MAX_PEERS = 4096
"""Secrets kept per role (as a sender, as a reducer)."""
TICKET_BYTES = 16
_SECRET_INFO = b"swarmavg/v2 reduce stream resumption secret\x00"
_TICKET_DOMAIN = b"swarmavg/v2 reduce stream resumption ticket\x00"
_RESUMED_INFO = b"swarmavg/v2 resumed reduce stream gmac key\x00"


@dataclasses.dataclass(frozen=True)
class Resumption:
    """A secret two peers share after a full handshake, and the public ticket naming it."""

    ticket: bytes
    secret: bytes
    expires: float
    """``time.monotonic()`` instant after which it is not used."""
    stripes: int = 1
    """At the sender: the most streams the reducer said, under a stream's tag, it takes from
    one sender in a round (1 until it said more). It goes with the secret: a reducer that
    restarts forgets the secret, and its next word comes with a new one."""

    @classmethod
    def from_stream_key(cls, key: bytes) -> Resumption:
        """The resumption a full handshake's stream key gives both ends."""
        secret = HKDF(SHA256(), MAC_KEY_BYTES, salt=None, info=_SECRET_INFO).derive(key)
        ticket = hashlib.sha256(_TICKET_DOMAIN + secret).digest()[:TICKET_BYTES]
        return cls(ticket, secret, time.monotonic() + LIFETIME)


def resumed_key(
    secret: bytes,
    sender_id: bytes,
    reducer_id: bytes,
    group_id: bytes,
    part_index: int,
    sender_key: bytes,
    ticket: bytes,
) -> bytes:
    """A resumed stream's 32-byte MAC key: the shared secret, bound to this stream."""
    bound = transcript(sender_id, reducer_id, group_id, part_index, sender_key, ticket)
    return HKDF(SHA256(), MAC_KEY_BYTES, salt=None, info=_RESUMED_INFO + bound).derive(secret)


class _Secrets:
    """Secrets by a key naming them, bounded, least recently used out, expiring."""

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._by_key: collections.OrderedDict[bytes, Resumption] = collections.OrderedDict()

    def put(self, key: bytes, resumption: Resumption) -> None:
        self._by_key[key] = resumption
        self._by_key.move_to_end(key)
        while len(self._by_key) > self._max_entries:
            self._by_key.popitem(last=False)

    def get(self, key: bytes) -> Resumption | None:
        resumption = self._by_key.get(key)
        if resumption is None:
            return None
        if time.monotonic() >= resumption.expires:
            del self._by_key[key]
            return None
        self._by_key.move_to_end(key)
        return resumption

    def pop(self, key: bytes) -> None:
        self._by_key.pop(key, None)

    def __len__(self) -> int:
        return len(self._by_key)


class ResumptionCache:
    """A daemon's resumption secrets: as a sender, the latest per reducer; as a reducer,
    each by its sender and ticket (a sender in two rounds here at once may resume either)."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self._as_sender = _Secrets(max_peers)
        self._as_reducer = _Secrets(max_peers)

    def remember_reducer(self, reducer_id: bytes, resumption: Resumption) -> None:
        """Keep what our full handshake with ``reducer_id`` gave (replacing the last)."""
        self._as_sender.put(reducer_id, resumption)

    def for_reducer(self, reducer_id: bytes) -> Resumption | None:
        """What a stream to ``reducer_id`` may resume with (``None``: a full handshake)."""
        return self._as_sender.get(reducer_id)

    def forget_reducer(self, reducer_id: bytes, ticket: bytes) -> None:
        """``reducer_id`` refused ``ticket``: the next stream to it runs a full handshake."""
        held = self._as_sender.get(reducer_id)
        if held is not None and held.ticket == ticket:
            self._as_sender.pop(reducer_id)

    def note_stripes(self, reducer_id: bytes, ticket: bytes, stripes: int) -> None:
        """``reducer_id`` said, on a stream keyed with the secret ``ticket`` names, that it
        takes ``stripes`` streams from one sender: kept with that secret, if still held."""
        held = self._as_sender.get(reducer_id)
        if held is not None and held.ticket == ticket and held.stripes != stripes:
            self._as_sender.put(reducer_id, dataclasses.replace(held, stripes=stripes))

    def remember_sender(self, sender_id: bytes, resumption: Resumption) -> None:
        """Keep what a full handshake we answered for ``sender_id`` gave."""
        self._as_reducer.put(sender_id + resumption.ticket, resumption)

    def for_sender(self, sender_id: bytes, ticket: bytes) -> Resumption | None:
        """The secret a resumed stream of the verified ``sender_id`` names, if held here."""
        return self._as_reducer.get(sender_id + ticket)
