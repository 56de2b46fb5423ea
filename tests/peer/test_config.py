"""PeerConfig: flag > env > TOML file > default, and validation of every source."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmavg.peer.config import FIELDS, PeerConfig, env_name, flag_name, resolve_config


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "peer.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = resolve_config({}, {})
    assert config == PeerConfig()
    assert config.listen == "0.0.0.0:31337"
    assert config.join == []
    assert config.client_mode is False


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        'listen = "127.0.0.1:1001"\nrun_id = "from-file"\nlog_level = "debug"\n'
        'join = ["10.0.0.1:1", "10.0.0.2:2"]\nmetrics = "127.0.0.1:9000"\n',
    )
    env = {"SWARMAVG_LISTEN": "127.0.0.1:1002", "SWARMAVG_RUN_ID": "from-env"}
    config = resolve_config({"listen": "127.0.0.1:1003"}, env, path)
    assert config.listen == "127.0.0.1:1003"  # flag wins
    assert config.run_id == "from-env"  # env beats the file
    assert config.log_level == "DEBUG"  # file beats the default
    assert config.join == ["10.0.0.1:1", "10.0.0.2:2"]
    assert config.metrics == "127.0.0.1:9000"


def test_config_file_from_env_and_peer_table(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[peer]\nclient_mode = true\nrun_id = "tabled"\n')
    config = resolve_config({}, {"SWARMAVG_CONFIG": str(path)})
    assert config.client_mode is True
    assert config.run_id == "tabled"


def test_join_repeatable_and_comma_separated() -> None:
    config = resolve_config({"join": ["a:1,b:2", "c:3", "a:1"]}, {})
    assert config.join == ["a:1", "b:2", "c:3"]
    config = resolve_config({}, {"SWARMAVG_JOIN": "x:1, y:2"})
    assert config.join == ["x:1", "y:2"]


@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("yes", True), ("false", False)])
def test_env_bool(raw: str, expected: bool) -> None:
    assert resolve_config({}, {"SWARMAVG_CLIENT_MODE": raw}).client_mode is expected


def test_every_field_has_env_and_toml_spelling(tmp_path: Path) -> None:
    assert env_name("run_id") == "SWARMAVG_RUN_ID"
    assert flag_name("client_mode") == "--client-mode"
    values = {
        "listen": '"127.0.0.1:5"',
        "announce": '"1.2.3.4:5"',
        "data_port": "31338",
        "join": '["1.2.3.4:6"]',
        "run_id": '"r"',
        "control": '"/tmp/x.sock"',
        "client_mode": "true",
        "identity": '"/tmp/id.key"',
        "metrics": '"127.0.0.1:7"',
        "log_level": '"WARNING"',
        "group_size": "8",
        "local_window": "0.5",
        "shutdown_grace": "1.5",
        "bootstrap_timeout": "4.0",
    }
    assert set(values) == set(FIELDS)
    path = write_toml(tmp_path, "\n".join(f"{k} = {v}" for k, v in values.items()))
    from_file = resolve_config({}, {}, path)
    env = {
        env_name(k): v.strip('"[]').replace('"', "") if k != "client_mode" else "true"
        for k, v in values.items()
    }
    from_env = resolve_config({}, env)
    assert from_file == from_env
    assert from_file.group_size == 8
    assert from_file.data_port == 31338
    assert from_file.client_mode is True


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"listen": "nohost"}, {}, "listen"),
        ({"join": ["1.2.3.4"]}, {}, "join"),
        ({}, {"SWARMAVG_GROUP_SIZE": "many"}, "integer"),
        ({}, {"SWARMAVG_CLIENT_MODE": "maybe"}, "true/false"),
        ({}, {"SWARMAVG_LOG_LEVEL": "loud"}, "log_level"),
        ({"listen": "1.2.3.4:70000"}, {}, "port"),
        ({}, {"SWARMAVG_DATA_PORT": "-2"}, "data_port"),
    ],
)
def test_bad_values_name_the_setting(
    flags: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_config(flags, env)


def test_unknown_or_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown key"):
        resolve_config({}, {}, write_toml(tmp_path, "lisen = 1\n"))
    with pytest.raises(ValueError, match=r"peer\.toml"):
        resolve_config({}, {}, write_toml(tmp_path, "listen = \n"))
    with pytest.raises(ValueError, match=r"missing\.toml"):
        resolve_config({}, {}, tmp_path / "missing.toml")
