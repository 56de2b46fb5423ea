"""The sample config file ``docs/swarmavg.toml``, generated from the settings' schema.

Every setting of :data:`swarmavg.peer.daemon.settings.SETTINGS` appears once, commented out, with
its help text, flag and env var and its default (or, for settings without one, an example
value), so the file cannot go stale: tests/peer/daemon/test_sample_config.py checks that the
committed file equals this output and that uncommenting every line gives a valid config.

Regenerate with ``python -m swarmavg.peer.daemon.sample_config > docs/swarmavg.toml``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from typing import Any

from swarmavg.peer.daemon.settings import SECTIONS, SETTINGS, Setting

EXAMPLES: dict[str, Any] = {
    "announce": "203.0.113.9:31337",
    "join": ["203.0.113.7:31337"],
    "identity": "/var/lib/swarmavg/identity.key",
    "control": "/run/swarmavg/control.sock",
    "metrics": "127.0.0.1:9100",
    "bandwidth": 50.0,
    "executor_threads": 2,
    "run_file": "/etc/swarmavg/my-run.run",
    "credential": "/var/lib/swarmavg/identity.key.cred",
    "revocations": "/var/lib/swarmavg/my-run.revoked",
}
"""Values shown for settings whose default is "unset" (None) or empty."""

HEADER = """\
# Sample swarmavg config file: every key, commented out (docs/peer.md, "Configuration").
# Generated from swarmavg/peer/daemon/settings.py by `python -m swarmavg.peer.daemon.sample_config`;
# a test keeps it in step with the code.
#
#   swarmavg peer --config swarmavg.toml      # or SWARMAVG_CONFIG=swarmavg.toml
#
# Precedence: flag > env var > this file > default. An unknown section or key is an error
# that names it. Uncomment a line to set it; the value shown is the default, or an example
# where there is no default.
"""


def _default(setting: Setting) -> Any:
    field = {f.name: f for f in dataclasses.fields(SECTIONS[setting.section])}[setting.name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise ValueError(f"setting {setting.name} has no default")  # pragma: no cover


def _toml_value(value: Any) -> str:
    """A TOML literal (JSON's spelling is TOML's for these types)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def sample_toml() -> str:
    """The sample file's text."""
    lines = [HEADER]
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for setting in (s for s in SETTINGS if s.section == section):
            default = _default(setting)
            shown = EXAMPLES[setting.name] if default in (None, []) else default
            note = f"{setting.help}; {setting.flag}, {setting.env}"
            if default in (None, []):
                note += "; unset by default, example value"
            lines += textwrap.wrap(note, 92, initial_indent="# ", subsequent_indent="#   ")
            lines.append(f"# {setting.name} = {_toml_value(shown)}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(sample_toml())
