"""MAC framing of a keyed ``Reduce`` stream: every message after the handshake ends with a tag.

The tag is the last field of the message (``mac``, field 8 of ``ReduceRequest`` and
``ReduceResponse``, 16 bytes), so the message stays ordinary protobuf: the tag covers every
byte before the field. Each tag is bound to the message's sequence number in its direction
(counted by both ends, never sent) and to the direction itself, so a message altered,
dropped, replayed, reordered, sent back the other way or taken from another stream (another
key, :mod:`stream_keys`) fails the check.

The MAC is AES-256-GCM (`cryptography`'s, OpenSSL's) with an empty plaintext and the message
as associated data: GMAC, the AEAD's tag over the data, nothing encrypted (public runs' tensors
are the run's to read). Its nonce is the sequence number and the direction, unique under a key
used by one stream only. A sender's message is two pieces (the small head, the payload): they
are fed to GMAC one after the other, never joined (no copy of the payload). On CPUs with AES
and carry-less multiplication instructions (x86-64 since 2010, ARMv8's crypto extensions)
GMAC tags 3-5x faster than ChaCha20-Poly1305 and 35x faster than keyed BLAKE2b: the round's
CPU-bound hot path tags every byte 4 times (``benchmarks/stream_mac.py``, docs/benchmarks.md
"Security checks' cost").
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

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
_NONCE = struct.Struct("<QB3x")  # 12 bytes: sequence number, direction


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
        self._aead = AESGCM(key)
        self._cipher = algorithms.AES(key)
        self._direction = direction
        self.sequence = 0
        """Messages of this direction sealed or checked so far."""

    def _nonce(self, sequence: int) -> bytes:
        return _NONCE.pack(sequence, self._direction)

    def seal(self, pieces: Sequence[bytes | memoryview]) -> bytes:
        """The trailer (the ``mac`` field) to send after the next message, given as the
        pieces of its wire bytes."""
        nonce = self._nonce(self.sequence)
        if len(pieces) == 1:
            tag = self._aead.encrypt(nonce, b"", pieces[0])
        else:
            # GMAC over the pieces in turn: the same tag as over their join, without the
            # copy of the payload a join makes.
            gmac = Cipher(self._cipher, modes.GCM(nonce)).encryptor()
            for piece in pieces:
                gmac.authenticate_additional_data(piece)
            gmac.finalize()
            tag = gmac.tag
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
        try:
            self._aead.decrypt(self._nonce(sequence), tag, covered)  # compares in constant time
        except InvalidTag:
            raise IntegrityError(
                f"message {sequence} of the stream failed its integrity check "
                "(altered, replayed, reordered or from another stream)"
            ) from None
