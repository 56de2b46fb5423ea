"""What a private run's credential modules share: the error, the names a certificate
carries, and keys and files in PEM."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

RUN_FILE_FORMAT = "swarmavg-run/1"
PEER_URI_PREFIX = "swarmavg:peer:"
RUN_URI_PREFIX = "swarmavg:run:"
TLS_SERVER_NAME = "peer.swarmavg.invalid"
"""The one DNS name every peer certificate carries. Certificates name peer ids, not hosts, so
every client checks this fixed name (grpc's ``ssl_target_name_override``, ``ssl``'s
``server_hostname``); ``.invalid`` is reserved (RFC 2606) and never resolves."""


def peer_server_name(peer_id: bytes) -> str:
    """The DNS name that binds a credential to its peer id (``<hex id>.`` + the shared name):
    a client that dials a known member checks this name, so only that member's credential
    passes, not any credential of the run. Every credential carries it besides
    :data:`TLS_SERVER_NAME`."""
    return f"{peer_id.hex()}.{TLS_SERVER_NAME}"


DEFAULT_AUTHORITY_DAYS = 3650
DEFAULT_CREDENTIAL_DAYS = 90
CLOCK_SKEW = datetime.timedelta(minutes=5)
"""Certificates start this much in the past, for peers whose clocks run a little behind."""


class CredentialError(ValueError):
    """A run file, credential, key or join request is missing, malformed, foreign or expired.

    The message is one line meant for the user, naming the file and what to do.
    """


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM (the files are protected by their mode)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def spki(key: ec.EllipticCurvePublicKey) -> bytes:
    """``key`` as DER SubjectPublicKeyInfo: the bytes two keys are compared by."""
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def write_secret(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 600 (``O_EXCL``: never overwrites, never readable by others)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str | os.PathLike[str], what: str) -> bytes:
    """The bytes of ``path``; a :class:`CredentialError` naming ``what`` when unreadable."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CredentialError(f"{what} {os.fspath(path)}: {exc.strerror}") from None


def uri_values(certificate: x509.Certificate, prefix: str) -> list[str]:
    """What follows ``prefix`` in each of the certificate's URI SANs that start with it."""
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [
        uri[len(prefix) :]
        for uri in names.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.startswith(prefix)
    ]
