"""Where each setting of ``PeerConfig`` comes from: a flag, an env var, a TOML key.

Precedence (docs/peer.md): command-line flag > ``SWARMAVG_*`` env var > TOML file > default,
decided per setting. Every user-facing setting has one name, unique across the tree, and
all three spellings follow from it and from its section: setting ``bandwidth`` of
``[averaging]`` is flag ``--bandwidth``, env var ``SWARMAVG_BANDWIDTH`` and TOML key
``bandwidth`` under ``[averaging]``. Flags and env vars are flat (their names are unique);
the TOML file has the sections.

The TOML file, as older files keep working:

- ``[peer]`` keys may also be written at the top level, without the table (the flat form
  files had before sections existed); both together are merged.
- ``group_size``, ``data_port`` and ``bootstrap_timeout`` lived in ``[peer]`` before they
  moved to their sections, and are still accepted there (and at the top level) with the
  same meaning.
- An unknown section, an unknown key, a key in the wrong section or one setting given
  twice is an error that names it: a typo never passes silently.

The settings that no flag, env var or key reaches are listed in
:data:`swarmavg.peer.daemon.config.INTERNAL`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmavg.peer.daemon.config import (
    DEFAULT_LISTEN,
    LOG_LEVELS,
    AllReduceSettings,
    AveragingSettings,
    DHTSettings,
    PeerConfig,
    StateSettings,
    split_addresses,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "SWARMAVG_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
SECTIONS: Mapping[str, type[DataclassInstance]] = {
    "peer": PeerConfig,
    "dht": DHTSettings,
    "averaging": AveragingSettings,
    "allreduce": AllReduceSettings,
    "state": StateSettings,
}
"""TOML table -> the dataclass holding its settings (``[peer]``: PeerConfig's own fields)."""

MOVED_FROM_PEER = frozenset({"group_size", "data_port", "bootstrap_timeout"})
"""Settings that older files have in ``[peer]`` or at the top level (still accepted there)."""


@dataclass(frozen=True)
class Setting:
    """One user-facing setting and its three spellings.

    Attributes:
        section: the TOML table it lives in (a key of :data:`SECTIONS`).
        name: its field in that section, its TOML key, and the stem of its flag and env var.
        help: the flag's help text (the env var is appended).
        metavar: the flag's value placeholder (``None`` for switches).
        commands: the subcommands that take the flag (env var and TOML key apply to all).
    """

    section: str
    name: str
    help: str
    metavar: str | None = None
    commands: tuple[str, ...] = ("peer",)

    @property
    def flag(self) -> str:
        """``run_id`` -> ``--run-id``."""
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """``run_id`` -> ``SWARMAVG_RUN_ID``."""
        return ENV_PREFIX + self.name.upper()

    @property
    def kind(self) -> str:
        """The field's type without ``| None``: str, int, float, bool or list[str]."""
        return _FIELD_TYPES[self.section, self.name].removesuffix(" | None")


_FIELD_TYPES = {
    (section, f.name): str(f.type)
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if section != "peer" or f.name not in SECTIONS
}
"""(section, field) -> its annotation (a string: ``from __future__ import annotations``)."""

BOTH = ("peer", "dht")
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "peer",
        "listen",
        f"public gRPC address to bind; port 0 picks a free one (default {DEFAULT_LISTEN})",
        "HOST:PORT",
        BOTH,
    ),
    Setting(
        "peer",
        "announce",
        "address other peers should dial (default: the listen address)",
        "HOST:PORT",
        BOTH,
    ),
    Setting(
        "peer",
        "join",
        "initial peer HOST:PORT; repeatable or comma-separated; none starts a new swarm",
        "ADDR",
        BOTH,
    ),
    Setting("peer", "run_id", "run name (default 'default')", "NAME", BOTH),
    Setting("peer", "identity", "Ed25519 key file, created (mode 600) when missing", "FILE", BOTH),
    Setting(
        "peer",
        "run_file",
        "a private run's run file (swarmavg run init); with --credential, admits only invited "
        "peers and encrypts all traffic (it also sets the run id)",
        "RUN",
        BOTH,
    ),
    Setting(
        "peer",
        "credential",
        "this peer's credential in the private run (swarmavg run invite)",
        "CRED",
        BOTH,
    ),
    Setting(
        "peer",
        "revocations",
        "a private run's revocation list (swarmavg run revoke): refuse the peers it names, "
        "re-read when the file changes, and pass it on to the run's peers",
        "FILE",
        BOTH,
    ),
    Setting(
        "peer",
        "control",
        "local control endpoint: a unix socket path or 127.0.0.1:PORT (peer default "
        "$XDG_RUNTIME_DIR/swarmavg/<run-id>.sock or ~/.swarmavg/<run-id>.sock; a dht node "
        "has none unless given one)",
        "ENDPOINT",
        BOTH,
    ),
    Setting(
        "peer",
        "client_mode",
        "accept no incoming connections (without it, a peer behind NAT is found out and "
        "reached through a relay)",
    ),
    Setting(
        "peer",
        "relay",
        "when publicly reachable, relay connections for peers behind NAT (default on)",
        commands=BOTH,
    ),
    Setting(
        "peer",
        "relay_rate",
        "MiB/s one source may push through this peer's relay, both ways (default 32)",
        "MIBPS",
        BOTH,
    ),
    Setting(
        "peer",
        "hole_punching",
        "behind NAT, punch direct connections to the other peers behind NAT (default on)",
    ),
    Setting(
        "peer",
        "metrics",
        "serve Prometheus metrics at http://HOST:PORT/metrics",
        "HOST:PORT",
        BOTH,
    ),
    Setting("peer", "log_level", f"one of {', '.join(LOG_LEVELS)} (default INFO)", "LEVEL", BOTH),
    Setting(
        "peer",
        "local_window",
        "longest wait for the other local training processes of a round (default 0.5)",
        "SECONDS",
    ),
    Setting(
        "peer",
        "summary_interval",
        "seconds between the daemon's summary log lines (rounds, bytes, peers); 0 turns "
        "them off (default 60)",
        "SECONDS",
        BOTH,
    ),
    Setting(
        "peer",
        "shutdown_grace",
        "seconds the first SIGINT/SIGTERM gives rounds in flight (default 2)",
        "SECONDS",
    ),
    Setting(
        "dht",
        "bootstrap_timeout",
        "seconds to retry the initial peers before giving up (default 30)",
        "SECONDS",
        BOTH,
    ),
    Setting(
        "dht",
        "auth_window",
        "seconds a signed message stays valid either side of this peer's clock (default 120)",
        "SECONDS",
    ),
    Setting(
        "averaging",
        "group_size",
        "target group size when a caller passes group_size=None (default 16)",
        "N",
    ),
    Setting(
        "averaging",
        "bandwidth",
        "this peer's bandwidth in MB/s, which sizes its part of each round "
        "(default: measured from the rounds, 10 until the first)",
        "MBPS",
    ),
    Setting(
        "averaging",
        "default_codec",
        "codec of the groups this peer leads when a caller names none (default none)",
        "CODEC",
    ),
    Setting(
        "averaging",
        "matchmaking_time",
        "seconds a leader waits for more peers before closing a group that is not full (default 5)",
        "SECONDS",
    ),
    Setting(
        "averaging",
        "group_bits",
        "initial Moshpit group bits, a string of 0/1 (default empty: one group key)",
        "BITS",
    ),
    Setting(
        "allreduce",
        "data_port",
        "port of the all-reduce data plane (plain TCP on the listen host): 0 picks a free "
        "one (default), -1 turns it off",
        "PORT",
    ),
    Setting(
        "allreduce",
        "executor_threads",
        "threads for codec work and reduction; 0 runs it on the event loop (default: 0 on "
        "machines with at most 2 cores, else 2)",
        "N",
    ),
    Setting(
        "allreduce",
        "min_stall",
        "seconds without progress before a sender or reducer counts as stalled (default 3; "
        "raise it on slow links)",
        "SECONDS",
    ),
    Setting(
        "allreduce",
        "weight_bound",
        "under the mean, a sender's weight counts as at most this many times the median "
        "weight of its part's senders (default 10)",
        "K",
    ),
    Setting(
        "allreduce",
        "congestion_control",
        "TCP congestion control of the data plane's connections: auto (the default: bbr "
        "on paths of 75 ms round trip or more, where allowed; the kernel's default "
        "elsewhere), kernel (the kernel's default everywhere), or a name such as cubic or "
        "bbr, which the daemon refuses if the kernel does not allow it",
        "NAME",
    ),
    Setting(
        "allreduce",
        "streams_per_reducer",
        "data-plane connections a part goes over to its reducer at once, 1 to 8 (default 1; "
        "more were no faster on the test bed and cost retransmissions on short paths, see "
        "docs/benchmarks.md)",
        "N",
    ),
    Setting(
        "state",
        "max_state_bytes",
        "largest state load_state accepts (default 16 GiB)",
        "BYTES",
    ),
    Setting(
        "state",
        "max_uploads",
        "downloads of this peer's published state served at once (default 8)",
        "N",
    ),
    Setting(
        "state",
        "keep_loaded_chunks",
        "keep the last loaded state's chunks so that the next load fetches only what "
        "changed (default on; costs one copy of the state)",
    ),
)
BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}


def env_name(name: str) -> str:
    """The env var of setting ``name`` (``run_id`` -> ``SWARMAVG_RUN_ID``)."""
    return BY_NAME[name].env


def flag_name(name: str) -> str:
    """The flag of setting ``name`` (``run_id`` -> ``--run-id``)."""
    return BY_NAME[name].flag


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add the flags of ``command``'s settings to ``parser`` (dest: the setting's name).

    A flag not given parses as ``None`` (``join``: an empty list), so that it does not
    override the env var or the file.
    """
    for s in SETTINGS:
        if command not in s.commands:
            continue
        text = f"{s.help} (env {s.env})"
        if s.kind == "bool":
            parser.add_argument(
                s.flag, dest=s.name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        elif s.kind == "list[str]":
            parser.add_argument(
                s.flag, dest=s.name, metavar=s.metavar, action="append", default=[], help=text
            )
        elif s.name == "log_level":
            parser.add_argument(
                s.flag,
                dest=s.name,
                metavar=s.metavar,
                type=str.upper,
                choices=LOG_LEVELS,
                help=text,
            )
        else:
            types: dict[str, Any] = {"int": int, "float": float, "str": str}
            parser.add_argument(
                s.flag, dest=s.name, metavar=s.metavar, type=types[s.kind], help=text
            )


def flags_from_args(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The values of ``command``'s setting flags in parsed ``args`` (for :func:`resolve_config`)."""
    return {s.name: getattr(args, s.name) for s in SETTINGS if command in s.commands}


def _parse_bool(text: str) -> bool | None:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    return None


def _coerce(setting: Setting, value: Any, shown: str, *, from_env: bool) -> Any:
    """Convert a raw env (always a string) or TOML value to the setting's type.

    ``shown`` is the setting and value as the user wrote them (``SWARMAVG_GROUP_SIZE='8'``,
    or the file and ``[averaging] group_size = '8'``), so that an error points at the line.
    """
    kind = setting.kind
    if kind == "list[str]":
        if isinstance(value, str | list | tuple) and all(isinstance(v, str) for v in value):
            return split_addresses(value)
        raise ValueError(f"{shown}: expected a list of HOST:PORT")
    if kind == "bool":
        parsed = _parse_bool(value) if from_env and isinstance(value, str) else value
        if isinstance(parsed, bool):
            return parsed
        raise ValueError(f"{shown}: expected true/false")
    if kind in ("int", "float"):
        # bool is an int to Python; `data_port = true` in a file is still a mistake.
        if isinstance(value, int) and not isinstance(value, bool):
            return value if kind == "int" else float(value)
        if kind == "float" and isinstance(value, float):
            return value
        if from_env:
            with contextlib.suppress(ValueError):
                return int(value) if kind == "int" else float(value)
        raise ValueError(f"{shown}: expected {'an integer' if kind == 'int' else 'a number'}")
    if not isinstance(value, str):
        raise ValueError(f"{shown}: expected a string")
    return value


def _load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"config file {os.fspath(path)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {os.fspath(path)!r}: {exc}") from None


def _place(table: str | None, key: str) -> str:
    """How the file spells a key: ``[averaging] bandwidth``, or ``run_id`` at the top level."""
    return key if table is None else f"[{table}] {key}"


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML config file: setting name -> value, checked against the schema.

    Raises:
        ValueError: unreadable or malformed file, an unknown section or key, a key in the
            wrong section, one setting given twice, or a value of the wrong type; the
            message names the file and the key.
    """
    data = _load_toml(path)
    prefix = f"config file {os.fspath(path)!r}"
    # (table, key, value); table None: a top-level key, i.e. the flat form of [peer].
    entries: list[tuple[str | None, str, Any]] = []
    for key, value in data.items():
        if not isinstance(value, dict):
            entries.append((None, key, value))
        elif key in SECTIONS:
            entries += [(key, k, v) for k, v in value.items()]
        else:
            raise ValueError(
                f"{prefix}: unknown section [{key}]; known: "
                + ", ".join(f"[{name}]" for name in SECTIONS)
            )
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for table, key, value in entries:
        place = _place(table, key)
        section = table or "peer"
        if table is None and key in SECTIONS:
            raise ValueError(f"{prefix}: [{key}] must be a table")
        setting = BY_NAME.get(key)
        if setting is None:
            known = [s.name for s in SETTINGS if s.section == section]
            if section == "peer":
                known += sorted(MOVED_FROM_PEER)
            where = "top-level key" if table is None else "key"
            raise ValueError(f"{prefix}: unknown {where} {place}; known there: {', '.join(known)}")
        if setting.section != section and not (section == "peer" and key in MOVED_FROM_PEER):
            raise ValueError(f"{prefix}: {place} belongs under [{setting.section}]")
        if key in seen:
            raise ValueError(f"{prefix}: {key} is set twice, as {seen[key]} and as {place}")
        seen[key] = place if table is not None else f"top-level {key}"
        out[key] = _coerce(setting, value, f"{prefix}: {place} = {value!r}", from_env=False)
    return out


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``SWARMAVG_*`` variables that name a setting (blank ones are ignored).

    Raises:
        ValueError: a value of the wrong type, naming the variable.
    """
    out: dict[str, Any] = {}
    for setting in SETTINGS:
        raw = environ.get(setting.env)
        if raw is not None and raw.strip() != "":
            out[setting.name] = _coerce(setting, raw, f"{setting.env}={raw!r}", from_env=True)
    return out


# Variables under the prefix that are read outside the settings: the config file, the
# control endpoint (client side), the native-kernel switch.
OTHER_ENV = frozenset({CONFIG_ENV, ENV_PREFIX + "CONTROL", ENV_PREFIX + "NATIVE"})


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """One warning per ``SWARMAVG_*`` variable that names no setting, with the nearest
    setting's variable when one is close: a misspelled variable would otherwise be ignored
    without a word, and the daemon would run with the default the user meant to change."""
    known = {setting.env for setting in SETTINGS} | OTHER_ENV
    warnings = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        # Compared without the prefix, which every name shares and would make any two alike.
        suffixes = sorted(known_name[len(ENV_PREFIX) :] for known_name in known)
        close = difflib.get_close_matches(name[len(ENV_PREFIX) :], suffixes, n=1, cutoff=0.75)
        hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else ""
        warnings.append(f"{name} is not a swarmavg setting{hint}; it is ignored")
    return warnings


def resolve_config(
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> PeerConfig:
    """Merge the sources, per setting: flag > env > file > default.

    Args:
        flags: setting name -> value for the flags the user gave (``None`` = not given;
            for ``join`` an empty list = not given).
        environ: environment (default ``os.environ``); ``SWARMAVG_CONFIG`` names the
            TOML file when ``config_file`` is ``None``.
        config_file: the ``--config`` file.

    Raises:
        ValueError: a bad value in any source, or an unknown setting; the message names it.
    """
    env = os.environ if environ is None else environ
    path = config_file if config_file is not None else env.get(CONFIG_ENV) or None
    merged: dict[str, Any] = {}
    if path is not None:
        merged.update(read_toml(Path(path)))
    merged.update(read_env(env))
    for name, value in flags.items():
        if name not in BY_NAME:
            raise ValueError(f"unknown setting {name!r}")
        if value is None or (name == "join" and not value):
            continue
        merged[name] = value
    if merged.get("run_file") and "run_id" not in merged:
        # A private run's file names its run: `--run-file` alone is enough. A run id given
        # as well must match it (checked by the daemon, with the credentials).
        from swarmavg.dht.credentials import CredentialError, read_run_id

        try:
            merged["run_id"] = read_run_id(merged["run_file"])
        except CredentialError as exc:
            raise ValueError(str(exc)) from None
    return build_config(merged)


def build_config(values: Mapping[str, Any]) -> PeerConfig:
    """``PeerConfig`` from setting name -> value (missing ones take their defaults).

    Raises:
        ValueError: an unknown setting name, or a value its section rejects.
    """
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
    by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for name, value in values.items():
        by_section[BY_NAME[name].section][name] = value
    return PeerConfig(
        **by_section["peer"],
        dht=DHTSettings(**by_section["dht"]),
        averaging=AveragingSettings(**by_section["averaging"]),
        allreduce=AllReduceSettings(**by_section["allreduce"]),
        state=StateSettings(**by_section["state"]),
    )
