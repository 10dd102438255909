"""`specd bootstrap-drafter`: build the default drafter from the target (options: bootstrap.py)."""

from __future__ import annotations

import argparse

from specd.drafter_trainer import bootstrap
from specd.drafter_trainer.hidden_stage import bootstrap_hidden_drafter


def run(args: argparse.Namespace) -> int:
    cfg = bootstrap.config_from_options(vars(args))
    out, hidden_out = cfg.resolved_out_dir(), cfg.resolved_hidden_out_dir()
    have = (out / "specd_drafter.json").exists()
    have_hidden = not cfg.target_hidden or (hidden_out / "specd_drafter.json").exists()
    if args.if_missing and have and have_hidden:
        print(f"[bootstrap] drafters already at {out}; nothing to do (drop --if-missing to rebuild)")
        return 0
    if args.if_missing and have:
        print(f"[bootstrap] drafter at {out}; building only the second stage at {hidden_out}")
        bootstrap_hidden_drafter(cfg, out)
        return 0
    bootstrap.bootstrap_drafter(cfg)
    return 0


def add_cli(subparsers) -> None:
    own = bootstrap.build_arg_parser(add_help=False)
    p = subparsers.add_parser(
        "bootstrap-drafter",
        parents=[own],
        help="create the default drafters from the target (distilled on target-generated text)",
        description=own.description,
    )
    p.add_argument("--if-missing", action="store_true", help="do nothing when the drafters already exist")
    p.set_defaults(func=run)
