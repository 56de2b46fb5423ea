"""A private run's revocation list: the peer ids its organiser has shut out.

A credential admits its peer until it expires (dht/credentials.py). To shut an invited peer
out earlier, the organiser signs a **revocation list** with the run authority's key
(``swarmavg run revoke``): the run id, a number that grows with every new list, when it was
issued, and the revoked peer ids. Every peer that holds it refuses those peers on every path
(dht/tls.py, the data plane, its routing table), and spreads it through the run's DHT under
:func:`revocation_key` (dht/revocation_keeper.py), so handing the file to one peer reaches all.

Why not an X.509 CRL: a CRL names certificate serial numbers, while the organiser revokes a
*peer* (the peer id its credentials name; a peer may hold several credentials after a new
invite), and the data plane and the gRPC interceptor already know the peer id of every
connection. The signature is ECDSA P-256 with SHA-256 by ``cryptography``, over a
domain-separated, fixed-order msgpack encoding (:meth:`RevocationList.signing_payload`);
nothing here is home-made cryptography.

A list is believed only when it verifies against the run's authority and names the run
(:meth:`RevocationList.verify`); a peer adopts one only when its number is higher than the
list it holds (:meth:`Revocations.adopt`), so nobody can roll a peer back to an older list.

The file is TOML, readable by people::

    format = "swarmavg-revocations/1"
    run_id = "my-run"
    number = 2
    issued = 1767225600            # seconds since the epoch (UTC)
    revoked = ["3fa1...", "9b2e..."]
    signature = "MEUCIQ..."        # base64 of the DER ECDSA signature
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from swarmavg.dht.credentials import (
    CredentialError,
    RunFile,
    check_authority_key,
    load_authority_key,
    peer_id_of_certificate,
    read_run_file,
    toml_string,
)
from swarmavg.dht.identity import PEER_ID_BYTES
from swarmavg.dht.records import Subkey
from swarmavg.dht.validation import KeyClass

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REVOCATION_FORMAT = "swarmavg-revocations/1"
_SIGNING_PREFIX = b"swarmavg.v1.revocation-list\x00"
MAX_REVOKED = 2048
"""Most peer ids one list may name: its DHT value (about 22 bytes per id) then stays well
under the DHT's 64 KiB value cap (dht/validation.py, ``DHTLimits.max_value_bytes``)."""
_MAX_SIGNATURE = 80  # a DER ECDSA P-256 signature has 70-72 bytes
_MAX_FILE_BYTES = 256 * 1024
_VERIFIED_LISTS = 16  # lists remembered as verified (a run has a handful in flight at most)
REVOCATION_KEY_MAX_TTL = 3600.0
"""Seconds a copy of the list may claim to live in the DHT; holders refresh theirs."""


class RevocationError(CredentialError):
    """A revocation list is malformed, not signed by the run's authority, of another run, or
    older than the one held. The message is one line meant for the user."""


def revocation_key(run_id: str) -> str:
    """The DHT key under which the peers of ``run_id`` keep the run's revocation list."""
    return f"{run_id}.revocations"


@dataclass(frozen=True)
class RevocationList:
    """One signed revocation list.

    Attributes:
        run_id: the run it applies to.
        number: grows by one with every list the organiser issues; a peer adopts only a
            higher number than it holds.
        issued: when it was signed (seconds since the epoch).
        peer_ids: the revoked peer ids.
        signature: the authority's ECDSA signature (DER) over :meth:`signing_payload`.
    """

    run_id: str
    number: int
    issued: int
    peer_ids: frozenset[bytes]
    signature: bytes = b""

    def signing_payload(self) -> bytes:
        """What the signature covers: a domain tag, then the fields in a fixed order (msgpack,
        peer ids sorted), so equal lists always give the same bytes."""
        fields = [self.run_id, self.number, self.issued, sorted(self.peer_ids)]
        encoded: bytes = msgpack.packb(fields, use_bin_type=True)
        return _SIGNING_PREFIX + encoded

    @classmethod
    def sign(
        cls,
        key: ec.EllipticCurvePrivateKey,
        run_id: str,
        number: int,
        peer_ids: Iterable[bytes],
        issued: int | None = None,
    ) -> RevocationList:
        """A list signed by ``key`` (check it is the run's authority first)."""
        when = int(time.time()) if issued is None else issued
        unsigned = cls(run_id, number, when, frozenset(peer_ids))
        unsigned.check_fields()
        signature = key.sign(unsigned.signing_payload(), ec.ECDSA(hashes.SHA256()))
        return cls(unsigned.run_id, number, unsigned.issued, unsigned.peer_ids, signature)

    def check_fields(self) -> None:
        """Raise :class:`RevocationError` unless every field is in range."""
        if not isinstance(self.run_id, str) or not self.run_id:
            raise RevocationError("a revocation list must name its run")
        for name, value in (("number", self.number), ("issued", self.issued)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**53:
                raise RevocationError(f"a revocation list's {name} must be a positive integer")
        if len(self.peer_ids) > MAX_REVOKED:
            raise RevocationError(f"a revocation list names at most {MAX_REVOKED} peers")
        if any(not isinstance(p, bytes) or len(p) != PEER_ID_BYTES for p in self.peer_ids):
            raise RevocationError("a revocation list names a malformed peer id")
        if len(self.signature) > _MAX_SIGNATURE:
            raise RevocationError("a revocation list's signature is too long")

    def verify(self, authority: x509.Certificate, run_id: str) -> None:
        """Check that the list names ``run_id`` and that ``authority`` (the run's CA) signed it.

        Raises:
            RevocationError: which check failed.
        """
        self.check_fields()
        if self.run_id != run_id:
            raise RevocationError(
                f"it is a revocation list of run {self.run_id!r}, not of run {run_id!r}"
            )
        key = authority.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise RevocationError("the run's authority has no EC key")
        try:
            key.verify(self.signature, self.signing_payload(), ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            raise RevocationError(
                f"it was not signed by the authority of run {run_id!r} (forged, altered, or "
                "made with another run's authority key)"
            ) from None

    # ---- the DHT form (msgpack-able) ----

    def to_value(self) -> list[Any]:
        """The list as a DHT value."""
        return [self.run_id, self.number, self.issued, sorted(self.peer_ids), self.signature]

    @classmethod
    def from_value(cls, value: Any) -> RevocationList:
        """Parse a DHT value (untrusted: anything may arrive). Does not verify it.

        Raises:
            RevocationError: not a revocation list.
        """
        if not isinstance(value, list | tuple) or len(value) != 5:
            raise RevocationError("not a revocation list")
        run_id, number, issued, peer_ids, signature = value
        if not isinstance(peer_ids, list | tuple) or not isinstance(signature, bytes):
            raise RevocationError("not a revocation list")
        if len(peer_ids) > MAX_REVOKED:
            raise RevocationError(f"a revocation list names at most {MAX_REVOKED} peers")
        result = cls(run_id, number, issued, frozenset(peer_ids), signature)
        if len(result.peer_ids) != len(peer_ids):
            raise RevocationError("a revocation list names a peer twice")
        result.check_fields()
        return result

    # ---- the file form (TOML) ----

    def dumps(self) -> str:
        """The list as a file (see the module docstring)."""
        when = datetime.datetime.fromtimestamp(self.issued, datetime.timezone.utc)
        revoked = "".join(f'  "{p.hex()}",\n' for p in sorted(self.peer_ids))
        return (
            f"# swarmavg revocation list of run {self.run_id!r} (swarmavg run revoke): give it\n"
            "# to any peer of the run (swarmavg peer --revocations FILE); it holds no secret.\n"
            f'format = "{REVOCATION_FORMAT}"\n'
            f"run_id = {toml_string(self.run_id)}\n"
            f"number = {self.number}\n"
            f"issued = {self.issued}  # {when:%Y-%m-%d %H:%M:%S} UTC\n"
            f"revoked = [\n{revoked}]\n"
            f'signature = "{base64.b64encode(self.signature).decode()}"\n'
        )

    @classmethod
    def loads(cls, text: str, where: str) -> RevocationList:
        """Parse a file's text (``where`` names it in errors). Does not verify it.

        Raises:
            RevocationError: not a revocation list file.
        """
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RevocationError(f"{where} is not a swarmavg revocation list: {exc}") from None
        if data.get("format") != REVOCATION_FORMAT:
            raise RevocationError(
                f"{where} is not a swarmavg revocation list (format {REVOCATION_FORMAT})"
            )
        revoked, signature = data.get("revoked"), data.get("signature")
        if not isinstance(revoked, list) or not isinstance(signature, str):
            raise RevocationError(f"{where}: revoked must be a list and signature a string")
        try:
            peer_ids = [parse_peer_id(p) for p in revoked]
            raw_signature = base64.b64decode(signature, validate=True)
        except (RevocationError, ValueError) as exc:
            raise RevocationError(f"{where}: {exc}") from None
        try:
            fields = [data.get(name) for name in ("run_id", "number", "issued")]
            return cls.from_value([*fields, peer_ids, raw_signature])
        except RevocationError as exc:
            raise RevocationError(f"{where}: {exc}") from None


_HEX_ID = re.compile(f"[0-9a-fA-F]{{{2 * PEER_ID_BYTES}}}")


def parse_peer_id(text: object) -> bytes:
    """A peer id from its hex form.

    Raises:
        RevocationError: not 40 hex digits.
    """
    if not isinstance(text, str) or not _HEX_ID.fullmatch(text.strip()):
        raise RevocationError(f"{text!r} is not a peer id ({2 * PEER_ID_BYTES} hex digits)")
    return bytes.fromhex(text.strip())


def peer_id_of_argument(argument: str) -> bytes:
    """The peer id ``swarmavg run revoke`` is given: hex, or a credential file naming it.

    Raises:
        RevocationError: neither a peer id nor a readable credential.
    """
    if _HEX_ID.fullmatch(argument.strip()):
        return bytes.fromhex(argument.strip())
    path = Path(argument)
    if not path.is_file():
        raise RevocationError(
            f"{argument!r} is neither a peer id ({2 * PEER_ID_BYTES} hex digits) nor a "
            "credential file"
        )
    try:
        certificate = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        raise RevocationError(f"{argument} is not a credential (a PEM certificate)") from None
    peer_id = peer_id_of_certificate(certificate)
    if peer_id is None:
        raise RevocationError(f"credential {argument} names no peer id")
    return peer_id


def read_revocations(path: str | os.PathLike[str], run: RunFile) -> RevocationList:
    """Read a revocation list file and verify it against ``run``.

    Raises:
        RevocationError: unreadable, malformed, of another run, or not signed by its authority.
    """
    where = f"revocation list {os.fspath(path)}"
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise RevocationError(f"{where}: {exc.strerror}") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise RevocationError(f"{where} is larger than {_MAX_FILE_BYTES} bytes")
    revocations = RevocationList.loads(raw.decode("utf-8", "replace"), where)
    try:
        revocations.verify(run.authority, run.run_id)
    except RevocationError as exc:
        raise RevocationError(f"{where}: {exc}") from None
    return revocations


def default_revocations_path(run_path: str | os.PathLike[str]) -> Path:
    """Where ``swarmavg run revoke`` writes by default: beside the run file,
    ``my-run.run.toml`` -> ``my-run.revoked``."""
    run_path = Path(run_path)
    stem = run_path.name.removesuffix(".toml").removesuffix(".run")
    return run_path.with_name(f"{stem}.revoked")


def revoke(
    authority_path: str | os.PathLike[str],
    run_path: str | os.PathLike[str],
    peers: Iterable[str],
    out_path: str | os.PathLike[str],
) -> RevocationList:
    """``swarmavg run revoke``: write (or extend) the revocation list at ``out_path``.

    An existing list there keeps its peers; the new one has its number + 1. The file is
    replaced atomically (a peer watching it never reads half of it).

    Raises:
        RevocationError: a bad peer argument, a foreign authority key, or an existing file
            that is not a list of this run (the message says which).
    """
    run = read_run_file(run_path)
    key = check_authority_key(load_authority_key(authority_path), run)
    peer_ids = {peer_id_of_argument(argument) for argument in peers}
    number = 1
    out_path = Path(out_path)
    if out_path.exists():
        previous = read_revocations(out_path, run)
        peer_ids |= previous.peer_ids
        number = previous.number + 1
    revocations = RevocationList.sign(key, run.run_id, number, peer_ids)
    temporary = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(revocations.dumps())
        os.replace(temporary, out_path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise RevocationError(f"cannot write {out_path}: {exc.strerror}") from None
    return revocations


# ---- what a peer enforces -----------------------------------------------------------------


class Revocations:
    """The revocation list one peer enforces, and the set of peer ids it refuses.

    ``peer_id in revocations`` is a set lookup (the gRPC interceptor and the data plane ask it
    on every call or stream). The held list only moves forward: :meth:`adopt` takes a list
    that verifies against the run's authority and has a higher number.
    """

    def __init__(self, run_id: str, authority_pem: bytes) -> None:
        self.run_id = run_id
        self._authority = x509.load_pem_x509_certificate(authority_pem)
        self.current: RevocationList | None = None
        self.revoked: frozenset[bytes] = frozenset()
        self._listeners: list[Callable[[RevocationList], None]] = []
        # Every holder stores its own copy of the same list under the run's key, so a read
        # returns one copy per holder: remember the lists that verified (by their signed
        # bytes), and each one costs one ECDSA verification, not one per copy.
        self._verified: dict[bytes, None] = {}

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.revoked

    @property
    def number(self) -> int:
        """The held list's number (0: none)."""
        return 0 if self.current is None else self.current.number

    def verify(self, revocations: RevocationList) -> None:
        """Raise :class:`RevocationError` unless ``revocations`` is this run's, signed by its
        authority."""
        seen = hashlib.sha256(revocations.signing_payload() + revocations.signature).digest()
        if seen in self._verified:
            return
        revocations.verify(self._authority, self.run_id)
        self._verified[seen] = None
        while len(self._verified) > _VERIFIED_LISTS:
            del self._verified[next(iter(self._verified))]

    def adopt(self, revocations: RevocationList) -> bool:
        """Hold ``revocations`` if it verifies and is newer than the held list.

        Returns:
            Whether it was adopted (False: not newer).

        Raises:
            RevocationError: it does not verify.
        """
        if revocations.number <= self.number:
            return False  # checked first: an old list costs no signature check
        self.verify(revocations)
        self.current = revocations
        self.revoked = revocations.peer_ids
        for listener in self._listeners:
            listener(revocations)
        return True

    def on_change(self, listener: Callable[[RevocationList], None]) -> None:
        """Call ``listener`` with every list adopted from now on."""
        self._listeners.append(listener)

    def key_class(self) -> KeyClass:
        """The DHT key class of :func:`revocation_key`: owner-signed entries (each holder
        writes its own copy, so nobody can wipe or replace another's) whose value is a list
        of this run signed by its authority. Storing nodes and readers refuse anything else."""

        def check(subkey: Subkey, owner: bytes, value: Any) -> bool:
            self.verify(RevocationList.from_value(value))
            return True

        return KeyClass(
            "revocation lists",
            re.compile(re.escape(revocation_key(self.run_id).encode())),
            check,
            REVOCATION_KEY_MAX_TTL,
        )
