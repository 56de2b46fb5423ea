"""docs/swarmavg.toml has every setting, commented, and cannot go stale."""

from __future__ import annotations

import re
from pathlib import Path

from swarmavg.peer.daemon.sample_config import sample_toml
from swarmavg.peer.daemon.settings import SETTINGS, resolve_config

SAMPLE = Path(__file__).resolve().parents[3] / "docs" / "swarmavg.toml"
KEY_LINE = re.compile(r"^# (\w+) = (.+)$")


def test_the_committed_sample_is_the_generated_one() -> None:
    assert SAMPLE.read_text() == sample_toml(), (
        "regenerate: python -m swarmavg.peer.daemon.sample_config > docs/swarmavg.toml"
    )


def test_every_setting_appears_once_and_uncommented_the_file_is_valid(tmp_path: Path) -> None:
    text = SAMPLE.read_text()
    keys = [m.group(1) for line in text.splitlines() if (m := KEY_LINE.match(line))]
    assert sorted(keys) == sorted(s.name for s in SETTINGS)
    live = tmp_path / "all.toml"
    live.write_text("\n".join(KEY_LINE.sub(r"\1 = \2", line) for line in text.splitlines()))
    config = resolve_config({}, {}, live)
    assert config.join == ["203.0.113.7:31337"]
    assert config.summary_interval == 60.0
    assert config.averaging.bandwidth == 50.0
    assert resolve_config({}, {}, SAMPLE) == resolve_config({}, {})  # commented: the defaults
