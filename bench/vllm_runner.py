"""vLLM systems of `specd bench engine`, in a child process of their own.

Run as `python -m specd.bench.vllm_runner JOB OUT --events-fd N` (protocol in bench/child.py). vLLM
spawns its engine processes, so building `vllm.LLM` must happen under `if __name__ == "__main__":`.

Settings chosen to compare like with like: the same converted float32 directory, prompts given as token
ids (the same ids every system gets), `ignore_eos=True` so every request generates max_new_tokens,
no detokenization (our engine does not detokenize either), `max_num_seqs` = the largest batch, and a KV
budget (set by the parent) with room to spare, so vLLM never preempts for lack of KV blocks. Statistics
are on for both vLLM systems alike: the speculative one reads acceptance counts from vLLM's spec-decode
counters, and both report preemptions, which would make their timings unfair to vLLM.
"""

from __future__ import annotations

import time
from typing import Any

from specd.bench.child import Events, add_request, child_main, finish_cell, groups, new_cell_result
from specd.bench.runners import WARMUP_TOKENS
from specd.bench.systems import SYSTEMS

# vLLM's spec-decode counters, cumulative over the engine's life; a cell reads their difference.
_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    "vllm:num_preemptions": "preemptions",
}


def read_counters(llm) -> dict[str, int]:
    """Current totals of the counters above (summed over engines and label sets)."""
    from vllm.v1.metrics.reader import Counter

    totals = dict.fromkeys(_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if isinstance(metric, Counter) and name in _COUNTERS:
            totals[_COUNTERS[name]] += int(metric.value)
    return totals


def speculation_counts(before: dict[str, int], after: dict[str, int], generated: int, requests: int) -> dict:
    """vLLM's counters in our glossary. vLLM counts only steps that drafted something; a step without a
    draft emits one token. Every token after each request's first (the prefill's) comes from a step, and a
    step emits accepted + 1 tokens, so steps = (generated - requests) - accepted."""
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    emitted = generated - requests
    return {"drafted": drafted, "accepted": accepted, "emitted": emitted, "steps": max(emitted - accepted, 0)}


def run_vllm(job: dict[str, Any], events: Events) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt

    system = SYSTEMS[job["system"]]
    t0 = time.perf_counter()
    events.emit("phase", phase="loading")
    llm = LLM(
        model=job["model_dir"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=job["max_seq_len"],
        max_num_seqs=job["max_batch"],
        kv_cache_memory_bytes=job["vllm_kv_cache_bytes"],
        seed=0,
        speculative_config=system.vllm_speculative,
        disable_log_stats=False,
    )
    load_s = time.perf_counter() - t0

    def params(temperature: float, seed: int, n: int) -> SamplingParams:
        return SamplingParams(
            temperature=temperature, top_k=0, top_p=1.0, seed=seed, max_tokens=n, ignore_eos=True,
            detokenize=False,
        )

    events.emit("phase", phase="warmup")
    llm.generate([TokensPrompt(prompt_token_ids=job["warmup_prompt"])], params(0.0, 0, WARMUP_TOKENS),
                 use_tqdm=False)

    cells = []
    for cell in job["cells"]:
        events.emit("cell", workload=cell["workload"], batch=cell["batch"], temperature=cell["temperature"])
        result = new_cell_result(cell)
        before = read_counters(llm)
        for prompts, seeds in groups(cell["prompts"], cell["seeds"], cell["batch"]):
            inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
            sampling = [params(cell["temperature"], s, job["max_new_tokens"]) for s in seeds]
            start = time.perf_counter()
            outs = llm.generate(inputs, sampling, use_tqdm=False)
            wall = time.perf_counter() - start
            result["wall_s"] += wall
            # One generate call per group: with ignore_eos its requests finish in the same engine step,
            # so each request's latency is the group's wall time.
            for out in outs:
                add_request(result, list(out.outputs[0].token_ids), wall, job["max_new_tokens"])
            events.tokens(sum(len(o.outputs[0].token_ids) for o in outs), force=True)
        # The engine process pushes its statistics to the frontend with its outputs; a moment's grace.
        time.sleep(0.2)
        after = read_counters(llm)
        result["preemptions"] = after["preemptions"] - before["preemptions"]
        if system.vllm_speculative:
            result.update(speculation_counts(before, after, result["generated_tokens"], len(cell["prompts"])))
        cells.append(finish_cell(result))
    return {"cells": cells, "load_s": load_s}


if __name__ == "__main__":
    raise SystemExit(child_main({"vllm": run_vllm}))
