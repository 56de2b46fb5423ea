"""Key agreement of a keyed ``Reduce`` stream: one MAC key per stream, bound to both ends.

Only a stream's first message is signed (its sender's identity), and the reducer's answers
not at all, so anyone on the path (a relay, a hijacked route) could alter the chunks and the
averages after it. A keyed stream closes that (docs/security.md): each end makes an
ephemeral X25519 key for this stream alone and sends its public half under its identity's
signature: the sender in its signed first message (``ReduceRequest.stream_key``, covered by
:func:`~swarmavg.averaging.allreduce.wire.reduce_digest`), the reducer in a handshake reply
signed as the answer to that message (:func:`handshake_digest`, bound to its nonce). Both
derive the key with HKDF-SHA256 over the X25519 secret and a transcript naming both
identities, the round, the part and both public keys, so a key is good for one stream
between those two peers only; an attacker on the path sees both public keys, never the
secret. The cryptography is `cryptography`'s (OpenSSL's X25519 and HKDF), nothing of our own.
"""

from __future__ import annotations

import hashlib
import struct

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "PUBLIC_KEY_BYTES",
    "EphemeralKey",
    "KeyAgreementError",
    "handshake_digest",
    "transcript",
]

PUBLIC_KEY_BYTES = 32
MAC_KEY_BYTES = 32
_HKDF_INFO = b"swarmavg/v2 reduce stream gmac key\x00"
_HANDSHAKE_DOMAIN = b"swarmavg/v1 reduce stream handshake\x00"


class KeyAgreementError(ValueError):
    """The other side's public key is malformed or of low order (no shared secret)."""


def _blob(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def transcript(
    sender_id: bytes,
    reducer_id: bytes,
    group_id: bytes,
    part_index: int,
    sender_key: bytes,
    reducer_key: bytes,
) -> bytes:
    """What a stream's key is bound to: both identities, the round, the part and both
    ephemeral public keys (each length-prefixed, so no two streams share a transcript)."""
    return hashlib.sha256(
        b"".join(
            (
                _blob(sender_id),
                _blob(reducer_id),
                _blob(group_id),
                struct.pack(">I", part_index),
                _blob(sender_key),
                _blob(reducer_key),
            )
        )
    ).digest()


def handshake_digest(first_nonce: bytes, reducer_key: bytes) -> bytes:
    """What the reducer's handshake reply is signed over: its public key, bound to the nonce
    of the first message it answers (so it answers that stream only, without a cache)."""
    return hashlib.sha256(_HANDSHAKE_DOMAIN + _blob(first_nonce) + _blob(reducer_key)).digest()


class EphemeralKey:
    """One end's X25519 key for one stream; made per stream, never stored."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()
        """The 32-byte public key this end sends."""

    def agree(self, their_public: bytes, stream_transcript: bytes) -> bytes:
        """The stream's 32-byte MAC key, from the other end's public key.

        Raises:
            KeyAgreementError: ``their_public`` is not 32 bytes, or gives the all-zero
                secret (a low-order point: an attacker's way to force a known key).
        """
        if len(their_public) != PUBLIC_KEY_BYTES:
            raise KeyAgreementError(f"a stream key is {len(their_public)} bytes, not 32")
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(their_public))
        except ValueError as e:  # OpenSSL refuses an all-zero shared secret
            raise KeyAgreementError(f"unusable stream key: {e}") from None
        hkdf = HKDF(SHA256(), MAC_KEY_BYTES, salt=None, info=_HKDF_INFO + stream_transcript)
        return hkdf.derive(shared)
