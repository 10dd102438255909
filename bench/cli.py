"""`specd bench`: one parser whose sub-commands are the benchmarks, one module each.

A benchmark module has `add_arguments(parser)` and `run_bench(args) -> exit code`; this module gives it
its `specd bench <name>` parser and its stand-alone entry (`python -m bench.<name>`). The `specd` CLI
(cluster/cli.py) finds this module through the `specd.commands` entry point in pyproject.toml, so
nothing in cluster/ imports bench/.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

# name: (module, one-line help)
BENCHMARKS = {
    "engine": ("specd.bench.engine", "engine benchmark (no server): specd vs target-only, HF, vLLM"),
    "serve": ("specd.bench.serve", "load over gRPC: specd vs target-only, pipeline overlap, Ray overhead"),
    "osd": ("specd.bench.osd", "online distillation: acceptance over a shifting stream"),
    "chat": ("specd.bench.chat_heldout", "held-out chat through the server: fresh and after a stream"),
    "overhead": ("specd.bench.overhead", "host time of a step, free forwards: planning, bookkeeping, verify"),
    "frontends": ("specd.bench.frontends", "a streamed token's latency: OpenAI-compatible HTTP vs gRPC"),
    "soak": ("specd.bench.soak", "long run: N streaming clients for D minutes, errors, RSS, TPOT"),
    "first-start": ("specd.bench.first_start", "specd serve from an empty cache, timed phase by phase"),
}


def configure(parser: argparse.ArgumentParser, module: ModuleType) -> argparse.ArgumentParser:
    """A benchmark's arguments and entry on `parser`; its module docstring is the help text."""
    parser.description = module.__doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    module.add_arguments(parser)
    parser.set_defaults(func=module.run_bench)
    return parser


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks", description="specd benchmarks")
    bench.set_defaults(func=lambda _args: bench.print_help())
    bench_subparsers = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    for name, (module, help_text) in BENCHMARKS.items():
        configure(bench_subparsers.add_parser(name, help=help_text), importlib.import_module(module))


def run_alone(name: str, module: ModuleType, argv: list[str] | None = None) -> int:
    """One benchmark without the rest of the CLI (`python -m bench.<name>`, or a test)."""
    args = configure(argparse.ArgumentParser(prog=f"specd bench {name}"), module).parse_args(argv)
    return int(args.func(args) or 0)
