"""MAC framing of a keyed ``Reduce`` stream: every message after the handshake ends with a tag.

The tag is the last field of the message (``mac``, field 8 of ``ReduceRequest`` and
``ReduceResponse``, 16 bytes), so the message stays ordinary protobuf and its payload is not
copied: the tag covers every byte before the field, fed to the hash piece by piece. Its input
also holds the message's sequence number in its direction (counted by both ends, never sent)
and the direction itself, so a message altered, dropped, replayed, reordered, sent back the
other way or taken from another stream (another key, :mod:`stream_keys`) fails the check.

The MAC is keyed BLAKE2b from :mod:`hashlib` (RFC 7693's keyed mode, a PRF): docs/security.md
gives its throughput beside HMAC-SHA256 and Poly1305 on this project's machines.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Iterable

__all__ = [
    "TAG_BYTES",
    "TRAILER_BYTES",
    "TRAILER_HEAD",
    "Direction",
    "IntegrityError",
    "StreamMac",
]

TAG_BYTES = 16
MAC_FIELD = 8  # ReduceRequest.mac and ReduceResponse.mac
TRAILER_HEAD = bytes((MAC_FIELD << 3 | 2, TAG_BYTES))
"""The protobuf key and length of the ``mac`` field: a length-delimited field of 16 bytes."""
TRAILER_BYTES = len(TRAILER_HEAD) + TAG_BYTES
_SEQUENCE = struct.Struct("<QB")


class Direction(enum.IntEnum):
    """Which way a message goes: part of every tag, so no message can be reflected."""

    TO_REDUCER = 0
    TO_SENDER = 1


class IntegrityError(ValueError):
    """A message of a keyed stream has no tag, or a tag that does not verify."""


class StreamMac:
    """The tags of one direction of one keyed stream.

    Each end holds two (one per direction); :meth:`seal` and :meth:`check` count the
    messages of their direction, so both must see every message in order.
    """

    def __init__(self, key: bytes, direction: Direction) -> None:
        if len(key) != 32:
            raise ValueError(f"a stream MAC key is 32 bytes, not {len(key)}")
        self._key = key
        self._direction = direction
        self.sequence = 0
        """Messages of this direction sealed or checked so far."""

    def _tag(self, sequence: int, pieces: Iterable[bytes | memoryview]) -> bytes:
        hasher = hashlib.blake2b(key=self._key, digest_size=TAG_BYTES)
        hasher.update(_SEQUENCE.pack(sequence, self._direction))
        for piece in pieces:
            hasher.update(piece)
        return hasher.digest()

    def seal(self, pieces: Iterable[bytes | memoryview]) -> bytes:
        """The trailer (the ``mac`` field) to send after the next message, given as the
        pieces of its wire bytes."""
        tag = self._tag(self.sequence, pieces)
        self.sequence += 1
        return TRAILER_HEAD + tag

    def check(self, covered: memoryview | bytes | None, tag: bytes) -> None:
        """Verify the next message: ``covered`` its bytes before the ``mac`` field, ``tag``
        the field's value (``None``/empty: the message had none).

        Raises:
            IntegrityError: no tag, or the tag does not match.
        """
        sequence = self.sequence
        self.sequence += 1
        if covered is None or len(tag) != TAG_BYTES:
            raise IntegrityError(f"message {sequence} of a keyed stream carries no tag")
        if not hmac.compare_digest(self._tag(sequence, (covered,)), tag):
            raise IntegrityError(
                f"message {sequence} of the stream failed its integrity check "
                "(altered, replayed, reordered or from another stream)"
            )
