"""A private run's credentials (dht/credentials.py): what is issued, and every refusal."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import pytest
from cryptography import x509

from swarmavg.dht.credentials import (
    PEER_URI_PREFIX,
    TLS_SERVER_NAME,
    CredentialError,
    JoinRequest,
    load_or_create_tls_key,
    load_peer_credentials,
    peer_id_of_certificate,
    read_run_file,
    tls_key_path,
)
from swarmavg.dht.identity import Identity
from tests.private_runs import Authority

pytestmark = pytest.mark.timeout(30)


def test_init_writes_a_secret_key_and_a_public_run_file(tmp_path: Path) -> None:
    run = Authority.create(tmp_path, "my-run")
    assert stat.S_IMODE(run.authority_path.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in run.authority_path.read_bytes()
    text = run.run_path.read_text()
    assert "PRIVATE" not in text
    parsed = read_run_file(run.run_path)
    assert parsed.run_id == "my-run"
    assert parsed.authority.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    with pytest.raises(CredentialError, match="refusing to overwrite"):
        Authority.create(tmp_path, "my-run")


def test_a_credential_names_the_peer_id_and_certifies_its_tls_key(tmp_path: Path) -> None:
    run = Authority.create(tmp_path, "r")
    member = run.invite("alice")
    certificate = x509.load_pem_x509_certificate(member.credential_path.read_bytes())
    assert peer_id_of_certificate(certificate) == member.identity.peer_id
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    # The shared name (for clients that do not know whom they dial) and the peer's own.
    assert names.get_values_for_type(x509.DNSName) == [
        TLS_SERVER_NAME,
        f"{member.identity.peer_id_hex}.{TLS_SERVER_NAME}",
    ]
    assert PEER_URI_PREFIX + member.identity.peer_id_hex in names.get_values_for_type(
        x509.UniformResourceIdentifier
    )
    certificate.verify_directly_issued_by(read_run_file(run.run_path).authority)
    key_path = tls_key_path(member.identity_path)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    credentials = load_peer_credentials(
        run.run_path, member.credential_path, member.identity, member.identity_path, "r"
    )
    assert credentials.peer_id == member.identity.peer_id
    assert credentials.run_id == "r"


def test_a_join_request_round_trips_and_a_tampered_one_is_refused(tmp_path: Path) -> None:
    identity = Identity.generate()
    key = load_or_create_tls_key(tmp_path / "k.tls.pem")
    line = JoinRequest.make(identity, key).encode()
    assert JoinRequest.decode(line).peer_id == identity.peer_id
    # Someone else's identity key with my TLS key: the signature gives it away.
    other = Identity.generate()
    forged = JoinRequest(other.public_key, JoinRequest.decode(line).tls_public_key, b"\0" * 64)
    with pytest.raises(CredentialError, match="signature does not verify"):
        JoinRequest.decode(forged.encode())
    with pytest.raises(CredentialError, match="not a join request"):
        JoinRequest.decode("hello")
    with pytest.raises(CredentialError, match="wrong length"):
        JoinRequest.decode(line[:40])


def test_a_credential_of_another_run_is_refused(tmp_path: Path) -> None:
    ours = Authority.create(tmp_path / "ours", "r")
    theirs = Authority.create(tmp_path / "theirs", "r")  # same name, another authority
    member = theirs.invite("mallory")
    with pytest.raises(CredentialError, match="not issued by the authority of run 'r'"):
        load_peer_credentials(
            ours.run_path, member.credential_path, member.identity, member.identity_path, "r"
        )


def test_a_credential_used_with_another_identity_is_refused(tmp_path: Path) -> None:
    run = Authority.create(tmp_path, "r")
    alice, bob = run.invite("alice"), run.invite("bob")
    with pytest.raises(CredentialError, match=f"issued to peer {alice.identity.peer_id_hex}"):
        load_peer_credentials(
            run.run_path, alice.credential_path, bob.identity, bob.identity_path, "r"
        )


def test_an_expired_credential_is_refused(tmp_path: Path) -> None:
    run = Authority.create(tmp_path, "r")
    member = run.invite("alice", days=1)
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=2)
    with pytest.raises(CredentialError, match=r"expired on .* ask the organiser"):
        load_peer_credentials(
            run.run_path, member.credential_path, member.identity, member.identity_path, "r", later
        )


def test_the_wrong_run_file_or_tls_key_is_refused(tmp_path: Path) -> None:
    run = Authority.create(tmp_path, "r")
    member = run.invite("alice")
    with pytest.raises(CredentialError, match="is for run 'r', but this peer is set to run 'x'"):
        load_peer_credentials(
            run.run_path, member.credential_path, member.identity, member.identity_path, "x"
        )
    with pytest.raises(CredentialError, match="not a swarmavg run file"):
        load_peer_credentials(
            member.credential_path,
            member.credential_path,
            member.identity,
            member.identity_path,
            "r",
        )
    tls_key_path(member.identity_path).unlink()
    load_or_create_tls_key(tls_key_path(member.identity_path))  # a new key, not the certified one
    with pytest.raises(CredentialError, match="certifies another TLS key"):
        load_peer_credentials(
            run.run_path, member.credential_path, member.identity, member.identity_path, "r"
        )
