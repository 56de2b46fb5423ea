"""Importing an integration without its framework names the extra to install."""

from __future__ import annotations

import importlib
import sys

import pytest

pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("module", "framework", "extra"),
    [
        ("hf_trainer", "transformers", "hf"),
        ("lightning_callback", "lightning", "lightning"),
    ],
)
def test_a_missing_framework_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, framework: str, extra: str
) -> None:
    name = f"swarmavg.averaging.training.integrations.{module}"
    # None in sys.modules makes `import framework` (and its submodules) raise ImportError
    for loaded in [m for m in sys.modules if m == framework or m.startswith(framework + ".")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setitem(sys.modules, framework, None)
    monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'swarmavg\[{extra}\]'"):
        importlib.import_module(name)


def test_the_integrations_package_imports_without_any_framework() -> None:
    importlib.import_module("swarmavg.averaging.training.integrations")
