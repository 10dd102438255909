"""Is the paired baseline (speculation off inside a specd engine) slower than an engine without a drafter?

`specd bench engine --paired` divides by target-only decoding run in the specd system's own process, with
speculation off per request. This builds both engines in one process and alternates them on the same
prompts, also with the verify's hidden states for the drafter turned off, so a gap that comes with having
a drafter at all shows up here and a gap between two processes does not:

    python scripts/paired_base_check.py chat 16 0 4     # workload, batch, temperature, groups
"""

from __future__ import annotations

import sys
import time

from transformers import AutoTokenizer

from specd.bench.datasets import workload_prompts
from specd.cluster.first_start import ensure_serving_drafter
from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.drafters.base import SCRATCH_PREFIX
from specd.workers.engine.build import build_engine
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.loader import ensure_target_model


def main(workload: str, batch: int, temperature: float, groups: int) -> None:
    model_dir = str(ensure_target_model())
    cfg = load_config([f"target.model_path={model_dir}", "target.num_threads=2", f"target.max_slots={batch}",
                       "target.max_seq_len=1024", f"drafter.max_slots={batch}"])
    ensure_serving_drafter(cfg, model_dir)
    plain = build_engine(cfg, speculative=False, max_running=batch)
    specd = build_engine(cfg, speculative=True, max_running=batch)
    prompts = [p for _, p in workload_prompts(workload, batch, AutoTokenizer.from_pretrained(model_dir))]
    off = SpecParams(enabled=False)

    def seconds(engine, tag: str) -> float:
        reqs = [NewRequest(f"{SCRATCH_PREFIX}{tag}-{i}", p, SamplingParams(temperature=temperature, seed=i),
                           64, off) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        engine.generate(reqs, ignore_eos=True)
        return time.perf_counter() - t0

    seconds(plain, "warm-plain")
    seconds(specd, "warm-specd")
    names = ("no drafter", "specd, speculation off", "specd, speculation off, no hidden states")
    total = dict.fromkeys(names, 0.0)
    for g in range(groups):
        total["no drafter"] += seconds(plain, f"p{g}")
        total["specd, speculation off"] += seconds(specd, f"s{g}")
        specd.step.hidden = False
        total["specd, speculation off, no hidden states"] += seconds(specd, f"h{g}")
        specd.step.hidden = True
    for name, t in total.items():
        print(f"{name}: {t / groups:.3f} s per group, {total['no drafter'] / t:.3f}x the drafter-less engine")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
