"""The `specd` command line: one sub-command per job, each registered by the package that owns it.

A module that owns sub-commands exposes `add_cli(subparsers)`. The CLI loads cluster's own such modules
by name; every other package declares its modules as entry points of the `specd.commands` group in
pyproject.toml (`name = "module:add_cli"`), which the CLI finds in the installed package's metadata.
So cluster/ names no module of bench/ (which registers `specd bench` and `specd demo` this way). A new
entry point shows up once the package is installed again (`pip install -e .`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from importlib.metadata import distributions

from specd.cluster.console import quiet_native_libraries

COMMAND_GROUP = "specd.commands"
# cluster's own command modules, in the order `specd --help` lists them (before the entry points).
_CLUSTER_COMMANDS = (
    "specd.cluster.serve", "specd.cluster.client_cli", "specd.cluster.admin", "specd.cluster.trainer_actor",
    "specd.cluster.models_cli",
)

AddCli = Callable[[argparse._SubParsersAction], None]


def command_registrars() -> dict[str, AddCli]:
    """{name: add_cli} of cluster's modules, then of the installed `specd.commands` entry points."""
    found: dict[str, AddCli] = {name: importlib.import_module(name).add_cli for name in _CLUSTER_COMMANDS}
    # Every copy of the metadata, not entry_points(), which keeps only the first distribution of a name:
    # an old specd.egg-info left in the source tree would hide the installed entry points.
    for dist in distributions():
        for ep in dist.entry_points.select(group=COMMAND_GROUP):
            if ep.name not in found:
                found[ep.name] = ep.load()
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specd",
        description="Speculative decoding, served, with drafters that learn online.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_cli in command_registrars().values():
        add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["serve"] and "--verbose" not in words and "server.verbose=true" not in words:
        # before any command module imports grpc: gRPC core reads these once (cluster/console.py)
        quiet_native_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
