"""A peer's credential: the certificate the run's authority issues for a join request
(``swarmavg run invite``), and the checks a peer makes on its own before it serves or dials."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from swarmavg.dht.credentials.authority import check_authority_key, load_authority_key
from swarmavg.dht.credentials.basics import (
    CLOCK_SKEW,
    DEFAULT_CREDENTIAL_DAYS,
    PEER_URI_PREFIX,
    RUN_URI_PREFIX,
    TLS_SERVER_NAME,
    CredentialError,
    peer_server_name,
    pem_key,
    read_file,
    spki,
    uri_values,
    utc_now,
)
from swarmavg.dht.credentials.join_request import JoinRequest, load_tls_key, tls_key_path
from swarmavg.dht.credentials.run_file import RunFile, read_run_file
from swarmavg.dht.identity import PEER_ID_BYTES, Identity


def issue_credential(
    authority_key_pem: bytes,
    run: RunFile,
    request: JoinRequest,
    days: int = DEFAULT_CREDENTIAL_DAYS,
) -> bytes:
    """The credential (certificate, PEM) of ``request``'s peer in ``run``, valid ``days``
    (never past the authority's own expiry).

    Raises:
        CredentialError: the key is not the run file's authority, or ``days`` < 1.
    """
    if days < 1:
        raise CredentialError("a credential must be valid for at least one day")
    key = check_authority_key(
        serialization.load_pem_private_key(authority_key_pem, password=None), run
    )
    authority = run.authority
    tls_key = serialization.load_der_public_key(request.tls_public_key)
    if not isinstance(tls_key, ec.EllipticCurvePublicKey):
        raise CredentialError("the join request's TLS key is not an EC key")
    now = utc_now()
    not_after = min(now + datetime.timedelta(days=days), authority.not_valid_after_utc)
    peer_hex = request.peer_id.hex()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_hex)]))
        .issuer_name(authority.subject)
        .public_key(tls_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName(TLS_SERVER_NAME),
                    x509.DNSName(peer_server_name(request.peer_id)),
                    x509.UniformResourceIdentifier(PEER_URI_PREFIX + peer_hex),
                    x509.UniformResourceIdentifier(RUN_URI_PREFIX + run.run_id),
                ]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM)


def invite(
    authority_path: str | os.PathLike[str],
    run_path: str | os.PathLike[str],
    request_text: str,
    days: int = DEFAULT_CREDENTIAL_DAYS,
) -> tuple[bytes, bytes]:
    """``swarmavg run invite``: (the peer id, its credential PEM) for a join request line.

    Raises:
        CredentialError: a bad file or request (the message says which).
    """
    run = read_run_file(run_path)
    key = load_authority_key(authority_path)
    request = JoinRequest.decode(request_text)
    return request.peer_id, issue_credential(pem_key(key), run, request, days)


def peer_id_of_certificate(certificate: x509.Certificate) -> bytes | None:
    """The peer id a credential names (its one ``swarmavg:peer:`` URI), or ``None``."""
    values = uri_values(certificate, PEER_URI_PREFIX)
    if len(values) != 1:
        return None
    try:
        peer_id = bytes.fromhex(values[0])
    except ValueError:
        return None
    return peer_id if len(peer_id) == PEER_ID_BYTES else None


@dataclass(frozen=True)
class PeerCredentials:
    """A peer's checked credentials for one private run: what its TLS endpoints are built of.

    Attributes:
        run_id: the run (from the run file).
        peer_id: the peer id the credential names (equal to the identity's).
        authority_pem: the run authority's certificate (the only trusted root).
        certificate_pem: this peer's credential.
        private_key_pem: this peer's TLS key (PKCS#8 PEM).
        not_after: when the credential expires.
    """

    run_id: str
    peer_id: bytes
    authority_pem: bytes
    certificate_pem: bytes
    private_key_pem: bytes
    not_after: datetime.datetime


def load_peer_credentials(
    run_path: str | os.PathLike[str],
    credential_path: str | os.PathLike[str],
    identity: Identity,
    identity_path: str | os.PathLike[str],
    run_id: str,
    now: datetime.datetime | None = None,
) -> PeerCredentials:
    """Load and check everything a peer of a private run needs before it serves or dials.

    Checks, each with its own message: the run file is for ``run_id``; the credential was
    issued by this run's authority, is valid now and names this identity's peer id; the TLS
    key beside the identity is the key the credential certifies.

    Raises:
        CredentialError: one line saying which check failed and what to do.
    """
    run = read_run_file(run_path)
    if run.run_id != run_id:
        raise CredentialError(
            f"run file {os.fspath(run_path)} is for run {run.run_id!r}, but this peer is set "
            f"to run {run_id!r}; drop --run-id (the run file names the run) or use that run's file"
        )
    where = f"credential {os.fspath(credential_path)}"
    try:
        certificate = x509.load_pem_x509_certificate(read_file(credential_path, "credential"))
    except ValueError:
        raise CredentialError(f"{where} is not a PEM certificate") from None
    authority = run.authority
    try:
        certificate.verify_directly_issued_by(authority)
    except (ValueError, TypeError, InvalidSignature):
        raise CredentialError(
            f"{where} was not issued by the authority of run {run.run_id!r} (a credential of "
            "another run?); ask this run's organiser for an invite"
        ) from None
    now = now or utc_now()
    if now > certificate.not_valid_after_utc:
        raise CredentialError(
            f"{where} expired on {certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
            "ask the organiser for a new invite"
        )
    if now < certificate.not_valid_before_utc:
        raise CredentialError(f"{where} is not valid before {certificate.not_valid_before_utc}")
    peer_id = peer_id_of_certificate(certificate)
    if peer_id != identity.peer_id:
        named = peer_id.hex() if peer_id else "no peer"
        raise CredentialError(
            f"{where} was issued to peer {named}, but identity {os.fspath(identity_path)} is "
            f"peer {identity.peer_id_hex}"
        )
    key_path = tls_key_path(identity_path)
    if not key_path.exists():
        raise CredentialError(
            f"no TLS key at {key_path}: it is made by `swarmavg run whoami --identity "
            f"{os.fspath(identity_path)}`, whose join request the credential must answer"
        )
    key = load_tls_key(key_path)
    if spki(key.public_key()) != spki(certificate.public_key()):  # type: ignore[arg-type]
        raise CredentialError(
            f"{where} certifies another TLS key than {key_path} (a credential for an older "
            "join request?); send a new join request"
        )
    return PeerCredentials(
        run_id=run.run_id,
        peer_id=peer_id,
        authority_pem=run.authority_pem,
        certificate_pem=certificate.public_bytes(serialization.Encoding.PEM),
        private_key_pem=pem_key(key),
        not_after=certificate.not_valid_after_utc,
    )
