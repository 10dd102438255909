"""Imports point one way: nothing in cluster/ or workers/ imports bench/; workers/ imports neither cluster/
nor drafter_trainer/; the algorithm core (workers/core) imports no Ray, gRPC or Redis."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

RULES = {
    "cluster": ("bench",),
    "workers": ("bench", "cluster", "drafter_trainer"),
    "workers/core": ("bench", "cluster", "drafter_trainer", "ray", "grpc", "redis"),
}


def imported_modules(path: Path) -> set[str]:
    """Every absolutely imported module of a file, wherever in the file the import appears."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def imported_top_levels(path: Path) -> set[str]:
    """The package each import names: specd's own by their folder (specd.workers.x -> workers)."""
    parts = [m.split(".") for m in imported_modules(path)]
    return {p[1] if p[0] == "specd" and len(p) > 1 else p[0] for p in parts}


@pytest.mark.parametrize("package", sorted(RULES))
def test_imports_point_one_way(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files
    wrong = {
        str(f.relative_to(REPO)): sorted(imported_top_levels(f) & set(RULES[package]))
        for f in files
        if imported_top_levels(f) & set(RULES[package])
    }
    assert not wrong, f"{package}/ may not import {RULES[package]}: {wrong}"


@pytest.mark.parametrize("package", ["workers/core", "workers/models", "workers/drafters"])
def test_models_and_drafters_do_not_import_the_engine(package):
    # the engine composes models and drafters; a drafter that ran through the engine's runner was the
    # one arrow up (issue 57), so ModelRunner lives in workers/models
    engine = "specd.workers.engine"
    wrong = {str(f.relative_to(REPO)): sorted(m for m in imported_modules(f) if m.startswith(engine))
             for f in sorted((REPO / package).rglob("*.py"))}
    assert not {f: m for f, m in wrong.items() if m}


PACKAGES = ["workers", "cluster", "drafter_trainer", "bench", "proto", "configs"]


@pytest.mark.parametrize("package", PACKAGES)
def test_tests_import_the_real_packages(package):
    # specd.<folder> is the repository's folder (the editable install maps it there), never a tests/ dir
    module = importlib.import_module(f"specd.{package}")
    assert module.__file__ == str(REPO / package / "__init__.py")


def test_nothing_imports_the_folders_by_their_bare_names():
    # installed, the folders exist only as specd.<folder>: PyPI distributions own the bare names
    files = [f for top in [*PACKAGES, "tests", "scripts"] for f in sorted((REPO / top).rglob("*.py"))]
    bare = {str(f.relative_to(REPO)): sorted(m for m in imported_modules(f) if m.split(".")[0] in PACKAGES)
            for f in files}
    assert not {f: m for f, m in bare.items() if m}


def test_pyproject_installs_every_package_under_specd():
    with open(REPO / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    found = sorted("specd." + ".".join(init.parent.relative_to(REPO).parts)
                   for top in PACKAGES for init in (REPO / top).rglob("__init__.py"))
    assert sorted(setuptools["packages"]) == found
    assert setuptools["package-dir"] == {f"specd.{top}": top for top in PACKAGES}


def _runtime_imports(path: Path) -> set[str]:
    """specd modules a file imports at run time (function-level imports included; `if TYPE_CHECKING:`
    blocks left out: they never execute)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
               for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specd."):
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("specd.")}
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return "specd." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# bench/ still has three parent <-> mode-module pairs (serve/serve_vllm, osd/osd_arms,
# overhead/overhead_router): each parent dispatches to the mode lazily and the mode reuses its helpers
CYCLE_FREE = ["cluster", "workers", "drafter_trainer", "configs", "proto"]


@pytest.mark.parametrize("package", CYCLE_FREE)
def test_no_import_cycles_between_files(package):
    files = sorted((REPO / package).rglob("*.py"))
    graph = {_module_name(f): _runtime_imports(f) for f in files}
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    cycles = []

    def visit(module: str, path: list[str], seen: set[str]) -> None:
        for dep in sorted(graph[module]):
            if dep in path:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in seen:
                seen.add(dep)
                visit(dep, [*path, dep], seen)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            done.add(module)
            visit(module, [module], done)
    assert not cycles, f"import cycles in {package}/: {cycles[:3]}"
