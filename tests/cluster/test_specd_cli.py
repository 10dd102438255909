"""The `specd` CLI: cluster's own commands plus every command another package declares in pyproject.toml."""

from __future__ import annotations

import tomllib
from pathlib import Path

from specd.cluster.cli import COMMAND_GROUP, build_parser, command_registrars

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared_entry_points() -> dict[str, str]:
    return tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"][COMMAND_GROUP]


def test_every_declared_command_is_installed():
    found = command_registrars()
    missing = set(declared_entry_points()) - set(found)
    assert not missing, f"entry points {sorted(missing)} are not installed: reinstall (`pip install -e .`)"
    for name, target in declared_entry_points().items():
        module, attr = target.split(":")
        assert (found[name].__module__, found[name].__name__) == (module, attr)


def test_commands_of_every_package_parse():
    parser = build_parser()
    assert parser.parse_args(["serve"]).command == "serve"
    assert parser.parse_args(["demo", "--max-new-tokens", "8"]).max_new_tokens == 8
    engine = parser.parse_args(["bench", "engine", "--quick"])
    assert (engine.command, engine.bench_command, engine.quick) == ("bench", "engine", True)
    serve = parser.parse_args(["bench", "serve", "--quick", "drafter.kind=ngram"])
    assert serve.bench_command == "serve" and serve.overrides == ["drafter.kind=ngram"]
    assert parser.parse_args(["bootstrap-drafter"]).command == "bootstrap-drafter"


def test_cluster_names_no_module_of_bench():
    # The rule the entry points exist for (the import-direction test checks every file).
    source = (PYPROJECT.parent / "cluster" / "cli.py").read_text()
    assert "bench." not in source and "import bench" not in source
