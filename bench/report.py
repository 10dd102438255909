"""Rows, ratios, table, JSON and plot of `specd bench engine`.

The children report raw counts (bench/child.py); this module turns each (system, workload,
batch, temperature) cell into one row and adds the measured ratios: for every speculative specd row,
its tokens/s over target-only's and over vLLM autoregressive's for the same cell, from the same run.
Plain functions on dicts, so they are tested on tiny fake rows.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

Row = dict[str, Any]

TARGET_ONLY = "target-only"
VLLM_AR = "vllm"

# The cell a row belongs to: rows of one cell are compared with each other.
CellKey = tuple[str, int, float]


def cell_key(row: dict[str, Any]) -> CellKey:
    return (row["workload"], int(row["batch"]), float(row["temperature"]))


def make_row(system: str, cell: dict[str, Any], max_new_tokens: int, peak_rss_mb: float | None,
             speculative_specd: bool, load_s: float | None = None,
             warmup_s: float | None = None) -> dict[str, Any]:
    """One JSON row from a child's raw cell measurements."""
    wall = cell["wall_s"]
    generated = cell["generated_tokens"]
    # --continuous times a steady span (bench/steady.py): its rates are over the tokens emitted in it
    timed = cell.get("timed_tokens", generated)
    per_request = cell["request_ms_per_token"]
    drafted, steps = cell.get("drafted"), cell.get("steps")
    return {
        "system": system,
        "workload": cell["workload"],
        "batch": int(cell["batch"]),
        "temperature": float(cell["temperature"]),
        "num_prompts": cell["num_prompts"],
        "max_new_tokens": max_new_tokens,
        "requested_tokens": cell["requested_tokens"],
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": timed / wall if wall > 0 else None,
        "timed_tokens": timed,
        "ms_per_token_p50": statistics.median(per_request) if per_request else None,
        # No speculation, no acceptance: None rather than a misleading 0.
        "acceptance_rate": (cell["accepted"] / drafted) if drafted else None,
        "tokens_per_step": (cell["emitted"] / steps) if steps else None,
        "peak_rss_mb": peak_rss_mb,
        "load_s": load_s,
        "warmup_s": warmup_s,       # the untimed warm-ups (compiles, CUDA graph captures)
        # static-decode buckets the timed run used first, and the seconds of wall_s their first use took
        # (a CUDA graph capture each on a GPU); None where the engine has no static decoder's count
        "first_use_buckets": cell.get("first_use_buckets"),
        "first_use_s": cell.get("first_use_s"),
        # tokens/s over the wall time less those first uses: what a server that has met every bucket
        # would do (a long-running one has); beside tokens_per_s, never in its place
        "tokens_per_s_less_first_uses": _less_first_uses(cell, timed, wall),
        "speedup_vs_target_only_less_first_uses": None,
        "loadavg_1m_max": max(cell["loadavg"]) if cell.get("loadavg") else None,
        "other_cpus": cell.get("other_cpus"),
        "speculative_specd": speculative_specd,
        "speedup_vs_target_only": None,
        # --paired: over target-only run on the same groups in the same process, interleaved
        "speedup_vs_target_only_paired": _paired_speedup(cell, timed, wall),
        "paired_base_tokens_per_s": _paired_base_tps(cell),
        # 95% interval of the paired ratio over its groups (None with fewer than 3 groups)
        "paired_ci95": paired_interval(cell.get("paired_groups") or []),
        "paired_groups": cell.get("paired_groups"),
        "speedup_vs_vllm": None,
        "greedy_agreement_vs_target_only": None,
    }


def _less_first_uses(cell: dict[str, Any], timed: int, wall: float) -> float | None:
    first = cell.get("first_use_s")
    if first is None or wall - first <= 0:
        return None
    return timed / (wall - first)


def _paired_base_tps(cell: dict[str, Any]) -> float | None:
    base_wall, base_tokens = cell.get("paired_base_wall_s"), cell.get("paired_base_tokens")
    return base_tokens / base_wall if base_wall and base_tokens else None


def _paired_speedup(cell: dict[str, Any], generated: int, wall: float) -> float | None:
    base = _paired_base_tps(cell)
    if base is None or wall <= 0:
        return None
    return (generated / wall) / base


def paired_interval(groups: list[list[float]], level: float = 0.95) -> list[float] | None:
    """[low, high] of the paired ratio (system tokens/s over target-only's on the same groups): a
    Student-t interval on the groups' log ratios (their geometric mean ± t · s / √n, back in ratio
    terms). groups: [base wall s, base tokens, system wall s, system tokens] each; None below 3 groups.
    What one cell's ratio may be read as on a noisy machine: an interval across 1.0 says this run does
    not tell the two apart. (A bootstrap over 4-8 groups gave intervals far too narrow.)"""
    rows = [g for g in groups if min(g) > 0]
    if len(rows) < 3:
        return None
    import numpy as np
    from scipy import stats

    g = np.asarray(rows, dtype=float)                                        # [groups, 4]
    logs = np.log((g[:, 3] / g[:, 2]) / (g[:, 1] / g[:, 0]))                # [groups]
    half = stats.t.ppf(0.5 + level / 2, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs))
    return [float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))]


# Timings of one system's rounds (--rounds: fresh processes) that merge_rounds replaces by their median.
MEDIAN_FIELDS = ("tokens_per_s", "ms_per_token_p50", "speedup_vs_target_only_paired",
                 "paired_base_tokens_per_s", "peak_rss_mb", "load_s", "acceptance_rate",
                 "tokens_per_step", "tokens_per_s_less_first_uses")


def merge_rounds(rounds: list[Row]) -> Row:
    """One row from the same cell of one system run in several fresh processes (--rounds).

    Timings are the median over processes and `tokens_per_s_rounds` keeps each one: the same decoding
    in two processes differs by more than this machine's noise within one process (see
    `paired_base_vs_target_only`), so a ratio between processes is read against that spread.
    """
    if len(rounds) == 1:
        return {**rounds[0], "tokens_per_s_rounds": [rounds[0]["tokens_per_s"]], "tokens_per_s_spread": None}
    row = dict(rounds[0])
    for key in MEDIAN_FIELDS:
        values = [r[key] for r in rounds if r.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    for key in ("wall_s", "generated_tokens", "requested_tokens"):
        row[key] = sum(r[key] for r in rounds)
    loads = [r["loadavg_1m_max"] for r in rounds if r.get("loadavg_1m_max") is not None]
    row["loadavg_1m_max"] = max(loads) if loads else None
    others = [r["other_cpus"] for r in rounds if r.get("other_cpus") is not None]
    row["other_cpus"] = max(others) if others else None
    groups = [g for r in rounds for g in r.get("paired_groups") or []]
    row["paired_groups"] = groups or None
    row["paired_ci95"] = paired_interval(groups)
    tps = [r["tokens_per_s"] for r in rounds]
    row["tokens_per_s_rounds"] = tps
    # (max - min) / median over the processes: how far one process's figure may sit from another's
    row["tokens_per_s_spread"] = (max(tps) - min(tps)) / statistics.median(tps) if all(tps) else None
    return row


def add_ratios(rows: list[dict[str, Any]], outputs: dict[tuple[str, CellKey], list[list[int]]] | None = None):
    """Fill speedup_vs_target_only / speedup_vs_vllm on speculative specd rows (in place; returns rows).

    A ratio stays None when its baseline did not run for that cell. With `outputs` ({(system, cell):
    generated ids per request}), greedy rows also get the fraction of requests whose output equals
    target-only's: specd is lossless, so its speculative rows should agree (rare float ties aside).
    """
    tps = {(r["system"], cell_key(r)): r["tokens_per_s"] for r in rows}
    warm = {(r["system"], cell_key(r)): r.get("tokens_per_s_less_first_uses") for r in rows}
    for row in rows:
        key = cell_key(row)
        if row["speculative_specd"] and row["tokens_per_s"]:
            for baseline, field in ((TARGET_ONLY, "speedup_vs_target_only"), (VLLM_AR, "speedup_vs_vllm")):
                base = tps.get((baseline, key))
                row[field] = row["tokens_per_s"] / base if base else None
            mine, base = row.get("tokens_per_s_less_first_uses"), warm.get((TARGET_ONLY, key))
            row["speedup_vs_target_only_less_first_uses"] = mine / base if mine and base else None
        # The same decoding (speculation off) in this system's process over the target-only process: what
        # the two processes differ by, apart from speculation (1.0 if processes were alike).
        base, target_only = row.get("paired_base_tokens_per_s"), tps.get((TARGET_ONLY, key))
        row["paired_base_vs_target_only"] = base / target_only if base and target_only else None
        if outputs is not None and row["temperature"] == 0.0 and row["system"] != TARGET_ONLY:
            mine, ref = outputs.get((row["system"], key)), outputs.get((TARGET_ONLY, key))
            if mine and ref and len(mine) == len(ref):
                same = sum(a == b for a, b in zip(mine, ref, strict=True))
                row["greedy_agreement_vs_target_only"] = same / len(ref)
    return rows


def sort_rows(rows: list[dict[str, Any]], system_order: list[str]) -> list[dict[str, Any]]:
    rank = {name: i for i, name in enumerate(system_order)}
    return sorted(rows, key=lambda r: (*cell_key(r), rank.get(r["system"], len(rank))))


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


TABLE_COLUMNS = (
    ("system", "system", None, ""),
    ("workload", "workload", None, ""),
    ("batch", "batch", None, ""),
    ("T", "temperature", "g", ""),
    ("tok/s", "tokens_per_s", ".1f", ""),
    ("ms/tok p50", "ms_per_token_p50", ".1f", ""),
    ("α", "acceptance_rate", ".2f", ""),
    ("tokens/step", "tokens_per_step", ".2f", ""),
    ("RSS MB", "peak_rss_mb", ".0f", ""),
    ("vs target-only", "speedup_vs_target_only", ".2f", "x"),
    ("paired", "speedup_vs_target_only_paired", ".3f", "x"),
    ("paired 95%", "paired_ci95", "interval", ""),
    ("vs vLLM", "speedup_vs_vllm", ".2f", "x"),
    ("spread", "tokens_per_s_spread", ".0%", ""),
)


def table_cells(row: dict[str, Any], columns=TABLE_COLUMNS) -> list[str]:
    return [str(row[k]) if spec is None else _interval(row.get(k)) if spec == "interval"
            else _fmt(row.get(k), spec, sfx) for _, k, spec, sfx in columns]


def _interval(value: list[float] | None) -> str:
    return "-" if not value else f"{value[0]:.3f}-{value[1]:.3f}"


def markdown_table(rows: list[dict[str, Any]], columns=TABLE_COLUMNS) -> str:
    """The rows as a Markdown table, with the same column specs and formatting as render_table's
    (scripts/results_tables.py writes the docs' tables with it)."""
    lines = ["| " + " | ".join(header for header, *_ in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(table_cells(row, columns)) + " |")
    return "\n".join(lines)


def render_table(rows: list[dict[str, Any]], title: str = "specd bench engine"):
    """A rich Table; one section per (workload, batch, temperature) cell."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for header, key, spec, _ in TABLE_COLUMNS:
        table.add_column(header, justify="left" if spec is None and key != "batch" else "right")
    previous = None
    for row in rows:
        if previous is not None and cell_key(row) != previous:
            table.add_section()
        previous = cell_key(row)
        table.add_row(*table_cells(row))
    return table


def write_json(path: str | Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return path


def write_plot(path: str | Path, rows: list[Row], system_order: list[str], title: str = "") -> Path:
    """Grouped bars: one group per (workload, batch, temperature) cell, one bar per system, tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({cell_key(r) for r in rows})
    present = {r["system"] for r in rows}
    systems = [s for s in system_order if s in present] + sorted(present - set(system_order))
    tps = {(r["system"], cell_key(r)): r["tokens_per_s"] or 0.0 for r in rows}
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cells) + 2), 4.5))
    for i, system in enumerate(systems):
        xs = [c + (i - (len(systems) - 1) / 2) * width for c in range(len(cells))]
        ax.bar(xs, [tps.get((system, cell), 0.0) for cell in cells], width, label=system)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{w}\nbatch {b}, T={t:g}" for w, b, t in cells])
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title or "specd bench engine: tokens/s per system")
    ax.legend(fontsize="small", ncols=2)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Lay out, write the PNG (creating its folder) and free a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


# First uses of static-decode buckets taking this share of a cell's timed wall time are reported.
FIRST_USE_SHARE = 0.02


def first_use_warnings(rows: list[dict]) -> list[str]:
    """Cells whose timed run met static-decode buckets the warm-ups had not (each a CUDA graph capture on
    a GPU): their tokens/s include those first uses, which a long-running server pays once."""
    out = []
    for r in rows:
        seconds, wall = r.get("first_use_s"), r.get("wall_s") or 0.0
        if seconds and wall > 0 and seconds >= FIRST_USE_SHARE * wall:
            out.append(f"{r['system']} {r['workload']} batch {r['batch']}: {r['first_use_buckets']} decode "
                       f"buckets first used while timed took {seconds:.2f} s of its {wall:.2f} s")
    return out


# Other processes keeping this much of a CPU busy on average during a cell make its timing suspect.
OTHER_CPUS_BUSY = 0.25


def busy_warnings(rows: list[dict]) -> list[str]:
    """Whether anything besides the bench ran. The CPU time of other processes decides (other_cpus); the
    load average, which counts the bench's own threads, only where that was not measured."""
    others = [r["other_cpus"] for r in rows if r.get("other_cpus") is not None]
    if others:
        if max(others) <= OTHER_CPUS_BUSY:
            return []
        return [f"the machine was busy: other processes kept up to {max(others):.2f} CPUs busy during a "
                "cell: timings are unreliable"]
    loads = [r["loadavg_1m_max"] for r in rows if r.get("loadavg_1m_max") is not None]
    cpus = os.cpu_count() or 1
    if loads and max(loads) > cpus:
        return [f"the machine may have been busy (1-min load average up to {max(loads):.1f} on {cpus} CPUs, "
                "the bench's own threads included): timings may be unreliable"]
    return []
