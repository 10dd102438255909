"""The `specd` command line: one sub-command per job, each registered by the module that owns it."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that own a sub-command expose `add_cli(subparsers)`; they are imported lazily by name so
# `specd --help` stays fast and one broken optional part (say, vLLM) does not take the CLI down.
_COMMAND_MODULES = (
    "cluster.serve",
    "cluster.demo",
    "cluster.bench_engine",
    "cluster.bench_serve",
    "drafter_trainer.cli",
    "cluster.trainer_actor",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specd",
        description="Speculative decoding, served, with drafters that learn online.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
