"""The wheel that deploy/Dockerfile installs, built and run outside the source tree.

Every other test imports swarmavg through the editable install, whose finder maps the five
source folders as they are, so a package that the distribution forgets goes unnoticed there
(``swarmavg.peer.nat`` once did: the wheel's ``swarmavg`` failed at start with
ModuleNotFoundError). Here the wheel is built from exactly the files the Dockerfile's build
stage copies, installed with ``--no-deps`` into a fresh venv under tmp_path, and its console
script runs from there: ``--version``, then ``swarmavg peer`` and ``swarmavg dht``, each
until its ready line and then stopped with SIGINT.

Nothing is downloaded: the wheel builds with this venv's setuptools (``--no-build-isolation``
``--no-index``), and the fresh venv sees the dependencies through a folder of links to this
venv's site-packages that leaves out the editable install (its finder, its ``.pth`` files and
its metadata); the test checks that ``swarmavg`` is imported from the fresh venv.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarmavg.peer import __version__
from tests.deploy.test_deploy_files import dockerfile_instructions
from tests.harness import ProcessPool

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "setuptools"
]["package-dir"]
# The files of a source folder that the wheel must hold (package data included).
SHIPPED = ("*.py", "py.typed", "*.pyi", "*.proto")
# Variables that would let a child import something other than the fresh venv's packages.
LEAKY_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV")


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    site: Path  # the fresh venv's site-packages

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def swarmavg(self) -> Path:
        return self.venv / "bin" / "swarmavg"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    command = " ".join(str(a) for a in args)
    assert result.returncode == 0, f"{command[:300]}:\n{result.stdout}\n{result.stderr}"
    return result


def _copy_build_context(dest: Path) -> None:
    """What the Dockerfile's build stage COPYs from the repository, at the same places
    (caches and locally built extensions left out: the build compiles its own)."""
    instructions = dockerfile_instructions()
    froms = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
    build_stage = instructions[froms[0] : froms[1]]
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    copies = [args.split() for keyword, args in build_stage if keyword == "COPY"]
    assert copies, "the build stage copies nothing"
    for *sources, target in copies:
        assert not sources[0].startswith("--"), "a COPY with options: teach this test"
        for source in sources:
            src = ROOT / source
            if src.is_dir():  # COPY dir/ target/: the folder's contents into target
                shutil.copytree(src, dest / target, ignore=ignore, dirs_exist_ok=True)
            else:
                to = dest / target / src.name if target.endswith("/") else dest / target
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, to)


def _dependencies_without_swarmavg(dest: Path) -> Path:
    """A folder of links to every entry of this venv's site-packages except the editable
    swarmavg (its finder module, its .pth files, its dist-info) and all .pth files."""
    dest.mkdir()
    sites = {Path(sysconfig.get_path("purelib")), Path(sysconfig.get_path("platlib"))}
    for site in sites:
        for entry in site.iterdir():
            name = entry.name
            if (
                name.startswith(("__editable__", "swarmavg"))
                or name.endswith((".pth", ".egg-link"))
                or name == "__pycache__"
                or (dest / name).exists()
            ):
                continue
            (dest / name).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    context = base / "context"
    _copy_build_context(context)
    dist = base / "dist"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--disable-pip-version-check",
        "-q",
        "-w",
        dist,
        context,
        cwd=base,
    )
    [wheel] = dist.glob("swarmavg-*.whl")

    venv = base / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=base)
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_run(python, "-c", where, cwd=base).stdout.strip())
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--no-deps",
        "--no-index",
        "--disable-pip-version-check",
        "-q",
        wheel,
        cwd=base,
    )
    deps = _dependencies_without_swarmavg(base / "deps")
    (site / "swarmavg_test_deps.pth").write_text(f"{deps}\n")
    return Installed(wheel, venv, site)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for control sockets (unix socket paths are capped at 107 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def test_the_wheel_holds_every_module_and_data_file_of_the_sources(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
    expected = set()
    for package, folder in PACKAGE_DIRS.items():
        for pattern in SHIPPED:
            for path in (ROOT / folder).rglob(pattern):
                if "__pycache__" not in path.parts:
                    relative = path.relative_to(ROOT / folder).as_posix()
                    expected.add(f"{package.replace('.', '/')}/{relative}")
    assert "swarmavg/peer/nat/__init__.py" in expected
    assert sorted(expected - names) == []
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    # The optional C kernels (setup.py) are built whenever a C compiler is there.
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler):
        native = [n for n in names if n.startswith("swarmavg/compression/_native.")]
        assert any(n.endswith(".so") for n in native), native


def test_swarmavg_is_imported_from_the_wheel(installed: Installed, tmp_path: Path) -> None:
    probe = """
import importlib, importlib.metadata, json, pkgutil, sys
import swarmavg, swarmavg.peer, swarmavg.peer.nat
imported = []
for sub in ("proto", "compression", "dht", "peer"):  # the daemon's packages: no torch
    package = importlib.import_module("swarmavg." + sub)
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        imported.append(importlib.import_module(module.name).__name__)
print(json.dumps({
    "swarmavg": list(swarmavg.__path__),
    "peer": swarmavg.peer.__file__,
    "nat": swarmavg.peer.nat.__file__,
    "distributions": [
        str(d.locate_file("")) for d in importlib.metadata.distributions()
        if d.metadata["Name"] == "swarmavg"
    ],
    "version": importlib.metadata.version("swarmavg"),
    "finders": [repr(f) for f in sys.meta_path],
    "editable_modules": [m for m in sys.modules if "editable" in m.lower()],
    "path": sys.path,
    "imported": imported,
}))
"""
    found = json.loads(_run(installed.python, "-c", probe, cwd=tmp_path).stdout)
    site = str(installed.site)
    assert found["swarmavg"] == [f"{site}/swarmavg"]
    assert found["peer"] == f"{site}/swarmavg/peer/__init__.py"
    assert found["nat"] == f"{site}/swarmavg/peer/nat/__init__.py"
    assert found["distributions"] == [site]  # the editable install's metadata is not seen
    assert found["version"] == __version__
    assert not any("editable" in f.lower() for f in found["finders"])
    assert found["editable_modules"] == []
    assert "swarmavg.peer.daemon" in found["imported"]
    assert str(ROOT) not in json.dumps(found)  # nothing from the source tree


def test_version_from_the_wheel(installed: Installed, tmp_path: Path) -> None:
    result = _run(installed.swarmavg, "--version", cwd=tmp_path)
    assert result.stdout.strip() == f"swarmavg {__version__}"


@pytest.mark.parametrize("command", ["peer", "dht"])
def test_daemon_from_the_wheel_comes_up_and_stops_on_sigint(
    installed: Installed,
    command: str,
    tmp_path: Path,
    sock_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in LEAKY_ENV:  # ProcessPool starts its children with os.environ
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")
    control = sock_dir / f"{command}.sock"
    pool = ProcessPool(tmp_path)
    try:
        daemon = pool.start(
            [command, "--listen", "127.0.0.1:0", "--control", str(control)],
            executable=[str(installed.swarmavg)],
        )
        assert daemon.ready["event"] == "ready"
        assert daemon.address.startswith("127.0.0.1:")
        assert daemon.control == str(control)
        daemon.signal(signal.SIGINT)
        assert daemon.wait(timeout=30) == 0, daemon.stderr()
        assert "Traceback" not in daemon.stderr()
        assert not control.exists()  # removed on a clean shutdown
    finally:
        pool.close()
