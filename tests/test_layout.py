"""The code layout as documented and packaged: docs/ARCHITECTURE.md's table names every module in
packer/, and pyproject.toml lists every subpackage (a wheel holds only the packages listed)."""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "packer"


def modules() -> set[str]:
    """packer/'s sources, as paths relative to the repository (package __init__ files aside)."""
    return {
        str(f.relative_to(ROOT))
        for f in PACKAGE.rglob("*")
        if f.suffix in (".py", ".c", ".h") and f.name != "__init__.py" and "__pycache__" not in f.parts
    }


def test_architecture_layout_table_names_every_module() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text[text.index("## Code layout") :]
    table = table[: table.index("\n## ", 1)]
    listed = set()
    for row in table.splitlines():
        cell = row.split("|")[1] if row.startswith("| `") else ""
        folder = ""
        for name in re.findall(r"`([^`]+)`", cell):  # `packer/transform/a.py`, `b.py`: b.py is in the same folder
            if name.startswith("packer/"):
                folder = name.rsplit("/", 1)[0]
                listed.add(name.rstrip("/"))
            else:
                listed.add(f"{folder}/{name}")
    folders = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert modules() - listed == set(), "modules missing from the code-layout table"
    assert listed - modules() - folders == set(), "the code-layout table names modules that do not exist"


def test_every_subpackage_is_packaged() -> None:
    line = re.search(r"^packages = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M)  # no tomllib on 3.10
    assert line, "pyproject.toml lists the packages in [tool.setuptools]"
    packages = re.findall(r'"([^"]+)"', line.group(1))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert set(packages) == found


def test_distribution_name_is_written_once_in_code() -> None:
    """pyproject's name is the one packer's messages tell users to install (packer._version.DISTRIBUTION)."""
    from packer._version import DISTRIBUTION

    name = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert name and name.group(1) == DISTRIBUTION


def _branches_on(names: str, allowed: list[Path]) -> list[str]:
    """Lines of packer/ outside ``allowed`` (files, or folders) that compare a string to one of
    ``names`` (a regex alternation)."""
    branch = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    return [
        f"{f.relative_to(ROOT)}: {line.strip()}"
        for f in PACKAGE.rglob("*.py")
        if not any(f == a or a in f.parents for a in allowed)
        for line in f.read_text().splitlines()
        if branch.search(line)
    ]


def test_one_backend_table_and_no_branch_on_a_backend_name() -> None:
    """packer.backends' table names the backends a manifest may name, and only packer/backends/
    compares a backend's name (every other module looks the backend up in the table)."""
    from packer import format
    from packer.backends import BACKENDS

    assert tuple(BACKENDS) == tuple(format.LAYOUTS)
    assert all(name == b.name for name, b in BACKENDS.items())
    assert all(isinstance(b, type(format.LAYOUTS[name])) for name, b in BACKENDS.items())  # a backend is its layout
    assert _branches_on("lmdb|memmap", [PACKAGE / "backends"]) == []


def test_one_format_table_and_no_branch_on_a_format_name() -> None:
    """packer.format.records' table holds each record format's encode, decode and checks, and no
    other module compares a format's name (each looks the format up in the table)."""
    from packer.format.records import FORMATS

    assert all(name == f.name for name, f in FORMATS.items())
    assert _branches_on("jpeg|raw", [PACKAGE / "format" / "records.py"]) == []


def _cycles(graph: object) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):  # type: ignore[attr-defined]
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):  # type: ignore[attr-defined]
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle() -> None:
    """No packer module reaches itself through the imports that run, those inside functions included
    (grimp's graph, the one import-linter checks the layers of in ``make lint``): an import placed in a
    function to dodge a cycle would show here, and so would one placed under ``TYPE_CHECKING``."""
    grimp = pytest.importorskip("grimp")
    assert _cycles(grimp.build_graph("packer")) == []


def documented_names() -> set[str]:
    """Every dotted ``packer.`` name the README and docs/ write (``packer.read.rng.generator()``,
    ``from packer.builder.dask import build_dask``): the paths a user copies."""
    names: set[str] = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for module, imported in re.findall(r"from (packer(?:\.\w+)*) import \(?([\w, ]+)", text):
            names.update(f"{module}.{name.strip()}" for name in imported.split(",") if name.strip())
        names.update(re.findall(r"(?<![\w/.-])packer(?:\.[A-Za-z_]\w*)+", text))
    return names


def test_every_documented_path_imports() -> None:
    """A name the docs give resolves where they say (no re-export shims keep old paths alive: a
    module that moves takes its docs with it)."""
    missing: list[str] = []
    absent = object()
    for name in sorted(documented_names()):
        parts = name.split(".")
        target: object = importlib.import_module("packer")
        for k in range(1, len(parts)):
            module = ".".join(parts[: k + 1])
            if not hasattr(target, parts[k]) and isinstance(target, types.ModuleType):
                try:
                    importlib.import_module(module)
                except ModuleNotFoundError as e:
                    if e.name != module:
                        raise
            target = getattr(target, parts[k], absent)
            if target is absent:
                missing.append(name)
                break
    assert len(documented_names()) > 20 and missing == []
