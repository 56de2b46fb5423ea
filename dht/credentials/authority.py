"""A private run's authority: the CA key the organiser keeps (``swarmavg run init``) and
the checks that a key is the run's."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarmavg.dht.credentials.basics import (
    CLOCK_SKEW,
    DEFAULT_AUTHORITY_DAYS,
    RUN_URI_PREFIX,
    CredentialError,
    pem_key,
    read_file,
    spki,
    utc_now,
    write_secret,
)
from swarmavg.dht.credentials.run_file import RunFile, check_run_id


def create_authority(run_id: str, days: int = DEFAULT_AUTHORITY_DAYS) -> tuple[bytes, RunFile]:
    """A new run authority: its private key (PEM) and the run file naming its certificate."""
    check_run_id(run_id)
    if days < 1:
        raise CredentialError("the authority must be valid for at least one day")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"swarmavg run {run_id[:40]}")])
    now = utc_now()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
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
    return pem_key(key), RunFile(run_id, certificate.public_bytes(serialization.Encoding.PEM))


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
        write_secret(authority_path, key_pem)
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
    data = read_file(path, "authority key")
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
    if not isinstance(key, ec.EllipticCurvePrivateKey) or spki(key.public_key()) != spki(
        run.authority.public_key()  # type: ignore[arg-type]
    ):
        raise CredentialError(f"the authority key does not belong to run {run.run_id!r}'s run file")
    return key
