"""`specd bootstrap-drafter`: build the default drafter from the target (options: bootstrap.py)."""

from __future__ import annotations

import argparse

from drafter_trainer import bootstrap


def run(args: argparse.Namespace) -> int:
    cfg = bootstrap.config_from_args(args.options)
    out = cfg.resolved_out_dir()
    if args.if_missing and (out / "specd_drafter.json").exists():
        print(f"[bootstrap] drafter already at {out}; nothing to do (drop --if-missing to rebuild)")
        return 0
    bootstrap.bootstrap_drafter(cfg)
    return 0


def add_cli(subparsers) -> None:
    own = bootstrap.build_arg_parser()
    p = subparsers.add_parser(
        "bootstrap-drafter",
        help="create the default drafter from the target (distilled on target-generated text)",
        description=own.description,
        epilog=own.format_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--if-missing", action="store_true", help="do nothing when the drafter already exists")
    p.add_argument("options", nargs=argparse.REMAINDER, help="bootstrap options (see below)")
    p.set_defaults(func=run)
