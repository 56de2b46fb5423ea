"""A private run's authority and invited members for tests (the library calls behind
``swarmavg run init / whoami / invite``; the CLI itself is tested in tests/integration)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarmavg.dht.credentials import (
    JoinRequest,
    init_run,
    invite,
    load_or_create_tls_key,
    load_peer_credentials,
    tls_key_path,
)
from swarmavg.dht.identity import Identity
from swarmavg.dht.tls import PeerTLS


@dataclass(frozen=True)
class Member:
    """An invited peer: its identity file (TLS key beside it) and its credential."""

    name: str
    identity_path: Path
    credential_path: Path
    identity: Identity


@dataclass(frozen=True)
class Authority:
    """A run authority in a folder: ``authority_path`` (secret) and ``run_path`` (public)."""

    run_id: str
    folder: Path
    authority_path: Path
    run_path: Path

    @classmethod
    def create(cls, folder: Path, run_id: str) -> Authority:
        folder.mkdir(parents=True, exist_ok=True)
        authority, run = folder / f"{run_id}.authority.pem", folder / f"{run_id}.run.toml"
        init_run(run_id, authority, run)
        return cls(run_id, folder, authority, run)

    def invite(self, name: str, *, days: int = 30) -> Member:
        """A new identity ``name`` in the folder, its join request, and its credential."""
        identity_path = self.folder / f"{name}.key"
        identity = Identity.load_or_create(identity_path)
        request = JoinRequest.make(identity, load_or_create_tls_key(tls_key_path(identity_path)))
        _, credential = invite(self.authority_path, self.run_path, request.encode(), days)
        credential_path = self.folder / f"{name}.cred.pem"
        credential_path.write_bytes(credential)
        return Member(name, identity_path, credential_path, identity)

    def tls(self, member: Member) -> PeerTLS:
        """``member``'s TLS setup, as its daemon builds it."""
        credentials = load_peer_credentials(
            self.run_path,
            member.credential_path,
            member.identity,
            member.identity_path,
            self.run_id,
        )
        return PeerTLS(credentials)

    def peer_flags(self, member: Member) -> list[str]:
        """The ``swarmavg peer`` flags of ``member`` in this run."""
        return [
            "--run-file",
            str(self.run_path),
            "--credential",
            str(member.credential_path),
            "--identity",
            str(member.identity_path),
        ]
