"""The package layout's rules (docs/architecture.md), checked on the source itself.

- No import cycle between modules, counting imports under ``TYPE_CHECKING`` and inside
  functions: a cycle hidden from the interpreter still ties two modules together.
- Packages import only downward: proto <- compression <- dht <- averaging <- peer.
- No module imports another module's private (underscore) names.
- Inside ``peer``, each room (client, daemon, monitor, cli, nat) imports only the rooms it
  builds on: the client none, the daemon never the monitor or the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proto", "compression", "dht", "averaging", "peer")
RANK = {name: i for i, name in enumerate(PACKAGES)}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["swarmavg", *parts])


def _sources() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                found[_module_name(path)] = path
    return found


MODULES = _sources()


def _imports(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every swarmavg import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("swarmavg.")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("swarmavg"):
                continue
            names = [a.name for a in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            out += [(sub, [], node.lineno) for sub in submodules]
            rest = [n for n in names if f"{base}.{n}" not in MODULES]
            if rest:
                out.append((base, rest, node.lineno))
    return out


GRAPH = {
    module: {target for target, _, _ in _imports(module, path) if target in MODULES}
    for module, path in MODULES.items()
}


def _cycle() -> list[str] | None:
    """One import cycle between distinct modules, or None (package ``__init__`` re-exports
    of their own submodules are not edges back: importing ``a.b`` runs ``a`` first anyway)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(GRAPH[module]):
            if module.startswith(target + ".") or target.startswith(module + "."):
                continue
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle() -> None:
    assert _cycle() is None


def test_sources_found() -> None:
    # The checks below mean nothing if the walk found nothing.
    assert "swarmavg.averaging.allreduce.runner" in MODULES
    assert "swarmavg.peer.daemon.daemon" in MODULES
    assert GRAPH["swarmavg.peer.daemon.daemon"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_downward(module: str) -> None:
    own = RANK[module.split(".")[1]]
    upward = [
        (target, line)
        for target, _, line in _imports(module, MODULES[module])
        if target.split(".")[1] in RANK and RANK[target.split(".")[1]] > own
    ]
    assert upward == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_from_another_module(module: str) -> None:
    private = [
        (target, name, line)
        for target, names, line in _imports(module, MODULES[module])
        for name in names
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    # Importing a private C extension module of one's own package is its normal use.
    private = [p for p in private if p[1] != "_native"]
    assert private == []


# What a training process that only talks to its daemon must never load: the engine
# (all-reduce, matchmaking, state sharing, the averager), the DHT and its crypto. Loading
# them costs start-up time and memory in every trainer, and ties the client to the daemon.
ENGINE_PREFIXES = (
    "swarmavg.averaging.allreduce",
    "swarmavg.averaging.matchmaking",
    "swarmavg.averaging.state",
    "swarmavg.averaging.averager",
    "swarmavg.averaging.service",
    "swarmavg.dht",
    "swarmavg.peer.daemon",
    "nacl",
    "cryptography",
)

CLIENT_IMPORTS = """
import sys
from swarmavg.peer import connect, connect_async, SwarmError, NoGroupError
from swarmavg.averaging import AveragingError
from swarmavg.averaging.optim import CollaborativeOptimizer, DiLoCo, StreamingDiLoCo
print("\\n".join(sorted(sys.modules)))
"""


@pytest.mark.timeout(60)
def test_client_and_wrappers_load_no_engine() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", CLIENT_IMPORTS], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "swarmavg.peer.client.client" in loaded  # else the import failed early
    engine = [m for m in loaded if m.startswith(ENGINE_PREFIXES)]
    assert engine == []


# The wrappers run in the training process, the daemon in its own: daemon code (and any
# module outside the training package and its public entry, averaging/optim.py) reads a
# run's records through averaging/run_records, never through the training package.
TRAINING = "swarmavg.averaging.training"


@pytest.mark.parametrize(
    "module",
    sorted(m for m in MODULES if not m.startswith(TRAINING) and m != "swarmavg.averaging.optim"),
)
def test_only_the_wrappers_import_the_training_package(module: str) -> None:
    into_training = [
        (target, line)
        for target, _, line in _imports(module, MODULES[module])
        if target == TRAINING or target.startswith(TRAINING + ".")
    ]
    assert into_training == []


# peer/'s rooms and the rooms each may import besides its own (docs/architecture.md). The
# client is what every training process loads: it imports no other room, so a trainer never
# loads the daemon, the monitor or the CLI. The daemon imports the client's framing (shared
# memory, tensors, endpoints), never the monitor or the CLI; the monitor reads what daemons
# publish; the CLI sits on top. Every room may import the package's shared modules
# (version, logs), which import no room; the facade ``swarmavg.peer`` (peer/__init__.py)
# re-exports the rooms and is imported by none of them.
PEER_ROOMS: dict[str, set[str]] = {
    "client": set(),
    "nat": set(),
    "daemon": {"client", "nat"},
    "monitor": {"client", "daemon"},
    "cli": {"client", "daemon", "monitor"},
}
PEER_SHARED = ("swarmavg.peer.logs", "swarmavg.peer.version")


def _room(module: str) -> str | None:
    """A ``swarmavg.peer`` module's room, "shared" or "facade"; None outside the package."""
    parts = module.split(".")
    if parts[:2] != ["swarmavg", "peer"]:
        return None
    if len(parts) == 2:
        return "facade"
    return parts[2] if parts[2] in PEER_ROOMS else "shared"


def test_every_peer_module_is_in_a_room_or_shared() -> None:
    # The room rule below means nothing if a room is empty, and a module beside the rooms
    # escapes it unless it is one of the few shared ones.
    for room in PEER_ROOMS:
        assert f"swarmavg.peer.{room}" in MODULES
        assert [m for m in MODULES if m.startswith(f"swarmavg.peer.{room}.")]
    assert sorted(m for m in MODULES if _room(m) == "shared") == sorted(PEER_SHARED)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _room(m) not in (None, "facade")))
def test_peer_rooms_import_only_the_rooms_they_build_on(module: str) -> None:
    own = _room(module)
    allowed = {own, "shared", *PEER_ROOMS.get(own or "", set())}
    crossing = [
        (target, line)
        for target, _, line in _imports(module, MODULES[module])
        if _room(target) is not None and _room(target) not in allowed
    ]
    assert crossing == []


# tests/ mirrors the source: a folder of tests is named after the subpackage it tests, so a
# reader finds a module's tests where the module is. tests/training holds the tests of the
# training package (averaging/training).
TEST_TREES = {
    "tests/averaging": "averaging",
    "tests/training": "averaging/training",
    "tests/peer": "peer",
    "tests/dht": "dht",
    "tests/compression": "compression",
}


def _subfolders(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


@pytest.mark.parametrize("tests", sorted(TEST_TREES))
def test_every_test_folder_is_named_after_a_subpackage(tests: str) -> None:
    source = _subfolders(ROOT / TEST_TREES[tests])
    assert _subfolders(ROOT / tests) - source == set()


def test_peer_tests_sit_in_the_room_they_test() -> None:
    # Beside the rooms sit only the tests of the package's shared modules (test_logs.py for
    # peer/logs.py) and helpers; a test of a room's module goes in that room's folder.
    peer_tests = ROOT / "tests" / "peer"
    assert _subfolders(peer_tests) <= set(PEER_ROOMS)
    shared = {f"test_{m.rpartition('.')[2]}.py" for m in PEER_SHARED}
    assert {p.name for p in peer_tests.glob("test_*.py")} <= shared
    # A room's folder holds its tests, so the walk above is not vacuous.
    assert list((peer_tests / "daemon").glob("test_*.py"))


def test_the_framework_integrations_are_tested_in_their_folder() -> None:
    integrations = f"{TRAINING}.integrations"
    outside = [
        path.name
        for path in sorted((ROOT / "tests" / "training").glob("*.py"))
        if integrations in path.read_text()
        or "averaging.training import integrations" in path.read_text()
    ]
    assert outside == []
    assert list((ROOT / "tests" / "training" / "integrations").glob("test_*.py"))
