"""Print the top of every cProfile .pstats in a folder, by cumulative and by own time.

    python scripts/pstats_summary.py DIR [N]

`specd bench overhead --profile DIR` writes one file per cell; on a GPU a function that waits for the
device (a host read: .item(), .tolist(), .cpu()) shows its wait as its own time here.
"""

import io
import pstats
import sys
from pathlib import Path


def summary(path: Path, n: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out).strip_dirs()
    out.write(f"===== {path.name}\n")
    stats.sort_stats("cumulative").print_stats(n)
    stats.sort_stats("tottime").print_stats(n)
    return out.getvalue()


def main() -> int:
    folder = Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    for path in sorted(folder.glob("*.pstats")):
        print(summary(path, n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
