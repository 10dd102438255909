"""`specd demo`: the in-process engine on the embedded default, speculative beside target-only.

Generates answers to a few held-out GSM8K questions twice on the same engine, target-only and with
the drafter, checks that the greedy outputs are token-identical and prints the speed-up and the
acceptance statistics. No Ray, no gRPC: the quickest way to see the core work on a real model.
"""

from __future__ import annotations

import time

from specd.configs import load_config
from specd.workers.core.sampling import SamplingParams
from specd.workers.engine.build import build_engine
from specd.workers.engine.spec_engine import SpecEngine
from specd.workers.engine.types import NewRequest, SpecParams
from specd.workers.models.chat import ChatCodec
from specd.workers.models.loader import load_tokenizer

DEMO_QUESTIONS = (
    "Janet has 3 boxes with 12 pencils each. She gives away 10 pencils. How many are left?",
    "A train travels 60 miles per hour for 2.5 hours. How far does it go?",
)


def run_demo(overrides: list[str], max_new_tokens: int, temperature: float) -> int:
    cfg = load_config(overrides)
    if cfg.target.backend != "torch":
        raise SystemExit(f"specd demo runs the in-process torch engine (target.backend={cfg.target.backend})")
    print(f"loading target ({cfg.target.backend}, {cfg.target.device}) ...", flush=True)
    print(f"loading drafter ({cfg.drafter.kind}) ...", flush=True)
    engine = build_engine(cfg)
    codec = ChatCodec(load_tokenizer(engine.target.model_dir))
    prompts = [codec.render_chat([{"role": "user", "content": q}]) for q in DEMO_QUESTIONS]

    def requests(enabled: bool) -> list[NewRequest]:
        spec = SpecParams.from_config(cfg.spec, enabled=enabled)
        sampling = SamplingParams(temperature=temperature, seed=cfg.seed)
        return [NewRequest(f"demo-{i}", p, sampling, max_new_tokens, spec) for i, p in enumerate(prompts)]

    runs = {}
    # Target-only runs on the same target worker, without the drafter.
    for name, runner, enabled in (("target-only", SpecEngine(engine.target), False),
                                  ("speculative", engine, True)):
        t0 = time.perf_counter()
        seqs = runner.generate(requests(enabled), ignore_eos=True)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(s.output) for s in seqs)
        runs[name] = (seqs, tokens / elapsed)
        print(f"{name:12s} {tokens} tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} tokens/s")
    base, spec = runs["target-only"][0], runs["speculative"][0]
    for b, s in zip(base, spec, strict=True):
        print("-" * 72)
        print(codec.decode(s.output).strip())
        st = s.stats
        print(f"[drafted {st.drafted}, accepted {st.accepted}, recovered {st.recovered}, bonus {st.bonus}, "
              f"α {st.acceptance_rate:.2f}, tokens per step {st.tokens_per_step:.2f}]")
        if temperature == 0:
            print("identical to target-only greedy:", b.output == s.output)
    print("-" * 72)
    ratio = runs["speculative"][1] / runs["target-only"][1]
    print(f"speed-up over target-only on the same engine: {ratio:.2f}x")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="speculative vs target-only on the embedded default, in-process")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. drafter.kind=ngram spec.gamma=6")
    p.set_defaults(func=lambda a: run_demo(a.overrides, a.max_new_tokens, a.temperature))

