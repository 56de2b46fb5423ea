"""Identity: key files, peer ids, signatures and header checks."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from swarmavg.dht.identity import (
    PROTOCOL_VERSION,
    HeaderError,
    Identity,
    address_signature_payload,
    verify_header,
    verify_signature,
)


def test_load_or_create_is_stable_and_private(tmp_path: Path) -> None:
    path = tmp_path / "id.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    second = Identity.load_or_create(path)
    assert first.peer_id == second.peer_id
    assert len(first.peer_id) == 20
    assert first.peer_id == hashlib.sha1(first.public_key).digest()
    assert first.peer_id_hex == first.peer_id.hex()
    assert Identity.generate().peer_id != first.peer_id


def test_load_rejects_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "id.key"
    path.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="not a swarmavg identity"):
        Identity.load_or_create(path)


def test_sign_verify() -> None:
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"payload")
    assert a.verify(sig, b"payload")
    assert not a.verify(sig, b"payloaD")
    assert not b.verify(sig, b"payload")
    assert not verify_signature(a.public_key, sig[:10], b"payload")
    assert not verify_signature(b"\x00" * 5, sig, b"payload")


def test_signatures_interoperate_with_openssls_ed25519(tmp_path: Path) -> None:
    """Signing and checking moved from OpenSSL to libsodium: both are RFC 8032's deterministic
    Ed25519, so a peer of either version verifies the other's messages and records."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = bytes(range(32))
    path = tmp_path / "id.key"
    path.write_bytes(seed)
    path.chmod(0o600)  # a key file others may read is refused
    ours = Identity.load_or_create(path)
    openssl = Ed25519PrivateKey.from_private_bytes(seed)
    for payload in (b"", b"payload", bytes(range(256)) * 40):
        assert ours.sign(payload) == openssl.sign(payload)
        assert verify_signature(ours.public_key, openssl.sign(payload), payload)
        openssl.public_key().verify(ours.sign(payload), payload)  # raises if invalid


def test_malformed_keys_and_signatures_are_false_not_errors() -> None:
    a = Identity.generate()
    sig = a.sign(b"payload")
    # The identity point as a key: (R = identity, S = 0) "signs" every message for it, and
    # OpenSSL accepted that; libsodium refuses small-order keys.
    identity_point = bytes([1]) + bytes(31)
    assert not verify_signature(identity_point, identity_point + bytes(32), b"payload")
    assert not verify_signature(bytes([0xFF]) * 32, sig, b"payload")  # not a point
    assert not verify_signature(a.public_key, bytes([0xFF]) * 64, b"payload")  # S >= L
    assert not verify_signature(a.public_key, sig + b"x", b"payload")


def test_verify_header_accepts_and_rejects() -> None:
    ident = Identity.generate()
    header = ident.make_header("run", "127.0.0.1:1")
    assert verify_header(header, "run") == ident.peer_id

    with pytest.raises(HeaderError, match="run id differs") as info:
        verify_header(header, "other-run")
    assert "other-run" not in str(info.value)
    bad_version = ident.make_header("run")
    bad_version.protocol_version = PROTOCOL_VERSION + 1
    with pytest.raises(HeaderError, match="protocol version"):
        verify_header(bad_version, "run")
    spoofed = ident.make_header("run")
    spoofed.peer_id = Identity.generate().peer_id
    with pytest.raises(HeaderError, match="does not match"):
        verify_header(spoofed, "run")
    short = ident.make_header("run")
    short.public_key = b"\x01" * 31
    with pytest.raises(HeaderError, match="public key"):
        verify_header(short, "run")


def test_address_payload_binds_every_field() -> None:
    ident = Identity.generate()
    base = address_signature_payload("r", ident.peer_id, "1.2.3.4:5")
    assert base != address_signature_payload("r2", ident.peer_id, "1.2.3.4:5")
    assert base != address_signature_payload("r", ident.peer_id, "1.2.3.4:6")
    assert base != address_signature_payload("r", Identity.generate().peer_id, "1.2.3.4:5")
