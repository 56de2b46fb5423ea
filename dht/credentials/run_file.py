"""A private run's run file: the run id and its authority's certificate, in TOML. It holds no
secret; every peer of the run gets it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from cryptography import x509

from swarmavg.dht.credentials.basics import (
    RUN_FILE_FORMAT,
    RUN_URI_PREFIX,
    CredentialError,
    read_file,
    uri_values,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MAX_RUN_ID = 128
"""Characters a run id may have at most."""


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


def check_run_id(run_id: str) -> None:
    """Raise a :class:`CredentialError` unless ``run_id`` can name a run."""
    if not run_id or len(run_id) > MAX_RUN_ID or "/" in run_id or not run_id.isprintable():
        raise CredentialError(f"run id {run_id!r}: 1-{MAX_RUN_ID} printable characters, no '/'")


def read_run_file(path: str | os.PathLike[str]) -> RunFile:
    """Read and check a run file.

    Raises:
        CredentialError: unreadable, not a run file, or its certificate is not a run authority.
    """
    where = f"run file {os.fspath(path)}"
    try:
        data = tomllib.loads(read_file(path, "run file").decode("utf-8", "replace"))
    except tomllib.TOMLDecodeError as exc:
        raise CredentialError(f"{where} is not a swarmavg run file: {exc}") from None
    if data.get("format") != RUN_FILE_FORMAT:
        raise CredentialError(f"{where} is not a swarmavg run file (format {RUN_FILE_FORMAT})")
    run_id, authority = data.get("run_id"), data.get("authority")
    if not isinstance(run_id, str) or not isinstance(authority, str):
        raise CredentialError(f"{where}: run_id and authority must be strings")
    check_run_id(run_id)
    run = RunFile(run_id, authority.strip().encode() + b"\n")
    try:
        certificate = run.authority
    except ValueError as exc:
        raise CredentialError(f"{where}: the authority is not a PEM certificate ({exc})") from None
    if uri_values(certificate, RUN_URI_PREFIX) != [run_id]:
        raise CredentialError(f"{where}: the authority certificate is not for run {run_id!r}")
    return run


def read_run_id(path: str | os.PathLike[str]) -> str:
    """The run id named by a run file (see :func:`read_run_file` for what is raised)."""
    return read_run_file(path).run_id
