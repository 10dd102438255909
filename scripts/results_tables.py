"""Write the results tables of README.md and docs/ from the JSON files in bench/results/.

    python scripts/results_tables.py           # rewrite every table between its markers
    python scripts/results_tables.py --check   # exit 1 when a table is not what its JSON says

A table sits between two marker comments; the first names the table's kind and its source files:

    <!-- table:engine-grid bench/results/engine-b1-lockstep-2026-11-26i.json -->
    ...generated...
    <!-- /table -->

Kinds (extra `key=value` words filter rows): engine-grid (the paired ratio of every speculative
specd system per workload x temperature row and batch column), engine-systems (one row per system
and cell: tok/s, α, tokens per step, ratios), serve (`specd bench serve` phases), osd (`specd bench
osd` held-out acceptance), osd-arms (`specd bench osd --arms`), soak (`specd bench soak`), overhead
(`specd bench overhead`: host ms per step and its phases), overhead-gpu and gpu-kernels (its real
cells on CUDA: GPU busy time, and the kernels that took it), serve-vllm (`specd bench serve --vllm`),
step-trace (`scripts/step_trace.py --json`: served steps by what they drafted).
tests/test_docs.py runs --check's logic.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run as a script from anywhere: import the checkout's bench

from specd.bench.report import cell_key, markdown_table  # noqa: E402

MARKER = re.compile(r"<!-- table:(?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- /table -->", re.S)

# Tokens per step, (accepted + recovered + bonus) / steps, is `tokens_per_step` in results; results
# written before that name hold the same figure as `mean_accepted_length`.
def tokens_per_step(row: dict) -> float:
    return row["tokens_per_step"] if "tokens_per_step" in row else row["mean_accepted_length"]


SYSTEM_COLUMNS = (
    ("system", "system", None, ""),
    ("workload", "workload", None, ""),
    ("batch", "batch", None, ""),
    ("T", "temperature", "g", ""),
    ("tok/s", "tokens_per_s", ".1f", ""),
    ("α", "acceptance_rate", ".2f", ""),
    ("tokens/step", "tokens_per_step", ".2f", ""),
    ("vs target-only", "speedup_vs_target_only", ".2f", "x"),
    ("paired", "speedup_vs_target_only_paired", ".3f", "x"),
    ("paired 95%", "paired_ci95", "interval", ""),
    ("greedy agreement", "greedy_agreement_vs_target_only", ".2f", ""),
)


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _load(root: Path, name: str):
    return json.loads((root / name).read_text())


def _filters(words: list[str]) -> tuple[list[str], dict[str, str]]:
    files = [w for w in words if "=" not in w]
    return files, dict(w.split("=", 1) for w in words if "=" in w)


def _keep(row: dict, where: dict[str, str]) -> bool:
    for key, value in where.items():
        have = row.get({"T": "temperature"}.get(key, key))
        if isinstance(have, (int, float)) and not isinstance(have, bool):
            ok = any(float(have) == float(v) for v in value.split(","))
        else:
            ok = str(have) in value.split(",")
        if not ok:
            return False
    return True


def engine_rows(root: Path, files: list[str], where: dict[str, str]) -> list[dict]:
    rows = []
    for name in files:
        rows += [r for r in _load(root, name)["rows"] if _keep(r, where)]
    return [{**r, "tokens_per_step": tokens_per_step(r)} if "mean_accepted_length" in r else r for r in rows]


def engine_grid(root: Path, files: list[str], where: dict[str, str]) -> str:
    """Rows workload x T (x system when several), columns batch: paired ratio [95%] (tokens/step)."""
    rows = [r for r in engine_rows(root, files, where) if r.get("speculative_specd")]
    systems = sorted({r["system"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    keys = sorted({(r["system"], r["workload"], r["temperature"]) for r in rows},
                  key=lambda k: (systems.index(k[0]), k[1], k[2]))
    by = {(r["system"], *cell_key(r)): r for r in rows}
    head = (["system"] if len(systems) > 1 else []) + ["workload", "T"] + [f"batch {b}" for b in batches]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for system, workload, temp in keys:
        cells = [system] if len(systems) > 1 else []
        cells += [workload, f"{temp:g}"]
        for b in batches:
            r = by.get((system, workload, b, temp))
            if r is None or r.get("speedup_vs_target_only_paired") is None:
                cells.append("-")
                continue
            ci = r.get("paired_ci95")
            interval = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
            cells.append(f"{r['speedup_vs_target_only_paired']:.3f}x{interval} "
                         f"({tokens_per_step(r):.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def engine_systems(root: Path, files: list[str], where: dict[str, str]) -> str:
    rows = engine_rows(root, files, where)
    columns = [c for c in SYSTEM_COLUMNS if any(r.get(c[1]) is not None for r in rows)]
    return markdown_table(rows, columns)


def serve(root: Path, files: list[str], where: dict[str, str]) -> str:
    lines = ["| file | phase | requests | tok/s | TTFT p50 | TPOT p50 | TPOT p90 | α | tokens/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for name in files:
        doc = _load(root, name)
        for phase, p in doc["phases"].items():
            drafted = p.get("drafted")
            lines.append(
                f"| `{Path(name).name}` | {phase} | {p['requests']} | {p['tokens_per_s']:.1f} | "
                f"{p['ttft_s']['p50']:.2f} s | {p['tpot_s']['p50'] * 1000:.0f} ms | "
                f"{p['tpot_s']['p90'] * 1000:.0f} ms | "
                + (f"{p['acceptance_rate']:.2f} | {tokens_per_step(p):.2f} |" if drafted
                   else "- | - |"))
        f = doc["figures"]
        text = f"`{Path(name).name}`: specd / target-only {f['speedup_specd_vs_target_only']:.3f}x"
        if f.get("speedup_median") is not None:
            rounds = ", ".join(f"{x:.2f}" for x in f["speedup_rounds"])
            text += (f"; median of {len(f['speedup_rounds'])} rounds {f['speedup_median']:.3f}x ({rounds}), "
                     f"TPOT p50 ratio median {f['tpot_p50_ratio_median']:.3f}")
        ratios.append(text + ".")
    return "\n".join(lines) + "\n\n" + "\n".join(ratios)


def osd(root: Path, files: list[str], where: dict[str, str]) -> str:
    lines = ["| file | held-out (γ = 3 chains) | GSM8K α | GSM8K first draft | HumanEval α | "
             "HumanEval first draft |", "|---|---|---|---|---|---|"]
    tails = []
    for name in files:
        doc = _load(root, name)
        for stage in ("before", "after", "final", "reference"):
            if doc[stage].get("gsm8k") is None:
                continue
            cells = []
            for domain in ("gsm8k", "humaneval"):
                for value, base in ((doc[stage][domain], doc["before"][domain]),
                                    (doc["first_position"][stage][domain],
                                     doc["first_position"]["before"][domain])):
                    delta = f" ({value - base:+.3f})" if stage in ("after", "final") else ""
                    cells.append(f"{value:.3f}{delta}")
            lines.append(f"| `{Path(name).name}` | {stage} | " + " | ".join(cells) + " |")
        t = doc["throughput_tokens_per_s"]
        on_off = (f"throughput trainer on / off {t['on']:.1f} / {t['off']:.1f} tok/s "
                  f"({doc['throughput_ratio_on_off']:.2f}x)" if t.get("off") else
                  f"throughput {t['on']:.1f} tok/s")
        m = doc["meta"]
        tails.append(f"`{Path(name).name}`: {m['requests_per_domain']} requests per domain, "
                     f"{doc['failed_requests']} failed, {on_off}, {m['duration_s'] / 60:.0f} min.")
    return "\n".join(lines) + "\n\n" + "\n".join(tails)


def osd_arms(root: Path, files: list[str], where: dict[str, str]) -> str:
    lines = ["| file | domain | arm | held-out speed-up before → after | α before → after | "
             "tokens/step before → after | stream α | stream tok/s | versions | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    tails = []
    for name in files:
        doc = _load(root, name)
        for domain, arms in doc["summary"].items():
            for arm, r in arms.items():
                if arm in ("b_over_a", "offline_over_a") or not _keep({"arm": arm, "domain": domain}, where):
                    continue
                lines.append(
                    f"| `{Path(name).name}` | {domain} | {arm} | {r['speedup_before']:.2f}x → "
                    f"{r['speedup_after']:.2f}x | {r['alpha_before']:.3f} → {r['alpha_after']:.3f} | "
                    f"{r['tokens_per_step_before']:.2f} → {r['tokens_per_step_after']:.2f} | "
                    f"{r['stream_alpha']:.3f} | {r['stream_tokens_per_s']:.1f} | {r['versions_published']} | "
                    f"{r['failed_requests']} |")
            if "b_over_a" in arms:
                b = arms["b_over_a"]
                tails.append(f"`{Path(name).name}`, {domain}: default-online / suffix-frozen held-out speed "
                             f"after {b['heldout_speed_after']:.2f}x, stream throughput "
                             f"{b['stream_throughput']:.2f}x.")
            if "offline_over_a" in arms:
                tails.append(f"`{Path(name).name}`, {domain}: offline-frozen / suffix-frozen held-out speed "
                             f"after {arms['offline_over_a']['heldout_speed_after']:.2f}x.")
        m = doc["meta"]
        tails.append(f"`{Path(name).name}`: {m['requests_per_domain']} stream requests, "
                     f"{m['heldout_per_phase']} held-out prompts before and {m['heldout_per_phase']} after, "
                     f"{m['max_new_tokens']} tokens, {m['clients']} clients, {m['duration_s'] / 60:.0f} min.")
    return "\n".join(lines) + "\n\n" + "\n".join(tails)


def soak(root: Path, files: list[str], where: dict[str, str]) -> str:
    out = []
    for name in files:
        doc = _load(root, name)
        out.append("| clients | minutes | requests | errors | tok/s | TPOT p50 | TPOT p99 |\n"
                   "|---|---|---|---|---|---|---|\n"
                   f"| {doc['clients']} | {doc['minutes']:g} | {doc['requests']} | {doc['errors']} | "
                   f"{doc['tokens_per_s']:.1f} | {doc['tpot_p50_ms']:.0f} ms | {doc['tpot_p99_ms']:.0f} ms |")
        rss = ["| process | RSS after warm-up (MiB) | largest after it | growth |", "|---|---|---|---|"]
        for proc, g in sorted(doc["rss_growth_after_warmup_mib"].items()):
            rss.append(f"| {proc} | {g['at_warmup_end']:.0f} | {g['max_after']:.0f} | {g['growth']:+.1f} |")
        out.append("\n".join(rss))
    return "\n\n".join(out)


def overhead(root: Path, files: list[str], where: dict[str, str]) -> str:
    """`specd bench overhead`: one row per cell, host ms per step and its phases (medians)."""
    lines = ["| forwards | where | system | batch | host ms/step | propose | verify | rest | tokens/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in files:
        for r in _load(root, name)["rows"]:
            if not _keep(r, where):
                continue
            p = r["phases_ms"]
            lines.append(f"| {r['forwards']} | {r['where']} | {r['system']} | {r['batch']} | "
                         f"{r['host_ms_per_step']:.2f} | {p['propose']:.2f} | {p['verify']:.2f} | "
                         f"{p['rest']:.2f} | {r['tokens_per_step']:.2f} |")
    return "\n".join(lines)


def overhead_gpu(root: Path, files: list[str], where: dict[str, str]) -> str:
    """The real-model cells of `specd bench overhead` on CUDA: the step's wall time beside the GPU's busy
    time (the kernels' own times, profiled over a few more steps). Several files: a first column names
    each one's run (its name without `gpu-overhead-` and the date)."""
    runs = len(files) > 1
    lines = [("| run " if runs else "")
             + "| system | batch | wall ms/step | GPU busy ms/step | GPU busy share | tokens/step |",
             ("|---" if runs else "") + "|---|---|---|---|---|---|"]
    for name in files:
        label = re.sub(r"^gpu-overhead-?|-?\d{4}-\d{2}-\d{2}[a-z]?$", "", Path(name).stem) or "-"
        for r in _load(root, name)["rows"]:
            if "gpu_busy_ms_per_step" not in r or not _keep(r, where):
                continue
            busy, wall = r["gpu_busy_ms_per_step"], r["wall_ms_per_step"]
            lines.append((f"| {label} " if runs else "") + f"| {r['system']} | {r['batch']} | {wall:.2f} | "
                         f"{busy:.2f} | {busy / wall:.0%} | {r['tokens_per_step']:.2f} |")
    return "\n".join(lines)


# Template arguments that name what an ATen kernel computes (a functor, an op), and wrappers around them.
WHAT = re.compile(r"\w*(?:_cuda|_impl|Functor\w*|Ops)\b")
WRAPPERS = {"gpu_kernel_impl", "gpu_kernel_impl_nocast", "AUnaryFunctor", "BinaryFunctor"}


def kernel_name(name: str) -> str:
    """A CUDA kernel's name without return type and namespaces, with the template argument that says
    what it computes (`unrolled_elementwise_kernel<direct_copy_kernel_cuda>`) where it has one."""
    name = re.sub(r"^(void|std::enable_if<[^>]*>::type)\s+", "", name)
    name = re.sub(r"at::native::|at::cuda::detail::|\(anonymous namespace\)::|c10::|\binternal::", "", name)
    if "(" in name and name.index("(") < name.find("<") or "<" not in name:
        return name.split("(", 1)[0]
    base, _, rest = name.partition("<")
    words = [w for w in WHAT.findall(rest) if w not in WRAPPERS]
    return f"{base}<{words[0]}>" if words else base


def gpu_kernels(root: Path, files: list[str], where: dict[str, str]) -> str:
    """The kernels that took most of a step's GPU time in the real-model cells of `specd bench overhead`
    on CUDA (their launches and microseconds per step), one block of rows per cell."""
    lines = ["| system | batch | kernel | launches/step | µs/step | share of busy |",
             "|---|---|---|---|---|---|"]
    for name in files:
        for r in _load(root, name)["rows"]:
            if "gpu_kernels" not in r or not _keep(r, where):
                continue
            busy_us = 1000 * r["gpu_busy_ms_per_step"]
            for k in r["gpu_kernels"]:
                lines.append(f"| {r['system']} | {r['batch']} | `{kernel_name(k['name'])}` | "
                             f"{k['launches_per_step']:g} | {k['us_per_step']:.0f} | "
                             f"{k['us_per_step'] / busy_us:.0%} |")
    return "\n".join(lines)


def overhead_targets(root: Path, files: list[str], where: dict[str, str]) -> str:
    """Runs of `specd bench overhead` against issue 38's bounds on this CPU: per cell each run's time
    beyond target-only (target-only's own step for target-only), and whether every run is within bound."""
    bounds = {("in-process", 1): 1.0, ("in-process", 16): 3.0, ("router", 1): 3.0}
    runs: dict[tuple, list[float]] = {}
    for name in files:
        rows = [r for r in _load(root, name)["rows"] if r["forwards"] == "free" and _keep(r, where)]
        base = {(r["where"], r["batch"]): r["host_ms_per_step"] for r in rows if r["system"] == "target-only"}
        for r in rows:
            key = (r["where"], r["system"], r["batch"])
            own = r["host_ms_per_step"]
            beyond = own if r["system"] == "target-only" else own - base[r["where"], r["batch"]]
            runs.setdefault(key, []).append(beyond)
    lines = ["| where | system | batch | ms beyond target-only, per run | bound | within |",
             "|---|---|---|---|---|---|"]
    for (place, system, batch), values in runs.items():
        bound = (0.3 if (place, batch) == ("in-process", 1) else None) if system == "target-only" \
            else bounds.get((place, batch))
        if bound is None:
            continue
        label = "own step" if system == "target-only" else "beyond"
        within = "yes" if all(v <= bound for v in values) else "no"
        lines.append(f"| {place} | {system} | {batch} | {', '.join(f'{v:.2f}' for v in values)} ({label}) | "
                     f"≤ {bound:g} | {within} |")
    return "\n".join(lines)


def overhead_ab(root: Path, files: list[str], where: dict[str, str]) -> str:
    """Two sets of `specd bench overhead` runs of the same cells, interleaved on one machine: the files
    whose name holds "-before-" or "-pre-" against the others. Per cell the median of each set's runs,
    the factor, and each set's time beyond target-only at the same batch size and place."""
    runs: dict[tuple, dict[bool, list[float]]] = {}
    tokens: dict[tuple, dict[bool, list[float]]] = {}
    for name in files:
        before = "-before-" in name or "-pre-" in name
        for r in _load(root, name)["rows"]:
            if _keep(r, where):
                key = (r["where"], r["system"], r["batch"])
                runs.setdefault(key, {True: [], False: []})[before].append(r["host_ms_per_step"])
                tokens.setdefault(key, {True: [], False: []})[before].append(r["tokens_per_step"])
    med = {k: {side: statistics.median(v) for side, v in sides.items() if v} for k, sides in runs.items()}
    header = ("| where | system | batch | before ms | after ms | factor | beyond target-only before → after "
              "| tokens/step before → after |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for (place, system, batch), m in med.items():
        if True not in m or False not in m:
            continue
        base = med.get((place, "target-only", batch), {})
        beyond = (f"{m[True] - base[True]:.2f} → {m[False] - base[False]:.2f}"
                  if system != "target-only" and True in base and False in base else "")
        t = {side: statistics.median(v) for side, v in tokens[(place, system, batch)].items()}
        lines.append(f"| {place} | {system} | {batch} | {m[True]:.2f} | {m[False]:.2f} | "
                     f"{m[True] / m[False]:.1f}x | {beyond} | {t[True]:.2f} → {t[False]:.2f} |")
    return "\n".join(lines)


def serve_vllm(root: Path, files: list[str], where: dict[str, str]) -> str:
    """`specd bench serve --vllm`: one row per server and client count, ratios to vLLM alone."""
    lines = ["| server | clients | tok/s | TPOT p50 ms | TPOT p99 ms | α | tokens/step | vs vLLM alone |",
             "|---|---|---|---|---|---|---|---|"]
    for name in files:
        data = _load(root, name)
        for row in data["phases"].values():
            if not _keep(row, where):
                continue
            ratio = data["figures"].get(f"{row['system']}_vs_vllm_c{row['clients']}")
            drafted = row["system"] != "vllm"
            alpha = f"{row['acceptance_rate']:.2f}" if drafted else "-"
            per_step = f"{row['tokens_per_step']:.2f}" if drafted else "-"
            lines.append(f"| {row['system']} | {row['clients']} | {row['tokens_per_s']:.1f} | "
                         f"{1000 * row['tpot_s']['p50']:.1f} | {1000 * row['tpot_s']['p99']:.1f} | "
                         f"{alpha} | {per_step} | {'-' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(lines)


def step_trace(root: Path, files: list[str], where: dict[str, str]) -> str:
    """`python scripts/step_trace.py --json`: per kind of step (plain, or tokens drafted) with at least 10
    steps, median ms per step, propose and verify, mean tokens emitted, and those tokens per second of
    step time."""
    lines = ["| file | batch | step | steps | ms/step | propose ms | verify ms | tokens emitted | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in files:
        for r in _load(root, name)["rows"]:
            if r["steps"] < 10 or not _keep(r, where):
                continue
            lines.append(f"| `{Path(name).name}` | {r['batch']} | {r['kind']} | {r['steps']} | "
                         f"{r['step_ms']:.1f} | {r['propose_ms']:.1f} | {r['verify_ms']:.1f} | "
                         f"{r['emitted']:.2f} | {1000 * r['emitted'] / r['step_ms']:.1f} |")
    return "\n".join(lines)


def chat(root: Path, files: list[str], where: dict[str, str]) -> str:
    """`specd bench chat --json`: held-out chat through the server, fresh and after the stream."""
    lines = ["| file | configuration | phase | speed-up | median | specd / target-only tok/s | "
             "drafted/step | α | stream tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name in files:
        doc = _load(root, name)
        config = " ".join(doc["meta"]["overrides"]) or "default"
        if doc["meta"].get("server_tree"):       # another checkout's server, side by side (issue 61)
            config = f"{doc['meta']['server_commit']} {config}"
        if doc["meta"].get("beside_load"):        # bench/idle_load.py beside the server
            config = f"{config}, idle load {doc['meta']['beside_load']:.0%}"
        for phase in ("fresh", "after"):
            r = doc[phase]
            stream = f"{doc['stream']['tokens_per_s']:.1f}" if phase == "after" else ""
            tps = f"{r['on_tokens_per_s']:.1f} / {r['off_tokens_per_s']:.1f}"
            lines.append(f"| `{Path(name).name}` | {config} | {phase} | {r['speedup']:.3f}x | "
                         f"{r['speedup_median']:.3f}x | {tps} | {r['drafted_per_step']:.2f} | "
                         f"{r['acceptance_rate']:.2f} | {stream} |")
    return "\n".join(lines)


KINDS = {"engine-grid": engine_grid, "engine-systems": engine_systems, "serve": serve, "osd": osd,
         "osd-arms": osd_arms, "soak": soak, "overhead": overhead, "overhead-ab": overhead_ab,
         "overhead-gpu": overhead_gpu, "gpu-kernels": gpu_kernels, "overhead-targets": overhead_targets,
         "serve-vllm": serve_vllm, "step-trace": step_trace, "chat": chat}


def sources(spec: str) -> list[str]:
    """The result files a marker's spec names."""
    return _filters(spec.split()[1:])[0]


def render_table(spec: str, root: Path = ROOT) -> str:
    kind, *words = spec.split()
    if kind not in KINDS:
        raise SystemExit(f"unknown table kind {kind!r}; known: {', '.join(KINDS)}")
    files, where = _filters(words)
    return KINDS[kind](root, files, where)


def render(text: str, root: Path = ROOT) -> str:
    """text with every table between markers regenerated."""
    def one(m: re.Match) -> str:
        return f"<!-- table:{m['spec']} -->\n{render_table(m['spec'], root)}\n<!-- /table -->"

    return MARKER.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = []
    for path in doc_files():
        current = path.read_text()
        wanted = render(current)
        if current != wanted:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(wanted)
    if args.check and stale:
        print(f"stale tables in {', '.join(map(str, stale))}: run python scripts/results_tables.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
