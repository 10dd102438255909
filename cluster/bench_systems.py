"""The systems `specd bench engine` compares, and the runners of the in-house ones.

A system is one way of generating the same tokens from the same prompts with the same target:

    target-only      our engine, SpecParams(enabled=False): autoregressive, the baseline of every speed-up
    transformers     AutoModelForCausalLM.generate on the same converted model directory
    vllm             vLLM autoregressive (cluster/bench_vllm.py)
    vllm-ngram       vLLM with its own n-gram (prompt lookup) speculation
    specd-chain      model drafter (the default one, reading the target's hidden states), γ = 4 fixed
    specd-chain-tokens  the token-only model drafter (bootstrap's first stage), γ = 4 fixed
    specd-hybrid     n-gram copy where >= 2 tokens of the context repeat, the default model drafter
                     elsewhere (drafter.kind=hybrid), γ = 4 fixed
    specd-tree       model drafter, token tree of width 3 and depth 4
    specd-ngram      n-gram drafter (drafter.kind=ngram), γ = 4 fixed
    specd-egag       model drafter, entropy-guided γ up to 8
    specd-confidence model drafter, γ up to 8, drafting on while its top-1 probability >= 0.4
    specd-adaptive   model drafter, acceptance-adaptive γ up to 8
    vllm-specd-chain target.backend=vllm: vLLM verifies, specd's token-only model drafter proposes
                     (γ = 4 fixed; vLLM does not hand its hidden states to a proposer)
    vllm-specd-ngram target.backend=vllm with specd's n-gram drafter (γ = 4 fixed)

Run as `python -m cluster.bench_systems JOB OUT --events-fd N` (see cluster/bench_child.py), one system
per process. Every runner warms up once (one short generate), then times only generation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cluster.bench_child import Events, add_request, child_main, finish_cell, groups, new_cell_result

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class System:
    name: str
    kind: str                                   # "specd" | "transformers" | "vllm"
    description: str
    gamma: int = 3                              # specd: per-request γ budget (tree: depth)
    policy: str = "fixed"                       # specd: γ policy
    tree_width: int = 1                         # specd: 1 = chain
    spec_enabled: bool = False                  # specd: False = target-only decoding
    drafter_kind: str | None = None             # specd: "model" | "ngram" | None (no drafter)
    backend: str = "torch"                      # specd: target.backend, "torch" or "vllm"
    target_hidden: bool = True                  # specd model drafter: the one reading target hidden states
    vllm_speculative: dict[str, Any] | None = field(default=None, hash=False)

    @property
    def speculative(self) -> bool:
        return self.spec_enabled or self.vllm_speculative is not None

    @property
    def needs_model_drafter(self) -> bool:
        return self.drafter_kind in ("model", "hybrid")

    @property
    def runner(self) -> str:
        return self.kind


VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("target-only", "specd", "our engine, autoregressive (no drafter)"),
        System("transformers", "transformers", "transformers generate(), same model dir"),
        System("vllm", "vllm", "vLLM autoregressive"),
        System("vllm-ngram", "vllm", "vLLM + its ngram speculation (k=4, lookup 2..4)",
               vllm_speculative=VLLM_NGRAM),
        System("specd-chain", "specd", "model drafter, chain, γ=3 fixed",
               spec_enabled=True, drafter_kind="model"),
        System("specd-chain-tokens", "specd", "token-only model drafter, chain, γ=3 fixed",
               spec_enabled=True, drafter_kind="model", target_hidden=False),
        System("specd-hybrid", "specd", "n-gram copy, else model drafter, γ=3 fixed",
               spec_enabled=True, drafter_kind="hybrid"),
        System("specd-tree", "specd", "model drafter, tree width 3 depth 4",
               tree_width=3, spec_enabled=True, drafter_kind="model"),
        System("specd-ngram", "specd", "n-gram drafter, γ=3 fixed",
               spec_enabled=True, drafter_kind="ngram"),
        System("specd-egag", "specd", "model drafter, EGAG γ≤8",
               gamma=8, policy="egag", spec_enabled=True, drafter_kind="model"),
        System("specd-confidence", "specd", "model drafter, confidence-gated γ≤8",
               gamma=8, policy="confidence", spec_enabled=True, drafter_kind="model"),
        System("specd-adaptive", "specd", "model drafter, adaptive γ≤8",
               gamma=8, policy="adaptive", spec_enabled=True, drafter_kind="model"),
        System("vllm-specd-chain", "specd", "vLLM target + specd token-only model drafter, γ=3 fixed",
               spec_enabled=True, drafter_kind="model", backend="vllm", target_hidden=False),
        System("vllm-specd-ngram", "specd", "vLLM target + specd n-gram drafter, γ=3 fixed",
               spec_enabled=True, drafter_kind="ngram", backend="vllm"),
    )
}


def specd_overrides(system: System, job: dict[str, Any]) -> list[str]:
    """Config overrides for one specd system: the user's first, then what the benchmark must fix."""
    out = list(job.get("overrides", []))
    out += [
        f"target.model_path={job['model_dir']}",
        f"target.num_threads={job.get('threads', 2)}",
        f"target.max_slots={job['max_batch']}",
        f"target.max_seq_len={job['max_seq_len']}",
        f"drafter.max_slots={job['max_batch']}",
        f"spec.gamma_max={max(8, system.gamma)}",
        f"spec.tree_width_max={max(4, system.tree_width)}",
    ]
    if system.drafter_kind is not None:
        out.append(f"drafter.kind={system.drafter_kind}")
    if system.drafter_kind in ("model", "hybrid"):
        out.append(f"drafter.target_hidden={str(system.target_hidden).lower()}")
    if system.backend == "vllm":
        # vLLM's proposer takes no per-request settings: γ budget and policy are the engine's.
        out += ["target.backend=vllm", f"spec.gamma={system.gamma}", f"spec.policy={system.policy}"]
    return out


def run_specd(job: dict[str, Any], events: Events) -> dict[str, Any]:
    from configs import load_config
    from workers.core.sampling import SamplingParams
    from workers.engine.draft_worker import DraftWorker
    from workers.engine.spec_engine import SpecEngine
    from workers.engine.target_worker import TargetWorker
    from workers.engine.types import NewRequest, SpecParams

    system = SYSTEMS[job["system"]]
    cfg = load_config(specd_overrides(system, job))
    t0 = time.perf_counter()
    events.emit("phase", phase="loading")
    if system.backend == "vllm":
        from workers.engine.vllm_engine import VllmEngine

        engine = VllmEngine(cfg, speculation="specd" if system.spec_enabled else "none",
                            max_running=job["max_batch"],
                            llm_kwargs={"kv_cache_memory_bytes": job["vllm_kv_cache_bytes"]})
        drafter_version = engine.version()
    else:
        target = TargetWorker(cfg.target, seed=cfg.seed, cache_dir=cfg.cache_dir)
        drafter = None
        if system.spec_enabled:
            drafter = DraftWorker(cfg.drafter, cfg.spec, target.model_dir, seed=cfg.seed,
                                  cache_dir=cfg.cache_dir)
        engine = SpecEngine(target, drafter, max_running=job["max_batch"])
        drafter_version = drafter.version() if drafter is not None else None
    spec = SpecParams(
        gamma=system.gamma, policy=system.policy, tree_width=system.tree_width, enabled=system.spec_enabled
    )
    load_s = time.perf_counter() - t0

    events.emit("phase", phase="warmup")
    warm = NewRequest("warmup", job["warmup_prompt"], SamplingParams(), WARMUP_TOKENS, spec)
    engine.generate([warm], ignore_eos=True)

    cells = []
    for cell in job["cells"]:
        events.emit("cell", workload=cell["workload"], batch=cell["batch"], temperature=cell["temperature"])
        result = new_cell_result(cell)
        result.update(drafted=0, accepted=0, steps=0, emitted=0)
        tag = f"{cell['workload']}-b{cell['batch']}-t{cell['temperature']}"
        # vLLM's speculation is engine-wide: it cannot switch off per request, so no paired baseline there.
        paired = bool(job.get("paired")) and system.spec_enabled and system.backend == "torch"
        if paired:
            result.update(paired_base_wall_s=0.0, paired_base_tokens=0)
        for g, (prompts, seeds) in enumerate(groups(cell["prompts"], cell["seeds"], cell["batch"])):
            made = [(f"{tag}-{g}-{i}", list(p), SamplingParams(temperature=cell["temperature"], seed=seed))
                    for i, (p, seed) in enumerate(zip(prompts, seeds, strict=True))]
            # --paired: the same engine with speculation off per request, before the system on even
            # groups and after it on odd ones, so drift in machine speed falls on both alike.
            order = (["base", "spec"] if g % 2 == 0 else ["spec", "base"]) if paired else ["spec"]
            for phase in order:
                if phase == "base":
                    off = SpecParams(enabled=False)
                    base_requests = [NewRequest(f"{rid}-base", p, sp, job["max_new_tokens"], off)
                                     for rid, p, sp in made]
                    start = time.perf_counter()
                    base = engine.generate(base_requests, ignore_eos=True)
                    result["paired_base_wall_s"] += time.perf_counter() - start
                    result["paired_base_tokens"] += sum(len(s.output) for s in base)
                    continue
                start = time.perf_counter()
                mine = [NewRequest(rid, p, sp, job["max_new_tokens"], spec) for rid, p, sp in made]
                seqs = engine.generate(mine, on_step=lambda _s, emitted: events.tokens(len(emitted)),
                                       ignore_eos=True)
                result["wall_s"] += time.perf_counter() - start
            for seq in seqs:
                add_request(result, seq.output, seq.latency, job["max_new_tokens"])
                if system.spec_enabled:
                    result["drafted"] += seq.stats.drafted
                    result["accepted"] += seq.stats.accepted
                    result["steps"] += seq.stats.steps
                    result["emitted"] += seq.stats.emitted
        if not system.spec_enabled:
            result.update(drafted=None, accepted=None, steps=None, emitted=None)
        events.flush()
        cells.append(finish_cell(result))
    return {"cells": cells, "load_s": load_s, "drafter_version": drafter_version}


def run_transformers(job: dict[str, Any], events: Events) -> dict[str, Any]:
    """transformers generate(): left padding for batches, min_new_tokens = max_new_tokens (no early stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    events.emit("phase", phase="loading")
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    pad = job["pad_token_id"]

    def generate(prompts: list[list[int]], temperature: float, seed: int, n: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)      # [b, width]
        mask = torch.zeros(len(prompts), width, dtype=torch.long)          # [b, width]
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        kwargs: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=n, pad_token_id=pad, do_sample=False)
        if temperature > 0:
            # top_k=0 and top_p=1 switch off the truncations generate() may otherwise apply by default.
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)  # [b, width + generated]
        return out[:, width:].tolist()

    events.emit("phase", phase="warmup")
    generate([job["warmup_prompt"]], 0.0, 0, WARMUP_TOKENS)

    cells = []
    for cell in job["cells"]:
        events.emit("cell", workload=cell["workload"], batch=cell["batch"], temperature=cell["temperature"])
        result = new_cell_result(cell)
        for prompts, seeds in groups(cell["prompts"], cell["seeds"], cell["batch"]):
            start = time.perf_counter()
            outputs = generate(prompts, cell["temperature"], seeds[0], job["max_new_tokens"])
            wall = time.perf_counter() - start
            result["wall_s"] += wall
            # A static batch finishes together: every request's latency is the group's wall time.
            for output in outputs:
                add_request(result, output, wall, job["max_new_tokens"])
            events.tokens(sum(len(o) for o in outputs), force=True)
        cells.append(finish_cell(result))
    return {"cells": cells, "load_s": load_s}


RUNNERS = {"specd": run_specd, "transformers": run_transformers}


if __name__ == "__main__":
    raise SystemExit(child_main(RUNNERS))
