"""A private run's credentials: its authority, join requests, and the peer credentials it issues.

A private run (docs/private-runs.md) admits only peers holding a credential issued by
the run's authority. Everything here is X.509 made with ``cryptography``; the wire side (TLS on
the gRPC port and the data plane) is :mod:`swarmavg.dht.tls`.

Why a TLS key beside the Ed25519 identity: grpcio's TLS (BoringSSL) does not offer Ed25519
signatures in the handshake (``NO_COMMON_SIGNATURE_ALGORITHMS``, checked with grpcio 1.85),
although Python's ``ssl`` (OpenSSL) does. So every peer of a private run has an ECDSA P-256
TLS key, kept next to its identity file (``<identity>.tls.pem``, mode 600), and its credential
certifies that key *and* names the peer id (URI SAN ``swarmavg:peer:<hex id>``). No private key
ever travels: the invitee sends a join request (its Ed25519 public key and TLS public key, the
latter signed by the identity key, so a request cannot bind someone else's peer id), and the
organiser sends back the certificate.

Files:

- the authority key (``swarmavg run init``): the CA's P-256 private key, PEM, mode 600, kept by
  the organiser only;
- the run file: TOML with the run id and the authority's CA certificate; no secret, every peer
  gets it;
- a credential (``swarmavg run invite``): the peer's certificate, PEM.
"""

from __future__ import annotations

import base64
import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from swarmavg.dht.identity import (
    PEER_ID_BYTES,
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    peer_id_from_public_key,
    verify_signature,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

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


JOIN_REQUEST_PREFIX = "swarmavg-join-v1:"
_JOIN_SIGNING_PREFIX = b"swarmavg.v1.join-request\x00"
_MAX_RUN_ID = 128
DEFAULT_AUTHORITY_DAYS = 3650
DEFAULT_CREDENTIAL_DAYS = 90
_CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates start a little in the past


class CredentialError(ValueError):
    """A run file, credential, key or join request is missing, malformed, foreign or expired.

    The message is one line meant for the user, naming the file and what to do.
    """


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write_secret(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 600 (``O_EXCL``: never overwrites, never readable by others)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CredentialError(f"{what} {os.fspath(path)}: {exc.strerror}") from None


# ---- the run file -------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFile:
    """What every peer of a private run is given: the run id and the authority's certificate."""

    run_id: str
    authority_pem: bytes

    @property
    def authority(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.authority_pem)

    def dumps(self) -> str:
        return (
            "# swarmavg run file: give it to every peer of the run; it holds no secret.\n"
            f'format = "{RUN_FILE_FORMAT}"\n'
            f"run_id = {toml_string(self.run_id)}\n"
            f'authority = """\n{self.authority_pem.decode().strip()}\n"""\n'
        )


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (the run files and revocation lists we write)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _check_run_id(run_id: str) -> None:
    if not run_id or len(run_id) > _MAX_RUN_ID or "/" in run_id or not run_id.isprintable():
        raise CredentialError(f"run id {run_id!r}: 1-{_MAX_RUN_ID} printable characters, no '/'")


def read_run_file(path: str | os.PathLike[str]) -> RunFile:
    """Read and check a run file.

    Raises:
        CredentialError: unreadable, not a run file, or its certificate is not a run authority.
    """
    where = f"run file {os.fspath(path)}"
    try:
        data = tomllib.loads(_read(path, "run file").decode("utf-8", "replace"))
    except tomllib.TOMLDecodeError as exc:
        raise CredentialError(f"{where} is not a swarmavg run file: {exc}") from None
    if data.get("format") != RUN_FILE_FORMAT:
        raise CredentialError(f"{where} is not a swarmavg run file (format {RUN_FILE_FORMAT})")
    run_id, authority = data.get("run_id"), data.get("authority")
    if not isinstance(run_id, str) or not isinstance(authority, str):
        raise CredentialError(f"{where}: run_id and authority must be strings")
    _check_run_id(run_id)
    run = RunFile(run_id, authority.strip().encode() + b"\n")
    try:
        certificate = run.authority
    except ValueError as exc:
        raise CredentialError(f"{where}: the authority is not a PEM certificate ({exc})") from None
    if _uri_values(certificate, RUN_URI_PREFIX) != [run_id]:
        raise CredentialError(f"{where}: the authority certificate is not for run {run_id!r}")
    return run


def read_run_id(path: str | os.PathLike[str]) -> str:
    """The run id named by a run file (see :func:`read_run_file` for what is raised)."""
    return read_run_file(path).run_id


# ---- the authority ------------------------------------------------------------------------


def create_authority(run_id: str, days: int = DEFAULT_AUTHORITY_DAYS) -> tuple[bytes, RunFile]:
    """A new run authority: its private key (PEM) and the run file naming its certificate."""
    _check_run_id(run_id)
    if days < 1:
        raise CredentialError("the authority must be valid for at least one day")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"swarmavg run {run_id[:40]}")])
    now = _now()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(RUN_URI_PREFIX + run_id)]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem_key(key), RunFile(run_id, certificate.public_bytes(serialization.Encoding.PEM))


def init_run(
    run_id: str,
    authority_path: str | os.PathLike[str],
    run_path: str | os.PathLike[str],
    days: int = DEFAULT_AUTHORITY_DAYS,
) -> RunFile:
    """Create a run authority: its key at ``authority_path`` (mode 600), the run file at
    ``run_path``. Never overwrites either file.

    Raises:
        CredentialError: bad run id, or a file exists or cannot be written.
    """
    authority_path, run_path = Path(authority_path), Path(run_path)
    for path in (authority_path, run_path):
        if path.exists():
            raise CredentialError(f"{path} exists; refusing to overwrite it")
    key_pem, run = create_authority(run_id, days)
    try:
        _write_secret(authority_path, key_pem)
        fd = os.open(run_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(run.dumps())
    except OSError as exc:
        raise CredentialError(f"cannot write {exc.filename}: {exc.strerror}") from None
    return run


def load_authority_key(path: str | os.PathLike[str]) -> ec.EllipticCurvePrivateKey:
    """Load a run authority's private key (``swarmavg run init``).

    Raises:
        CredentialError: unreadable, or not a PEM EC key.
    """
    data = _read(path, "authority key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise CredentialError(f"authority key {os.fspath(path)}: not a PEM key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialError(f"authority key {os.fspath(path)}: not an EC key")
    return key


def check_authority_key(key: object, run: RunFile) -> ec.EllipticCurvePrivateKey:
    """``key``, once it is known to be the private key of ``run``'s authority.

    Raises:
        CredentialError: another key (another run's authority, or not an authority at all).
    """
    if not isinstance(key, ec.EllipticCurvePrivateKey) or _spki(key.public_key()) != _spki(
        run.authority.public_key()  # type: ignore[arg-type]
    ):
        raise CredentialError(f"the authority key does not belong to run {run.run_id!r}'s run file")
    return key


# ---- a peer's TLS key and its join request ------------------------------------------------


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
            _write_secret(path, _pem_key(key))
            return key
        except FileExistsError:
            pass  # another process created it first: use theirs
        except OSError as exc:
            raise CredentialError(f"cannot write TLS key {path}: {exc.strerror}") from None
    return load_tls_key(path)


def load_tls_key(path: str | os.PathLike[str]) -> ec.EllipticCurvePrivateKey:
    """Load an existing TLS key (see :func:`load_or_create_tls_key`)."""
    data = _read(path, "TLS key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise CredentialError(f"TLS key {os.fspath(path)}: not a PEM key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise CredentialError(f"TLS key {os.fspath(path)}: not a P-256 key")
    return key


def _spki(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


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
        spki = _spki(tls_key.public_key())
        return cls(identity.public_key, spki, identity.sign(cls.signing_payload(spki)))

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


# ---- credentials --------------------------------------------------------------------------


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
    now = _now()
    not_after = min(now + datetime.timedelta(days=days), authority.not_valid_after_utc)
    peer_hex = request.peer_id.hex()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_hex)]))
        .issuer_name(authority.subject)
        .public_key(tls_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
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
    return request.peer_id, issue_credential(_pem_key(key), run, request, days)


def _uri_values(certificate: x509.Certificate, prefix: str) -> list[str]:
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [
        uri[len(prefix) :]
        for uri in names.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.startswith(prefix)
    ]


def peer_id_of_certificate(certificate: x509.Certificate) -> bytes | None:
    """The peer id a credential names (its one ``swarmavg:peer:`` URI), or ``None``."""
    values = _uri_values(certificate, PEER_URI_PREFIX)
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
        certificate = x509.load_pem_x509_certificate(_read(credential_path, "credential"))
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
    now = now or _now()
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
    if _spki(key.public_key()) != _spki(certificate.public_key()):  # type: ignore[arg-type]
        raise CredentialError(
            f"{where} certifies another TLS key than {key_path} (a credential for an older "
            "join request?); send a new join request"
        )
    return PeerCredentials(
        run_id=run.run_id,
        peer_id=peer_id,
        authority_pem=run.authority_pem,
        certificate_pem=certificate.public_bytes(serialization.Encoding.PEM),
        private_key_pem=_pem_key(key),
        not_after=certificate.not_valid_after_utc,
    )
