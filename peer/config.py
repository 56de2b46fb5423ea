"""``PeerConfig``: the daemon's settings, and how flags, env vars and TOML map onto it.

Precedence (docs/peer.md): command-line flag > ``SWARMAVG_*`` env var > TOML file > default.
Every field has all three spellings: field ``run_id`` is flag ``--run-id``, env var
``SWARMAVG_RUN_ID`` and TOML key ``run_id`` (a top-level key, or under a ``[peer]`` table).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_LISTEN = "0.0.0.0:31337"
ENV_PREFIX = "SWARMAVG_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass
class PeerConfig:
    """Settings of one ``swarmavg peer`` daemon.

    Attributes:
        listen: ``HOST:PORT`` the public gRPC server binds; port 0 picks a free port.
        announce: ``HOST:PORT`` other peers should dial; ``None``: derived from ``listen``.
        data_port: TCP port of the data plane (all-reduce streams over plain TCP, on the
            listen host; the announced host is advertised with it): 0 picks a free port,
            -1 turns it off (all-reduce streams then use the gRPC port only).
        join: initial peers (``HOST:PORT``); empty starts a new swarm.
        run_id: the collaboration's name; everything stored or averaged is namespaced by it.
        control: control endpoint (unix socket path or ``127.0.0.1:PORT``); ``None``: the
            default socket for ``run_id``.
        client_mode: accept no incoming connections (behind NAT or a firewall).
        identity: file holding the Ed25519 key; ``None``: a fresh identity per start.
        metrics: ``HOST:PORT`` for the Prometheus endpoint; ``None``: no metrics server.
        log_level: Python logging level name.
        group_size: the default target group size when a caller passes ``None``.
        local_window: the longest a round waits for the other local training processes
            (those seen recently) to call with the same key before the daemon contributes
            their combined tensors; a lone process never waits.
        shutdown_grace: seconds the first SIGINT/SIGTERM gives rounds in flight.
        bootstrap_timeout: seconds to keep retrying the initial peers before giving up.
    """

    listen: str = DEFAULT_LISTEN
    announce: str | None = None
    data_port: int = 0
    join: list[str] = field(default_factory=list)
    run_id: str = "default"
    control: str | None = None
    client_mode: bool = False
    identity: str | None = None
    metrics: str | None = None
    log_level: str = "INFO"
    group_size: int = 16
    local_window: float = 0.5
    shutdown_grace: float = 2.0
    bootstrap_timeout: float = 30.0

    def __post_init__(self) -> None:
        self.join = split_addresses(self.join)
        self.log_level = self.log_level.upper()
        self.validate()

    def validate(self) -> None:
        """Check every field; raise ``ValueError`` naming the bad one."""
        parse_host_port(self.listen, "listen", allow_port_zero=True)
        if self.announce is not None:
            parse_host_port(self.announce, "announce")
        if not -1 <= self.data_port <= 65535:
            raise ValueError(f"data_port {self.data_port}: a TCP port, 0 (any free) or -1 (off)")
        for address in self.join:
            parse_host_port(address, "join")
        if self.metrics is not None:
            parse_host_port(self.metrics, "metrics", allow_port_zero=True)
        if not self.run_id or len(self.run_id) > 128 or "/" in self.run_id:
            raise ValueError(f"run_id {self.run_id!r}: 1-128 characters, no '/'")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level {self.log_level!r}: one of {', '.join(LOG_LEVELS)}")
        if not 2 <= self.group_size <= 256:
            raise ValueError(f"group_size {self.group_size}: between 2 and 256")
        if not 0 <= self.local_window <= 10:
            raise ValueError(f"local_window {self.local_window}: between 0 and 10 seconds")
        if not 0 < self.bootstrap_timeout <= 3600:
            raise ValueError(f"bootstrap_timeout {self.bootstrap_timeout}: (0, 3600] seconds")
        if not 0 <= self.shutdown_grace <= 60:
            raise ValueError(f"shutdown_grace {self.shutdown_grace}: between 0 and 60 seconds")


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PeerConfig))


def flag_name(field_name: str) -> str:
    """``run_id`` -> ``--run-id``."""
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    """``run_id`` -> ``SWARMAVG_RUN_ID``."""
    return ENV_PREFIX + field_name.upper()


def parse_host_port(text: str, what: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` too); raise ``ValueError`` naming ``what``."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{what} {text!r}: expected HOST:PORT")
    port = int(port_text)
    if port > 65535 or (port == 0 and not allow_port_zero):
        raise ValueError(f"{what} {text!r}: port out of range")
    return host.strip("[]"), port


def split_addresses(values: str | list[str] | tuple[str, ...]) -> list[str]:
    """Flatten repeated and comma-separated addresses, dropping blanks and duplicates."""
    items = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return out


def _parse_bool(text: str, name: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"{name}={text!r}: expected true/false")


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert a raw env/TOML value to the type of field ``name``."""
    default = PeerConfig.__dataclass_fields__[name]
    kind = default.type if isinstance(default.type, str) else str(default.type)
    where = f"{source} {name}"
    if name == "join":
        if isinstance(value, str | list | tuple):
            return split_addresses(value)
        raise ValueError(f"{where}: expected a list of HOST:PORT")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            return _parse_bool(value, where)
        raise ValueError(f"{where}: expected true/false")
    if kind == "int":
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}={value!r}: expected an integer") from None
    if kind == "float":
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}={value!r}: expected a number") from None
    if not isinstance(value, str):
        raise ValueError(f"{where}={value!r}: expected a string")
    return value


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML config file: top-level keys, or keys under a ``[peer]`` table.

    Raises:
        ValueError: unreadable or malformed file, or an unknown key.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"config file {os.fspath(path)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {os.fspath(path)!r}: {exc}") from None
    table = data.get("peer", data)
    if not isinstance(table, dict):
        raise ValueError(f"config file {os.fspath(path)!r}: [peer] must be a table")
    unknown = sorted(set(table) - set(FIELDS) - {"peer"})
    if unknown:
        raise ValueError(
            f"config file {os.fspath(path)!r}: unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(FIELDS)}"
        )
    return {k: _coerce(k, v, "config file key") for k, v in table.items() if k in FIELDS}


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``SWARMAVG_*`` variables that name a config field (blank ones are ignored)."""
    out: dict[str, Any] = {}
    for name in FIELDS:
        raw = environ.get(env_name(name))
        if raw is not None and raw.strip() != "":
            out[name] = _coerce(name, raw, "env var " + ENV_PREFIX)
    return out


def resolve_config(
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> PeerConfig:
    """Merge the sources: flag > env > file > default.

    Args:
        flags: field -> value for the flags the user actually gave (``None`` = not given;
            for ``join`` an empty list = not given).
        environ: environment (default ``os.environ``); ``SWARMAVG_CONFIG`` names the
            TOML file when ``config_file`` is ``None``.
        config_file: the ``--config`` file.

    Raises:
        ValueError: a bad value in any source, or an unknown config-file key.
    """
    env = os.environ if environ is None else environ
    path = config_file if config_file is not None else env.get(ENV_PREFIX + "CONFIG") or None
    merged: dict[str, Any] = {}
    if path is not None:
        merged.update(read_toml(Path(path)))
    merged.update(read_env(env))
    for name, value in flags.items():
        if name not in FIELDS:
            raise ValueError(f"unknown setting {name!r}")
        if value is None or (name == "join" and not value) or (value is False):
            continue
        merged[name] = value
    return PeerConfig(**merged)
