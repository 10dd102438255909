"""Summarise a step trace (SPECD_STEP_TRACE, workers/engine/trace.py): median step, propose and verify
time and mean tokens emitted, by batch size and by how many tokens the step drafted.

    SPECD_STEP_TRACE=/tmp/steps.jsonl specd bench osd --arms suffix-frozen ...
    python scripts/step_trace.py /tmp/steps.jsonl [--json summary.json] [--batch 1] [--pid N]

Steps that asked no drafter (speculation off, or the guard or pause kept it) are the `plain` row;
`drafted 0` steps asked the drafter and got nothing. `--alone` keeps only the steps that overlapped no other
step of their process: one request in flight and nothing pipelined beside it (the held-out phases of
`specd bench chat`), where a step's time is its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def alone(lines: list[dict]) -> list[dict]:
    """The steps whose [started, started + step_s] meets no other step's interval in the same process."""
    keep = []
    for pid in dict.fromkeys(s["pid"] for s in lines):
        steps = sorted((s for s in lines if s["pid"] == pid), key=lambda s: s["started"])
        ends = [s["started"] + s["step_s"] for s in steps]
        reach = float("-inf")           # the latest end of the steps before this one
        for i, s in enumerate(steps):
            after = steps[i + 1]["started"] if i + 1 < len(steps) else float("inf")
            if s["started"] >= reach and ends[i] <= after:
                keep.append(s)
            reach = max(reach, ends[i])
    return keep


def summarise(lines: list[dict], batch: int | None = None, pid: int | None = None) -> list[dict]:
    """One row per (batch, drafted tokens in the step, or 'plain'), in that order; only the steps of one
    batch size and of one process (a server's router) where given."""
    groups: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for s in lines:
        if (batch is not None and s["batch"] != batch) or (pid is not None and s["pid"] != pid):
            continue
        kind = "plain" if not s["drafted"] else f"drafted {sum(s['drafted'])}"
        groups[(s["batch"], kind)].append(s)

    def order(key: tuple[int, str]) -> tuple[int, int]:
        b, kind = key
        return b, -1 if kind == "plain" else int(kind.split()[1])

    rows = []
    for key in sorted(groups, key=order):
        steps = groups[key]
        median_ms = {k: round(1000 * statistics.median(s[k] for s in steps), 1)
                     for k in ("step_s", "propose_s", "verify_s")}
        rows.append({"batch": key[0], "kind": key[1], "steps": len(steps),
                     "step_ms": median_ms["step_s"], "propose_ms": median_ms["propose_s"],
                     "verify_ms": median_ms["verify_s"],
                     "emitted": round(statistics.fmean(s["emitted"] for s in steps), 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--batch", type=int, default=None, help="only steps of this batch size")
    ap.add_argument("--pid", type=int, default=None,
                    help="only steps of this process (each server of `specd bench osd --arms` has its own)")
    ap.add_argument("--alone", action="store_true",
                    help="only steps that overlapped no other step of their process (nothing pipelined)")
    ap.add_argument("--min-steps", type=int, default=10, help="print only rows with at least this many steps")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    lines = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    pids = list(dict.fromkeys(s["pid"] for s in lines))
    print(f"{len(lines)} steps from processes {pids} (in order of their first step)")
    if args.alone:
        lines = alone(lines)
        print(f"{len(lines)} of them overlapped no other step")
    rows = summarise(lines, args.batch, args.pid)
    print("| batch | step | steps | ms/step | propose ms | verify ms | tokens emitted |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["steps"] >= args.min_steps:
            print(f"| {r['batch']} | {r['kind']} | {r['steps']} | {r['step_ms']} | {r['propose_ms']} | "
                  f"{r['verify_ms']} | {r['emitted']} |")
    if args.json is not None:
        summary = {"trace": str(args.trace), "steps": len(lines), "batch": args.batch, "pid": args.pid,
                   "alone": args.alone, "rows": rows}
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
