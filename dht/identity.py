"""A peer's identity: an Ed25519 key pair and the 160-bit peer id derived from it.

The peer id is ``sha1(raw public key)`` (20 bytes), so a node cannot choose its place in
the Kademlia keyspace and anyone holding the public key can check a claimed id.
Every peer-to-peer request carries a :class:`~swarmavg.proto.common_pb2.RequestHeader`;
:func:`verify_header` is its structural check.

What :func:`verify_header` proves, and what it does not: the public key must hash to the
claimed peer id, so a sender cannot claim an id without naming the matching key. It does not
prove that the sender *holds* the private key; anyone can copy another peer's public key into
a header. :mod:`swarmavg.dht.auth` closes that hole: every message is signed by its sender,
and :class:`~swarmavg.dht.auth.Authenticator` (which runs :func:`verify_header` first, as the
cheap structural check) is the one check every service applies. See docs/security.md.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from swarmavg.proto import common_pb2

PROTOCOL_VERSION = 1
"""Wire protocol version this code speaks (``RequestHeader.protocol_version``)."""

PEER_ID_BYTES = 20
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
_KEY_FILE_BYTES = 32  # a raw Ed25519 private key (seed)


class HeaderError(ValueError):
    """A request header is malformed, from another run or protocol version, or lies about its id."""


class KeyFilePermissionError(PermissionError):
    """An identity file that users other than its owner may read or write (as ssh, refused:
    whoever reads the file is that peer). The message says the ``chmod`` that fixes it."""


def peer_id_from_public_key(public_key: bytes) -> bytes:
    """Return the 20-byte peer id of a raw 32-byte Ed25519 public key.

    Raises:
        ValueError: the key is not 32 bytes.
    """
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"a public key has {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha1(public_key).digest()


@functools.lru_cache(maxsize=4096)
def _public_key(public_key: bytes) -> VerifyKey:
    """The key object (immutable, so shared): a swarm's few hundred senders sign every
    message; building it again for each costs a few percent of a verification."""
    return VerifyKey(public_key)


def verify_signature(public_key: bytes, signature: bytes, payload: bytes) -> bool:
    """Return whether ``signature`` is ``public_key``'s Ed25519 signature of ``payload``.

    Never raises on malformed input (wrong lengths, invalid points): those are simply ``False``.

    Signatures are made and checked with libsodium (PyNaCl) rather than OpenSSL
    (``cryptography``): the same deterministic Ed25519 (RFC 8032), so either side of a
    mixed-version swarm verifies the other's signatures, at half the CPU (verify 41 us
    against 86 us, sign 16 us against 28 us on the development machine). Every message of
    the swarm is signed and checked (docs/security.md), so this is a daemon's largest
    cryptographic cost after TLS. libsodium is also the stricter checker: it refuses
    non-canonical encodings and small-order keys, which OpenSSL accepts.
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        _public_key(public_key).verify(payload, signature)
    except (BadSignatureError, ValueError, TypeError):
        return False
    return True


class Identity:
    """An Ed25519 key pair and the peer id derived from its public key.

    Thread-safe and immutable. Create with :meth:`generate` or :meth:`load_or_create`.
    """

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        seed = private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        self._signing_key = SigningKey(seed)  # libsodium signs: see verify_signature
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: bytes = peer_id_from_public_key(self.public_key)
        self.peer_id_hex: str = self.peer_id.hex()

    @classmethod
    def generate(cls) -> Identity:
        """Return a fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the identity stored at ``path``; create it (file mode 600) when missing.

        The same file always gives the same peer id. The file holds the raw 32-byte private key.
        Creation is atomic (``O_EXCL``): two processes racing on a missing file end up with the
        same identity, and the key is never readable by other users, even briefly. An existing
        file that its group or other users may read or write is refused, as ssh refuses such
        a private key: the message says to ``chmod 600`` it.

        Raises:
            ValueError: the file exists but does not hold a 32-byte key.
            KeyFilePermissionError: the file exists and its mode lets other users at it (an
                ``OSError``).
            OSError: the file cannot be read or created.
        """
        path = Path(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            with open(path, "rb") as file:
                mode = stat.S_IMODE(os.fstat(file.fileno()).st_mode)
                data = file.read(_KEY_FILE_BYTES + 1)
            if len(data) != _KEY_FILE_BYTES:
                raise ValueError(
                    f"{path} is not a swarmavg identity file "
                    f"(expected {_KEY_FILE_BYTES} bytes, found {len(data)}"
                    f"{' or more' if len(data) > _KEY_FILE_BYTES else ''})"
                ) from None
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise KeyFilePermissionError(
                    f"permissions {mode:04o} for the identity file {path} are too open: it is "
                    "this peer's private key, and other users may reach it; it is refused "
                    f"(run `chmod 600 {path}`)"
                ) from None
            return cls(Ed25519PrivateKey.from_private_bytes(data))
        private_key = Ed25519PrivateKey.generate()
        raw = private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        try:
            os.write(fd, raw)
            os.fsync(fd)
        finally:
            os.close(fd)
        return cls(private_key)

    def sign(self, payload: bytes) -> bytes:
        """Return the 64-byte Ed25519 signature of ``payload``."""
        return self._signing_key.sign(payload).signature

    def verify(self, signature: bytes, payload: bytes) -> bool:
        """Return whether ``signature`` is this identity's signature of ``payload``."""
        return verify_signature(self.public_key, signature, payload)

    def make_header(self, run_id: str, address: str = "") -> common_pb2.RequestHeader:
        """Return an *unsigned* header naming this identity (``address`` empty in client mode).

        Every service refuses it as it is: requests are sent with a header from
        :func:`swarmavg.dht.auth.sign_request`, which starts from the same fields.
        """
        return common_pb2.RequestHeader(
            peer_id=self.peer_id,
            run_id=run_id,
            protocol_version=PROTOCOL_VERSION,
            address=address,
            public_key=self.public_key,
        )

    def __repr__(self) -> str:
        return f"Identity({self.peer_id_hex})"


def verify_header(header: common_pb2.RequestHeader, run_id: str) -> bytes:
    """Check a request header; return the sender's 20-byte peer id.

    Checks the protocol version, the run id, and that ``header.public_key`` hashes to
    ``header.peer_id``. Cheap (one SHA-1, no signature work), so every service can call it on
    every request.

    Raises:
        HeaderError: with a message that says which check failed.
    """
    if header.protocol_version != PROTOCOL_VERSION:
        raise HeaderError(
            f"protocol version {header.protocol_version} is not supported "
            f"(this peer speaks {PROTOCOL_VERSION})"
        )
    if header.run_id != run_id:
        # Says that the runs differ, never which run this peer serves: the run id is the
        # only gate of a public run, and an error must not hand it to a prober.
        raise HeaderError("the run id differs: the message is for another run than this peer's")
    if len(header.public_key) != PUBLIC_KEY_BYTES:
        raise HeaderError(f"public key must have {PUBLIC_KEY_BYTES} bytes")
    if len(header.peer_id) != PEER_ID_BYTES:
        raise HeaderError(f"peer id must have {PEER_ID_BYTES} bytes")
    if hashlib.sha1(header.public_key).digest() != header.peer_id:
        raise HeaderError("peer id does not match the public key")
    return bytes(header.peer_id)


def address_signature_payload(run_id: str, peer_id: bytes, address: str) -> bytes:
    """The bytes a peer signs to bind its id to its public address in one run.

    The DHT sends this signature with every request that carries an address, so that a sender
    which copies another peer's public key cannot put its own address into routing tables under
    that peer's id. Replaying the signature only repeats a true statement (this id is reachable
    at that address), so it carries no timestamp and receivers may cache its verification.
    """
    return b"swarmavg.v1.dht.address\x00" + run_id.encode() + b"\x00" + peer_id + address.encode()
