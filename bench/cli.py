"""`specd bench`: one parser whose sub-commands are the benchmarks, each added by the module that runs it.

The `specd` CLI (cluster/cli.py) finds this module through the `specd.commands` entry point in
pyproject.toml, so nothing in cluster/ imports bench/.
"""

from __future__ import annotations

import argparse

from bench import engine, osd, serve

# Each module exposes add_cli(bench_subparsers), which adds its own `specd bench <name>` parser.
BENCHMARKS = (engine, serve, osd)


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks", description="specd benchmarks")
    bench.set_defaults(func=lambda _args: bench.print_help())
    bench_subparsers = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    for module in BENCHMARKS:
        module.add_cli(bench_subparsers)
