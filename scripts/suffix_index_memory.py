"""What the suffix drafter's global index costs per served request: nodes, bytes, indexing and lookup time.

Served traffic stands in as GSM8K question + answer (the chat-templated prompt, then the reference answer
as the output), indexed one request after another the way the suffix drafter does when requests finish,
with the drafter's defaults (max_depth 24, max_match 12). Beside the nodes the index keeps it prints what
the uncompressed trie would hold (every distinct substring of up to max_depth tokens), counted exactly.
Bytes are tracemalloc's for the whole index (nodes, children dicts, the kept sequences), built a second
time for it; times are medians over requests, without tracemalloc. The eval split
(data/gsm8k_test.jsonl) is all this repository ships.

    python scripts/suffix_index_memory.py 300          # requests
"""

from __future__ import annotations

import statistics
import sys
import time
import tracemalloc

from specd.configs import load_config
from specd.workers.drafters.suffix_index import SuffixIndex
from specd.workers.models.loader import ensure_target_model, load_tokenizer
from specd.workers.prompts import encode_prompt, load_split

DEPTH, MATCH = 24, 12


def requests(num: int) -> list[list[int]]:
    cfg = load_config([])
    tokenizer = load_tokenizer(ensure_target_model(cfg.target.model_path, cfg.cache_dir))
    prompts = load_split("gsm8k", "eval")[:num]
    return [encode_prompt(tokenizer, p) + tokenizer.encode(p.reference, add_special_tokens=False)
            for p in prompts]


def distinct_substrings(seqs: list[list[int]], depth: int) -> int:
    seen: set[tuple[int, ...]] = set()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                seen.add(tuple(s[i:j]))
    return len(seen)


def main(argv: list[str]) -> None:
    num = int(argv[0]) if argv else 300
    seqs = requests(num)
    tokens = sum(len(s) for s in seqs)
    index = SuffixIndex(DEPTH)          # timed without tracemalloc, which slows every allocation
    per_request = []
    for s in seqs:
        t0 = time.perf_counter()
        index.add(s)
        per_request.append(time.perf_counter() - t0)
    tracemalloc.start()
    measured = SuffixIndex(DEPTH)
    for s in seqs:
        measured.add(s)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del measured
    lookups = []
    for s in seqs[: min(num, 100)]:
        for cut in range(20, len(s), 7):
            t0 = time.perf_counter()
            index.draft(s[:cut], 8, max_match=MATCH, min_match=2)
            lookups.append(time.perf_counter() - t0)
    plain = distinct_substrings(seqs, DEPTH)
    print(f"{num} requests, {tokens} tokens ({tokens / num:.0f} per request), max_depth {DEPTH}")
    print(f"nodes kept {index.num_nodes} ({index.num_nodes / num:.0f} per request, "
          f"{index.num_nodes / tokens:.2f} per token); the uncompressed trie {plain} "
          f"({plain / num:.0f} per request): {plain / index.num_nodes:.1f}x more")
    print(f"bytes {size / 2**20:.1f} MiB ({size / num / 1024:.1f} KiB per request, "
          f"{size / index.num_nodes:.0f} per node kept)")
    print(f"indexing median {1000 * statistics.median(per_request):.2f} ms per request "
          f"({1e6 * sum(per_request) / tokens:.1f} us per token); "
          f"draft median {1000 * statistics.median(lookups):.3f} ms ({len(lookups)} lookups, chain of 8)")


if __name__ == "__main__":
    main(sys.argv[1:])
