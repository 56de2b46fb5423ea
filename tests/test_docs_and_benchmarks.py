"""docs/ stays a reference and benchmarks/ a curated set, checked on the files themselves.

- The benchmarks and the tests share only the package they both measure: no benchmark
  imports ``tests``, no test imports ``benchmarks`` (a test that covers a benchmark runs it
  as a module, as a user does), and no benchmark edits ``sys.path`` (each is run from the
  repository root as ``python -m benchmarks.<name>``).
- Every benchmark reproduces a table of docs/benchmarks.md, and every benchmark command in
  the docs names a script that exists.
- Neither the docs nor a comment or docstring cites a numbered work period or a number of
  the project's own tracker: a reader of the repository can open neither. History belongs
  in commit messages; an upstream issue is cited as ``owner/repo#N``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name not in ("__init__.py", "common.py"))
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
SOURCE_FOLDERS = ("proto", "compression", "dht", "averaging", "peer", "tests", "benchmarks")
HISTORY = re.compile(r"\b(?:sessions?|issues?) #?[0-9]+", re.IGNORECASE)
"""A numbered work period or tracker number: the word, a space, an optional ``#``, digits."""
COMMAND = re.compile(r"python -m benchmarks\.(\w+)")


def _sources() -> list[Path]:
    found = []
    for folder in SOURCE_FOLDERS:
        found += [
            p
            for p in sorted((ROOT / folder).rglob("*.py"))
            if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        ]
    return found


def _imported_packages(path: Path) -> set[str]:
    """The top-level names of every absolute import in ``path``, wherever it stands."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def test_the_benchmarks_import_nothing_from_the_tests() -> None:
    offenders = [p.name for p in BENCHMARKS.glob("*.py") if "tests" in _imported_packages(p)]
    assert offenders == []


def test_the_tests_import_nothing_from_the_benchmarks() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "tests").rglob("*.py"))
        if "benchmarks" in _imported_packages(p)
    ]
    assert offenders == []


def test_no_benchmark_edits_sys_path() -> None:
    def edits_path(path: Path) -> bool:
        return any(
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
        )

    assert [p.name for p in BENCHMARKS.glob("*.py") if edits_path(p)] == []


def test_every_benchmark_reproduces_a_table_of_the_docs() -> None:
    named = set(COMMAND.findall((ROOT / "docs" / "benchmarks.md").read_text()))
    assert SCRIPTS
    assert [p.stem for p in SCRIPTS if p.stem not in named] == []


def test_every_benchmark_command_in_the_docs_names_a_script() -> None:
    scripts = {p.stem for p in SCRIPTS}
    missing = [
        f"{doc.name}: benchmarks.{name}"
        for doc in DOCS
        for name in COMMAND.findall(doc.read_text())
        if name not in scripts
    ]
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_cite_no_work_period_or_tracker_number(doc: Path) -> None:
    lines = doc.read_text().splitlines()
    assert [f"{i}: {line}" for i, line in enumerate(lines, 1) if HISTORY.search(line)] == []


def test_no_comment_or_docstring_cites_a_work_period_or_tracker_number() -> None:
    found = []
    for path in _sources():
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for token in tokens:
            if token.type in (tokenize.COMMENT, tokenize.STRING) and HISTORY.search(token.string):
                found.append(f"{path.relative_to(ROOT)}:{token.start[0]}")
    assert found == []


OTHER_SOURCES = (
    "*.proto",
    "*.c",
    "*.pyi",
    "*.toml",
    "*.yaml",
    "*.service",
    "Dockerfile",
    "Makefile",
)
"""Text files beside the Python ones that carry comments: protobuf schemas, the C kernels,
deployment files, the build."""


def test_no_other_source_file_cites_a_work_period_or_tracker_number() -> None:
    folders = [ROOT / f for f in (*SOURCE_FOLDERS, "deploy", "examples", ".ci")]
    paths = [p for f in folders for pattern in OTHER_SOURCES for p in f.rglob(pattern)]
    paths += [ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "setup.py", ROOT / ".ci" / "run"]
    paths += [p for f in ("deploy", "examples") for p in (ROOT / f).rglob("*.py")]
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in sorted(set(paths))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert found == []
