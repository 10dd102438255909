"""One PNG of the paired ratios (with their 95% intervals) of several `specd bench engine --json` files,
one marker per file and cell: how grids of the same cells under different options compare.

    python scripts/paired_ratio_plot.py out.png static=a.json continuous=b.json "queue, mixed=c.json"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specd.bench.report import cell_key, save_figure


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = argv[0], [arg.rsplit("=", 1) for arg in argv[1:]]
    rows = {label: {cell_key(r): r for r in json.loads(Path(path).read_text())["rows"]
                    if r.get("speedup_vs_target_only_paired")}
            for label, path in runs}
    cells = sorted({key for by_cell in rows.values() for key in by_cell})
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(cells) + 2), 4.5))
    width = 0.8 / max(len(rows), 1)
    for i, (label, by_cell) in enumerate(rows.items()):
        xs, ys, low, high = [], [], [], []
        for c, key in enumerate(cells):
            row = by_cell.get(key)
            if row is None:
                continue
            ratio = row["speedup_vs_target_only_paired"]
            ci = row.get("paired_ci95") or [ratio, ratio]
            xs.append(c + (i - (len(rows) - 1) / 2) * width)
            ys.append(ratio)
            low.append(ratio - ci[0])
            high.append(ci[1] - ratio)
        ax.errorbar(xs, ys, yerr=[low, high], fmt="o", capsize=3, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{w}\nb{b} T={t:g}" for w, b, t in cells], fontsize="small")
    ax.set_ylabel("tokens/s over target-only's (paired)")
    ax.set_title("specd-default over target-only, same run, 95% intervals")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    print(f"wrote {save_figure(fig, out)}")


if __name__ == "__main__":
    main(sys.argv[1:])
