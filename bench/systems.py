"""The systems `specd bench engine` compares: a registry by name, and the config each specd system runs.

A system is one way of generating the same tokens from the same prompts with the same target:

    target-only      our engine, SpecParams(enabled=False): autoregressive, the baseline of every speed-up
    specd-default    what `specd serve` runs with no overrides: the suffix drafter beside the model drafter,
                     goodput-controlled γ up to 8 (configs/); the quick drafter when none is bootstrapped
    transformers     AutoModelForCausalLM.generate on the same converted model directory
    vllm             vLLM autoregressive (bench/vllm_runner.py)
    vllm-ngram       vLLM with its own n-gram (prompt lookup) speculation
    specd-chain      model drafter (the default one, reading the target's hidden states), γ = 3 fixed
    specd-chain-tokens  the token-only model drafter (bootstrap's first stage), γ = 3 fixed
    specd-hybrid     n-gram copy where >= 2 tokens of the context repeat, the default model drafter
                     elsewhere (drafter.kind=hybrid), γ = 3 fixed
    specd-tree       model drafter, token tree of width 3 and depth 3
    specd-ngram      n-gram drafter (drafter.kind=ngram), γ = 3 fixed
    specd-egag       model drafter, entropy-guided γ up to 8
    specd-confidence model drafter, γ up to 8, drafting on while its top-1 probability >= 0.4
    specd-adaptive   model drafter, acceptance-adaptive γ up to 8
    specd-goodput    model drafter, goodput-controlled γ up to 8 per request and step (0 = target-only)
    specd-goodput-tree  the same with token trees up to width 3
    specd-suffix     suffix drafter over served traffic + the model drafter where it promises more,
                     goodput-controlled γ up to 8 (drafter.kind=suffix)
    specd-suffix-only  the suffix drafter alone (no model drafter), goodput-controlled γ up to 8
    vllm-specd-chain target.backend=vllm: vLLM verifies, specd's token-only model drafter proposes
                     (γ = 3 fixed; vLLM does not hand its hidden states to a proposer)
    vllm-specd-ngram target.backend=vllm with specd's n-gram drafter (γ = 3 fixed)

The runners that generate with them are in bench/runners.py (specd, transformers) and
bench/vllm_runner.py (vLLM), one system per child process (bench/child.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    extra_overrides: tuple[str, ...] = ()       # specd: config overrides the system needs
    compiled: bool = False                      # transformers: static KV cache + torch.compile
    # specd: run the configuration `specd serve` runs with no overrides (drafter, γ policy and budget from
    # configs/, the quick drafter when none is bootstrapped); the fields above are then not used
    defaults: bool = False

    @property
    def speculative(self) -> bool:
        return self.spec_enabled or self.vllm_speculative is not None

    @property
    def needs_model_drafter(self) -> bool:
        if self.defaults:
            return False    # the runner finds (or makes) the drafter `specd serve` would use
        return self.drafter_kind in ("model", "hybrid") or (
            self.drafter_kind == "suffix" and "drafter.suffix_with_model=false" not in self.extra_overrides
        )

    @property
    def runner(self) -> str:
        return self.kind


VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("target-only", "specd", "our engine, autoregressive (no drafter)"),
        System("specd-default", "specd", "specd serve's default configuration (no overrides)",
               spec_enabled=True, defaults=True),
        System("transformers", "transformers", "transformers generate(), same model dir"),
        # Minutes of compilation per shape on a CPU, so only run when named (the GPU baseline).
        System("transformers-compiled", "transformers",
               "transformers generate() with its static cache and torch.compile (reduce-overhead)",
               compiled=True),
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
        System("specd-goodput", "specd", "model drafter, goodput γ≤8 per request and step",
               gamma=8, policy="goodput", spec_enabled=True, drafter_kind="model",
               extra_overrides=("spec.policy=goodput",)),
        System("specd-goodput-tree", "specd", "model drafter, goodput γ≤8 and tree width≤3",
               gamma=8, policy="goodput", tree_width=3, spec_enabled=True, drafter_kind="model",
               extra_overrides=("spec.policy=goodput",)),
        System("specd-suffix", "specd", "suffix index over traffic + model drafter, goodput γ≤8",
               gamma=8, policy="goodput", spec_enabled=True, drafter_kind="suffix",
               extra_overrides=("spec.policy=goodput",)),
        System("specd-suffix-only", "specd", "suffix index over traffic alone, goodput γ≤8",
               gamma=8, policy="goodput", spec_enabled=True, drafter_kind="suffix",
               extra_overrides=("spec.policy=goodput", "drafter.suffix_with_model=false")),
        System("vllm-specd-chain", "specd", "vLLM target + specd token-only model drafter, γ=3 fixed",
               spec_enabled=True, drafter_kind="model", backend="vllm", target_hidden=False),
        System("vllm-specd-ngram", "specd", "vLLM target + specd n-gram drafter, γ=3 fixed",
               spec_enabled=True, drafter_kind="ngram", backend="vllm"),
    )
}


def specd_overrides(system: System, job: dict[str, Any]) -> list[str]:
    """Config overrides for one specd system: the user's first, then what the benchmark must fix."""
    out = list(job.get("overrides", []))
    # --lockstep runs a group's target-only batch beside the speculative one: twice the target's slots
    slots = job["max_batch"] * (2 if job.get("lockstep") else 1)
    if system.defaults:
        # only what the benchmark must fix (model, threads, sizes): speculation exactly as configured
        return out + [f"target.model_path={job['model_dir']}", f"target.num_threads={job.get('threads', 2)}",
                      f"target.max_slots={slots}", f"target.max_seq_len={job['max_seq_len']}",
                      f"drafter.max_slots={job['max_batch']}"]
    out += [
        f"target.model_path={job['model_dir']}",
        f"target.num_threads={job.get('threads', 2)}",
        f"target.max_slots={slots}",
        f"target.max_seq_len={job['max_seq_len']}",
        f"drafter.max_slots={job['max_batch']}",
        f"spec.gamma_max={max(8, system.gamma)}",
        f"spec.tree_width_max={max(4, system.tree_width)}",
    ]
    if system.drafter_kind is not None:
        out.append(f"drafter.kind={system.drafter_kind}")
    if system.needs_model_drafter:
        out.append(f"drafter.target_hidden={str(system.target_hidden).lower()}")
    out += list(system.extra_overrides)
    if system.backend == "vllm":
        # vLLM's proposer takes no per-request settings: γ budget and policy are the engine's.
        out += ["target.backend=vllm", f"spec.gamma={system.gamma}", f"spec.policy={system.policy}"]
    return out


def device_info(device: str) -> dict[str, Any]:
    """Which device a run used: for CUDA the GPU's name, so a result file says what it measured."""
    import torch

    info: dict[str, Any] = {"device": str(device)}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        index = torch.device(str(device)).index or 0
        info.update(gpu=torch.cuda.get_device_name(index), cuda=torch.version.cuda, torch=torch.__version__)
    return info
