"""Imports point one way: nothing in cluster/ or workers/ imports bench/; workers/ imports neither cluster/
nor drafter_trainer/; the algorithm core (workers/core) imports no Ray, gRPC or Redis."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

RULES = {
    "cluster": ("bench",),
    "workers": ("bench", "cluster", "drafter_trainer"),
    "workers/core": ("bench", "cluster", "drafter_trainer", "ray", "grpc", "redis"),
}


def imported_top_levels(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file, wherever in the file it appears."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


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


@pytest.mark.parametrize("package", ["workers", "cluster", "drafter_trainer", "bench", "proto", "configs"])
def test_tests_import_the_real_packages(package):
    # tests/<package> directories have no __init__.py: they must never stand in for the package itself
    # (pytest's pythonpath puts the repository first, and a regular package wins over a namespace dir).
    module = __import__(package)
    assert module.__file__ == str(REPO / package / "__init__.py")
