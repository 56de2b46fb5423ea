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
  the organiser only (:mod:`.authority`);
- the run file: TOML with the run id and the authority's CA certificate; no secret, every peer
  gets it (:mod:`.run_file`);
- a credential (``swarmavg run invite``): the peer's certificate, PEM (:mod:`.issued`), made
  from the invitee's join request (:mod:`.join_request`).

What the four share (the error, the names a certificate carries, PEM keys and files) is
:mod:`.basics`.
"""

from swarmavg.dht.credentials.authority import (
    check_authority_key,
    create_authority,
    init_run,
    load_authority_key,
)
from swarmavg.dht.credentials.basics import (
    DEFAULT_AUTHORITY_DAYS,
    DEFAULT_CREDENTIAL_DAYS,
    PEER_URI_PREFIX,
    RUN_FILE_FORMAT,
    RUN_URI_PREFIX,
    TLS_SERVER_NAME,
    CredentialError,
    peer_server_name,
)
from swarmavg.dht.credentials.issued import (
    PeerCredentials,
    invite,
    issue_credential,
    load_peer_credentials,
    peer_id_of_certificate,
)
from swarmavg.dht.credentials.join_request import (
    JOIN_REQUEST_PREFIX,
    JoinRequest,
    load_or_create_tls_key,
    load_tls_key,
    tls_key_path,
)
from swarmavg.dht.credentials.run_file import RunFile, read_run_file, read_run_id, toml_string

__all__ = [
    "DEFAULT_AUTHORITY_DAYS",
    "DEFAULT_CREDENTIAL_DAYS",
    "JOIN_REQUEST_PREFIX",
    "PEER_URI_PREFIX",
    "RUN_FILE_FORMAT",
    "RUN_URI_PREFIX",
    "TLS_SERVER_NAME",
    "CredentialError",
    "JoinRequest",
    "PeerCredentials",
    "RunFile",
    "check_authority_key",
    "create_authority",
    "init_run",
    "invite",
    "issue_credential",
    "load_authority_key",
    "load_or_create_tls_key",
    "load_peer_credentials",
    "load_tls_key",
    "peer_id_of_certificate",
    "peer_server_name",
    "read_run_file",
    "read_run_id",
    "tls_key_path",
    "toml_string",
]
