"""PeerConfig: one tree of sections, flag > env > TOML file > default per setting, every
source validated, and every component setting either reachable or listed as internal."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.averager import AveragerConfig
from swarmavg.averaging.group import Mode
from swarmavg.averaging.matchmaking.config import MatchmakerConfig
from swarmavg.averaging.state.config import StateSharingConfig
from swarmavg.dht.config import DHTConfig
from swarmavg.peer.cli.main import build_parser
from swarmavg.peer.daemon.config import INTERNAL, PeerConfig
from swarmavg.peer.daemon.settings import (
    BY_NAME,
    MOVED_FROM_PEER,
    SECTIONS,
    SETTINGS,
    build_config,
    env_name,
    flag_name,
    flags_from_args,
    resolve_config,
    unknown_env,
)

REPO = Path(__file__).resolve().parents[3]

# A value other than the default for every setting, as TOML writes it.
SAMPLES: dict[str, str] = {
    "listen": '"127.0.0.1:5"',
    "announce": '"1.2.3.4:5"',
    "join": '["1.2.3.4:6"]',
    "run_id": '"r"',
    "control": '"/tmp/x.sock"',
    "client_mode": "true",
    "relay": "false",
    "relay_rate": "8.0",
    "hole_punching": "false",
    "identity": '"/tmp/id.key"',
    "run_file": '"/tmp/r.run.toml"',
    "credential": '"/tmp/id.cred.pem"',
    "revocations": '"/tmp/r.revoked"',
    "metrics": '"127.0.0.1:7"',
    "summary_interval": "30.0",
    "log_level": '"WARNING"',
    "local_window": "0.25",
    "shutdown_grace": "1.5",
    "bootstrap_timeout": "4.0",
    "auth_window": "60.0",
    "group_size": "8",
    "bandwidth": "250.0",
    "default_codec": '"uint8-blockwise"',
    "matchmaking_time": "2.5",
    "group_bits": '"01"',
    "data_port": "31338",
    "executor_threads": "3",
    "min_stall": "9.0",
    "weight_bound": "5.0",
    "congestion_control": '"cubic"',
    "streams_per_reducer": "2",
    "max_state_bytes": "1024",
    "max_uploads": "2",
    "keep_loaded_chunks": "false",
}


def write_toml(tmp_path: Path, text: str, name: str = "peer.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def sectioned(values: dict[str, str]) -> str:
    """TOML with every setting under its own section's table."""
    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        lines += [f"{k} = {v}" for k, v in values.items() if BY_NAME[k].section == section]
    return "\n".join(lines) + "\n"


def as_env(values: dict[str, str]) -> dict[str, str]:
    return {env_name(k): v.strip("[]").replace('"', "") for k, v in values.items()}


def parse_cli(*argv: str, command: str = "peer") -> dict[str, Any]:
    return flags_from_args(build_parser().parse_args([command, *argv]), command)


def test_defaults() -> None:
    config = resolve_config({}, {})
    assert config == PeerConfig()
    assert config.listen == "0.0.0.0:31337"
    assert config.join == []
    assert config.client_mode is False
    assert config.averaging.bandwidth is None  # measured
    assert config.averaging.group_size == 16


def test_the_schema_covers_every_field_of_every_section_once() -> None:
    fields = {
        (section, f.name)
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.name not in SECTIONS  # PeerConfig's section fields are the tables themselves
    }
    assert {(s.section, s.name) for s in SETTINGS} == fields
    assert len(BY_NAME) == len(SETTINGS)  # names are unique across the tree
    assert set(SAMPLES) == set(BY_NAME)


def test_names_of_flags_and_env_vars() -> None:
    for setting in SETTINGS:
        assert setting.env == "SWARMAVG_" + setting.name.upper()
        assert setting.flag == "--" + setting.name.replace("_", "-")
    assert env_name("group_size") == "SWARMAVG_GROUP_SIZE"
    assert flag_name("data_port") == "--data-port"
    assert flag_name("bandwidth") == "--bandwidth"  # docs/peer.md: --bandwidth MBPS


def test_every_setting_has_a_flag_an_env_var_and_a_toml_key(tmp_path: Path) -> None:
    from_file = resolve_config({}, {}, write_toml(tmp_path, sectioned(SAMPLES)))
    from_env = resolve_config({}, as_env(SAMPLES))
    argv: list[str] = []
    for name, value in as_env(SAMPLES).items():
        setting = BY_NAME[name.removeprefix("SWARMAVG_").lower()]
        if setting.kind == "bool":
            argv.append(setting.flag if value == "true" else "--no-" + setting.flag[2:])
        else:
            argv += [setting.flag, value]
    from_flags = resolve_config(parse_cli(*argv), {})
    assert from_file == from_env == from_flags
    assert from_file != PeerConfig()
    assert from_file.averaging.bandwidth == 250.0
    assert from_file.averaging.default_codec == "uint8-blockwise"
    assert from_file.allreduce.data_port == 31338
    assert from_file.state.keep_loaded_chunks is False
    assert from_file.client_mode is True


# One setting of each section: (name, file value as TOML, env value, flag value, expected
# for file / env / flag, default).
PRECEDENCE = [
    ("run_id", '"file"', "env", "flag", ("file", "env", "flag", "default")),
    ("bootstrap_timeout", "11", "12", "13", (11.0, 12.0, 13.0, 30.0)),
    ("bandwidth", "21", "22", "23", (21.0, 22.0, 23.0, None)),
    ("data_port", "31", "32", "33", (31, 32, 33, 0)),
    ("max_uploads", "41", "42", "43", (41, 42, 43, 8)),
]


def _get(config: PeerConfig, name: str) -> Any:
    section = BY_NAME[name].section
    return getattr(config if section == "peer" else getattr(config, section), name)


@pytest.mark.parametrize(("name", "file_value", "env_value", "flag_value", "expected"), PRECEDENCE)
def test_precedence_per_section_flag_over_env_over_file_over_default(
    tmp_path: Path,
    name: str,
    file_value: str,
    env_value: str,
    flag_value: str,
    expected: tuple[Any, Any, Any, Any],
) -> None:
    section = BY_NAME[name].section
    path = write_toml(tmp_path, f"[{section}]\n{name} = {file_value}\n")
    env = {env_name(name): env_value}
    flags = parse_cli(flag_name(name), flag_value)
    assert _get(resolve_config(flags, env, path), name) == expected[2]
    assert _get(resolve_config({}, env, path), name) == expected[1]
    assert _get(resolve_config({}, {}, path), name) == expected[0]
    assert _get(resolve_config({}, {}), name) == expected[3]


def test_precedence_of_a_switch_both_ways(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[state]\nkeep_loaded_chunks = false\n")
    assert resolve_config({}, {}, path).state.keep_loaded_chunks is False
    env = {"SWARMAVG_KEEP_LOADED_CHUNKS": "true"}
    assert resolve_config({}, env, path).state.keep_loaded_chunks is True
    flags = parse_cli("--no-keep-loaded-chunks")
    assert resolve_config(flags, env, path).state.keep_loaded_chunks is False
    # --no-client-mode overrides SWARMAVG_CLIENT_MODE=1; no flag leaves it to the env.
    on = {"SWARMAVG_CLIENT_MODE": "1"}
    assert resolve_config(parse_cli("--no-client-mode"), on).client_mode is False
    assert resolve_config(parse_cli(), on).client_mode is True


def test_config_file_from_env_and_peer_table(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[peer]\nclient_mode = true\nrun_id = "tabled"\n')
    config = resolve_config({}, {"SWARMAVG_CONFIG": str(path)})
    assert config.client_mode is True
    assert config.run_id == "tabled"


def test_top_level_keys_next_to_a_peer_table_are_merged(tmp_path: Path) -> None:
    """They used to be ignored silently; they are the flat form of [peer]."""
    path = write_toml(tmp_path, 'run_id = "flat"\n[peer]\nlisten = "127.0.0.1:9"\n')
    config = resolve_config({}, {}, path)
    assert config.run_id == "flat"
    assert config.listen == "127.0.0.1:9"


@pytest.mark.parametrize("name", sorted(MOVED_FROM_PEER))
def test_keys_that_moved_to_a_section_keep_their_old_spellings(tmp_path: Path, name: str) -> None:
    value = SAMPLES[name]
    canonical = resolve_config({}, {}, write_toml(tmp_path, sectioned({name: value}), "new.toml"))
    flat = resolve_config({}, {}, write_toml(tmp_path, f"{name} = {value}\n", "flat.toml"))
    tabled = resolve_config({}, {}, write_toml(tmp_path, f"[peer]\n{name} = {value}\n", "t.toml"))
    assert canonical == flat == tabled != PeerConfig()


def test_the_old_flat_file_means_what_it_meant(tmp_path: Path) -> None:
    """A file as the docs showed it before sections: every key at the top level."""
    old = {k: v for k, v in SAMPLES.items() if BY_NAME[k].section == "peer" or k in MOVED_FROM_PEER}
    path = write_toml(tmp_path, "\n".join(f"{k} = {v}" for k, v in old.items()) + "\n")
    config = resolve_config({}, {}, path)
    assert config == resolve_config({}, as_env(old))
    assert config.averaging.group_size == 8
    assert config.allreduce.data_port == 31338
    assert config.dht.bootstrap_timeout == 4.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour = 1\n", r"unknown top-level key colour"),
        ("lisen = 1\n", r"unknown top-level key lisen; known there: listen, "),
        ("[peer]\ncolour = 1\n", r"unknown key \[peer\] colour"),
        ("[averaging]\ncolour = 1\n", r"unknown key \[averaging\] colour"),
        ("[averaging]\nbandwith = 1\n", r"\[averaging\] bandwith; known there: group_size, "),
        ("[colour]\nx = 1\n", r"unknown section \[colour\]; known: \[peer\], \[dht\]"),
        ("[matchmaking]\njoin_timeout = 1\n", r"unknown section \[matchmaking\]"),
        ("[dht]\nk = 4\n", r"unknown key \[dht\] k"),  # internal: not reachable
        ("dht = 3\n", r"\[dht\] must be a table"),
        ("bandwidth = 10\n", r": bandwidth belongs under \[averaging\]"),
        ("[peer]\nbandwidth = 10\n", r"\[peer\] bandwidth belongs under \[averaging\]"),
        ("[state]\ngroup_size = 4\n", r"\[state\] group_size belongs under \[averaging\]"),
        ("[averaging]\nlisten = '1.2.3.4:5'\n", r"\[averaging\] listen belongs under \[peer\]"),
        ("[averaging.extra]\ngroup_size = 4\n", r"unknown key \[averaging\] extra"),
    ],
)
def test_unknown_or_misplaced_keys_are_errors_that_name_them(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_config({}, {}, write_toml(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'run_id = "a"\n[peer]\nrun_id = "b"\n',
            r"run_id is set twice, as top-level run_id and as \[peer\] run_id",
        ),
        ("group_size = 4\n[averaging]\ngroup_size = 8\n", r"as \[averaging\] group_size"),
        ("[peer]\ndata_port = 1\n[allreduce]\ndata_port = 2\n", r"\[peer\] data_port and as"),
    ],
)
def test_a_setting_given_twice_in_a_file_is_an_error(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_config({}, {}, write_toml(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[allreduce]\ndata_port = 'x'\n", r"\[allreduce\] data_port = 'x': expected an integer"),
        ("[allreduce]\ndata_port = true\n", r"\[allreduce\] data_port = True: expected an integer"),
        ("[averaging]\nbandwidth = 'fast'\n", r"\[averaging\] bandwidth = 'fast': expected a num"),
        ("client_mode = 'yes'\n", r": client_mode = 'yes': expected true/false"),
        ("join = [1]\n", r": join = \[1\]: expected a list of HOST:PORT"),
        ("listen = 5\n", r": listen = 5: expected a string"),
    ],
)
def test_file_values_of_the_wrong_type_name_file_and_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=r"peer\.toml.*" + message):
        resolve_config({}, {}, write_toml(tmp_path, text))


def test_malformed_or_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"peer\.toml"):
        resolve_config({}, {}, write_toml(tmp_path, "listen = \n"))
    with pytest.raises(ValueError, match=r"missing\.toml"):
        resolve_config({}, {}, tmp_path / "missing.toml")


def test_join_repeatable_and_comma_separated() -> None:
    config = resolve_config({"join": ["a:1,b:2", "c:3", "a:1"]}, {})
    assert config.join == ["a:1", "b:2", "c:3"]
    config = resolve_config({}, {"SWARMAVG_JOIN": "x:1, y:2"})
    assert config.join == ["x:1", "y:2"]


@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("yes", True), ("false", False)])
def test_env_bool(raw: str, expected: bool) -> None:
    assert resolve_config({}, {"SWARMAVG_CLIENT_MODE": raw}).client_mode is expected


def test_misspelled_env_var_is_named_with_the_setting_it_resembles() -> None:
    warnings = unknown_env(
        {
            "SWARMAVG_GROUPSIZE": "8",  # the user meant SWARMAVG_GROUP_SIZE
            "SWARMAVG_FROBNICATE": "1",
            "SWARMAVG_GROUP_SIZE": "4",
            "SWARMAVG_CONFIG": "x.toml",
            "SWARMAVG_CONTROL": "/tmp/c.sock",
            "SWARMAVG_NATIVE": "0",
            "PATH": "/bin",
        }
    )
    assert warnings == [
        "SWARMAVG_FROBNICATE is not a swarmavg setting; it is ignored",
        "SWARMAVG_GROUPSIZE is not a swarmavg setting (did you mean SWARMAVG_GROUP_SIZE?);"
        " it is ignored",
    ]


def test_every_setting_env_var_is_known() -> None:
    assert unknown_env({setting.env: "x" for setting in SETTINGS}) == []


def test_blank_env_vars_are_ignored() -> None:
    assert resolve_config({}, {"SWARMAVG_GROUP_SIZE": " ", "SWARMAVG_BANDWIDTH": ""}) == (
        PeerConfig()
    )


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"listen": "nohost"}, {}, "listen"),
        ({"join": ["1.2.3.4"]}, {}, "join"),
        # The env var is named as the user spells it, not "SWARMAVG_ group_size".
        ({}, {"SWARMAVG_GROUP_SIZE": "many"}, r"^SWARMAVG_GROUP_SIZE='many': expected an integer"),
        ({}, {"SWARMAVG_BANDWIDTH": "fast"}, r"^SWARMAVG_BANDWIDTH='fast': expected a number"),
        ({}, {"SWARMAVG_CLIENT_MODE": "maybe"}, r"^SWARMAVG_CLIENT_MODE='maybe': .*true/false"),
        ({}, {"SWARMAVG_LOG_LEVEL": "loud"}, "log_level"),
        ({"listen": "1.2.3.4:70000"}, {}, "port"),
        ({}, {"SWARMAVG_DATA_PORT": "-2"}, "data_port"),
        ({"group_size": 1}, {}, "group_size 1: between 2 and 256"),
        ({"bandwidth": 0.0}, {}, "bandwidth 0.0: MB/s, > 0"),
        ({"bandwidth": float("inf")}, {}, "bandwidth inf"),
        ({"bandwidth": 5e6}, {}, "bandwidth 5000000.0"),
        ({"default_codec": "gzip9"}, {}, "default_codec 'gzip9': .*known"),
        ({"group_bits": "012"}, {}, "group_bits '012'"),
        ({"executor_threads": -1}, {}, "executor_threads -1"),
        ({"min_stall": 0.0}, {}, "min_stall 0.0"),
        ({"max_uploads": 0}, {}, "max_uploads 0"),
        ({"matchmaking_time": 0.0}, {}, "matchmaking_time 0.0"),
        ({"bootstrap_timeout": 0.0}, {}, "bootstrap_timeout 0.0"),
        ({"colour": "blue"}, {}, "unknown setting 'colour'"),
    ],
)
def test_bad_values_name_the_setting(
    flags: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_config(flags, env)


def test_bandwidth_flag_reaches_the_matchmaking_config() -> None:
    config = resolve_config(parse_cli("--bandwidth", "250"), {})
    assert config.averaging.bandwidth == 250.0
    assert config.averager_config().bandwidth == 250.0
    assert resolve_config({}, {}).averager_config().bandwidth is None  # measured


def test_bare_dht_takes_only_its_flags() -> None:
    flags = parse_cli("--bootstrap-timeout", "5", command="dht")
    assert resolve_config(flags, {}).dht_config().bootstrap_timeout == 5.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["dht", "--bandwidth", "10"])


# ---- the tree and the component configs ----------------------------------------------


def test_defaults_are_the_components_own() -> None:
    config = PeerConfig()
    assert config.dht_config() == DHTConfig()
    # Derived from [peer]: the data plane listens on the listen host.
    assert config.averager_config() == AveragerConfig(
        allreduce=AllReduceConfig(data_host="0.0.0.0")
    )


def test_sample_values_reach_the_component_configs() -> None:
    values = as_env(SAMPLES)
    config = resolve_config({}, values)
    dht, averager = config.dht_config(), config.averager_config()
    assert (dht.run_id, dht.initial_peers, dht.client_mode) == ("r", ("1.2.3.4:6",), True)
    assert dht.bootstrap_timeout == 4.0
    assert dht.auth_window == 60.0
    assert averager.mode is Mode.CLIENT
    assert averager.bandwidth == 250.0
    assert averager.target_group_size == 8
    assert averager.default_codec == "uint8-blockwise"
    assert averager.matchmaking_time == 2.5
    assert averager.group_bits == "01"
    allreduce = averager.allreduce
    assert (allreduce.data_plane, allreduce.data_host, allreduce.data_port) == (
        True,
        "127.0.0.1",
        31338,
    )
    assert (allreduce.executor_threads, allreduce.min_stall) == (3, 9.0)
    state = averager.state
    assert (state.max_state_bytes, state.max_uploads, state.keep_loaded_chunks) == (1024, 2, False)
    off = resolve_config({}, {**values, "SWARMAVG_DATA_PORT": "-1"}).averager_config()
    assert off.allreduce.data_plane is False


def _leaves(config: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted field path -> value, descending into nested component configs."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        path = f"{type(config).__name__}.{f.name}"
        if dataclasses.is_dataclass(value) and type(value) in INTERNAL:
            out.update(_leaves(value))
        else:
            out[path] = value
    return out


def test_every_component_setting_is_reachable_or_listed_as_internal() -> None:
    """Probe configs with every user setting changed: a component field that moves is
    reached by some setting; one that never moves must be listed in INTERNAL, and no
    listed field may move (it would not be internal then)."""
    assert set(INTERNAL) == {
        DHTConfig,
        AveragerConfig,
        MatchmakerConfig,
        AllReduceConfig,
        StateSharingConfig,
    }
    base = {**_leaves(DHTConfig()), **_leaves(AveragerConfig())}
    values = as_env(SAMPLES)
    probes = [
        build_config({}),
        resolve_config({}, values),
        resolve_config({}, {**values, "SWARMAVG_DATA_PORT": "-1"}),
    ]
    reached = set()
    for probe in probes:
        leaves = {**_leaves(probe.dht_config()), **_leaves(probe.averager_config())}
        reached |= {path for path, value in leaves.items() if value != base[path]}
    internal = {f"{cls.__name__}.{name}" for cls, names in INTERNAL.items() for name in names}
    assert not internal & reached, "listed as internal but reachable"
    assert reached | internal == set(base), "neither reachable nor listed as internal"


# ---- the examples in the docs and in deploy/ stay true -------------------------------


def _toml_blocks(path: Path) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", path.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("doc", ["docs/peer.md", "docs/deploy.md", "README.md"])
def test_toml_examples_in_the_docs_are_valid(tmp_path: Path, doc: str) -> None:
    for i, block in enumerate(_toml_blocks(REPO / doc)):
        resolve_config({}, {}, write_toml(tmp_path, block, f"example{i}.toml"))


def test_deploy_example_config_is_valid_and_sets_what_it_says() -> None:
    config = resolve_config({}, {}, REPO / "deploy" / "peer.toml")
    assert config != PeerConfig()
