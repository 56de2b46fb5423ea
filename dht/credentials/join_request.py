"""A peer's side of an invitation: its P-256 TLS key beside its identity, and the join
request it sends the organiser (its identity's public key and its TLS public key, the latter
signed by the identity: a request cannot bind someone else's peer id). No private key
travels."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from swarmavg.dht.credentials.basics import (
    CredentialError,
    pem_key,
    read_file,
    spki,
    write_secret,
)
from swarmavg.dht.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    peer_id_from_public_key,
    verify_signature,
)

JOIN_REQUEST_PREFIX = "swarmavg-join-v1:"
_JOIN_SIGNING_PREFIX = b"swarmavg.v1.join-request\x00"


def tls_key_path(identity_path: str | os.PathLike[str]) -> Path:
    """Where the TLS key of the identity stored at ``identity_path`` lives."""
    return Path(os.fspath(identity_path) + ".tls.pem")


def load_or_create_tls_key(path: str | os.PathLike[str]) -> ec.EllipticCurvePrivateKey:
    """Load the P-256 TLS key at ``path``; create it (mode 600) when missing.

    Raises:
        CredentialError: the file exists but holds no P-256 key, or cannot be written.
    """
    path = Path(path)
    if not path.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            write_secret(path, pem_key(key))
            return key
        except FileExistsError:
            pass  # another process created it first: use theirs
        except OSError as exc:
            raise CredentialError(f"cannot write TLS key {path}: {exc.strerror}") from None
    return load_tls_key(path)


def load_tls_key(path: str | os.PathLike[str]) -> ec.EllipticCurvePrivateKey:
    """Load an existing TLS key (see :func:`load_or_create_tls_key`)."""
    data = read_file(path, "TLS key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise CredentialError(f"TLS key {os.fspath(path)}: not a PEM key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise CredentialError(f"TLS key {os.fspath(path)}: not a P-256 key")
    return key


@dataclass(frozen=True)
class JoinRequest:
    """What an invitee sends the organiser: who it is and which TLS key to certify.

    ``signature`` is the identity's Ed25519 signature over the TLS key, so only the holder of
    a peer id's identity key can ask for that peer id to be bound to a TLS key.
    """

    identity_public_key: bytes
    tls_public_key: bytes  # DER SubjectPublicKeyInfo of a P-256 key
    signature: bytes

    @property
    def peer_id(self) -> bytes:
        return peer_id_from_public_key(self.identity_public_key)

    @staticmethod
    def signing_payload(tls_public_key: bytes) -> bytes:
        return _JOIN_SIGNING_PREFIX + tls_public_key

    @classmethod
    def make(cls, identity: Identity, tls_key: ec.EllipticCurvePrivateKey) -> JoinRequest:
        public = spki(tls_key.public_key())
        return cls(identity.public_key, public, identity.sign(cls.signing_payload(public)))

    def encode(self) -> str:
        """One line of text (safe to paste into a chat or an e-mail; it holds no secret)."""
        raw = self.identity_public_key + self.signature + self.tls_public_key
        return JOIN_REQUEST_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> JoinRequest:
        """Parse and verify a join request line.

        Raises:
            CredentialError: not a join request, or its signature does not verify.
        """
        text = text.strip()
        if not text.startswith(JOIN_REQUEST_PREFIX):
            raise CredentialError(f"not a join request (it starts with {JOIN_REQUEST_PREFIX!r})")
        body = text[len(JOIN_REQUEST_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except ValueError:
            raise CredentialError("the join request is not valid base64") from None
        head = PUBLIC_KEY_BYTES + SIGNATURE_BYTES
        if len(raw) <= head or len(raw) > head + 256:
            raise CredentialError("the join request has the wrong length (cut off?)")
        request = cls(raw[:PUBLIC_KEY_BYTES], raw[head:], raw[PUBLIC_KEY_BYTES:head])
        try:
            key = serialization.load_der_public_key(request.tls_public_key)
        except ValueError:
            raise CredentialError("the join request holds no valid TLS public key") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
            raise CredentialError("the join request's TLS key is not a P-256 key")
        payload = cls.signing_payload(request.tls_public_key)
        if not verify_signature(request.identity_public_key, request.signature, payload):
            raise CredentialError("the join request's signature does not verify")
        return request
