"""`specd bench serve --vllm`: specd on vLLM against vLLM alone and vLLM's own n-gram, through the router.

vLLM's speculation is engine-wide (a request cannot turn it off), so the baseline cannot share the
server as `specd bench serve`'s target-only phase does: three servers run one after another, each
`specd serve target.backend=vllm` as its own process (the same router, gRPC API and vLLM engine actor):

    vllm          spec.enabled=false: vLLM alone (its continuous batching, paged KV cache and kernels)
    vllm-ngram    target.vllm_speculation=vllm-ngram: vLLM's own n-gram proposer
    specd-vllm    specd's drafter as vLLM's custom_class proposer (the configured drafter and γ policy)
    specd-draft-model  target.vllm_speculation=vllm-draft-model: specd's model drafter on vLLM's own
                  draft_model proposer (spec.gamma every step)

`--vllm-systems` picks among them (vllm, the baseline, always runs).

On each server, every `--vllm-clients` count streams its own slice of the held-out prompts (greedy, EOS
ignored): the slices differ between client counts and rounds, so a drafter that learns from traffic (the
suffix index) never sees a prompt twice, and they are the same for the three servers. With `--rounds N`
each round starts the three servers afresh, in reverse order on odd rounds, and the JSON adds each
round's ratio and their median (servers started one after another differ by more than requests on one
server do). Reports tokens/s, TPOT
p50/p99 and each speculative server's ratio to vLLM alone at the same client count, with vLLM's version
in the JSON, and a plot of tokens/s per client count.

    specd bench serve --vllm --rounds 2 --json bench/results/serve-vllm.json
    specd bench serve --vllm --vllm-clients 4 --requests 8 --max-new-tokens 32     # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

SYSTEMS = {
    "vllm": ["spec.enabled=false"],
    "vllm-ngram": ["target.vllm_speculation=vllm-ngram"],
    "specd-vllm": [],
    "specd-draft-model": ["target.vllm_speculation=vllm-draft-model"],
}
SPECULATIVE = [name for name in SYSTEMS if name != "vllm"]
# what every server of this bench runs with before the operator's overrides: the vLLM target, enough
# slots for the largest client count, and no replay or trainer (online learning on vLLM is measured
# elsewhere; these figures are serving speed)
BASE = ["target.backend=vllm", "replay.enabled=false", "trainer.enabled=false"]


def server_overrides(system: str, overrides: list[str], max_clients: int) -> list[str]:
    slots = [f"target.max_slots={max_clients}", f"server.max_running={max_clients}",
             f"server.max_queue={4 * max_clients}", "server.port=0", "server.metrics_port=0",
             "server.http_port=null"]
    return [*BASE, *slots, *overrides, *SYSTEMS[system]]


def ratios(results: dict[str, dict], clients: list[int]) -> dict[str, float]:
    """tokens/s of each speculative server over vLLM alone's, per client count."""
    out = {}
    for n in clients:
        base = results.get(f"vllm c{n}")
        for system in SPECULATIVE:
            row = results.get(f"{system} c{n}")
            if base and row and base["tokens_per_s"] > 0:
                out[f"{system}_vs_vllm_c{n}"] = row["tokens_per_s"] / base["tokens_per_s"]
    return out


def round_ratios(results: dict[str, dict], clients: list[int]) -> dict[str, object]:
    """Each round's tokens/s ratio to vLLM alone (the servers of a round ran back to back) and the median."""
    out: dict[str, object] = {}
    for n in clients:
        base = results.get(f"vllm c{n}", {}).get("rounds")
        for system in SPECULATIVE:
            mine = results.get(f"{system} c{n}", {}).get("rounds")
            if base and mine:
                per = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mine, base, strict=True)
                       if b["tokens_per_s"] > 0]
                out[f"{system}_vs_vllm_c{n}_rounds"] = per
                out[f"{system}_vs_vllm_c{n}_median"] = statistics.median(per)
    return out


def render(results: dict[str, dict], figures: dict[str, float]) -> str:
    lines = [f"{'server, clients':20s} {'tok/s':>8s} {'tpot p50':>9s} {'p99':>7s} {'ttft p50':>9s} {'α':>5s} "
             f"{'tok/step':>8s}"]
    for name, r in results.items():
        tpot, ttft = r["tpot_s"], r["ttft_s"]
        lines.append(f"{name:20s} {r['tokens_per_s']:8.2f} {tpot['p50']:9.4f} {tpot['p99']:7.4f} "
                     f"{ttft['p50']:9.3f} {r['acceptance_rate']:5.2f} {r['tokens_per_step']:8.2f}")
    lines += [f"{k}: {v:.3f}x" for k, v in figures.items()]
    return "\n".join(lines)


def write_plot(path: Path, results: dict[str, dict], clients: list[int]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specd.bench.report import save_figure

    fig, ax = plt.subplots(figsize=(6.5, 4))
    shown = [s for s in SYSTEMS if any(f"{s} c{n}" in results for n in clients)]
    width = 0.8 / len(shown)
    for i, system in enumerate(shown):
        xs = [c + (i - (len(shown) - 1) / 2) * width for c in range(len(clients))]
        ax.bar(xs, [results.get(f"{system} c{n}", {}).get("tokens_per_s", 0.0) for n in clients], width,
               label=system)
    ax.set_xticks(range(len(clients)))
    ax.set_xticklabels([f"{n} streaming clients" for n in clients])
    ax.set_ylabel("generated tokens/s (server)")
    ax.set_title("specd on vLLM against vLLM alone")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    import vllm

    from specd.bench.datasets import mixed_prompts, request_lengths
    from specd.bench.serve import ServerProcess, merge_rounds, run_phase
    from specd.configs import load_config
    from specd.workers.models.loader import ensure_target_model, load_tokenizer

    clients = [int(c) for c in str(args.vllm_clients).split(",") if c]
    wanted = [s for s in str(getattr(args, "vllm_systems", "") or ",".join(SYSTEMS)).split(",") if s]
    unknown = sorted(set(wanted) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown --vllm-systems {unknown}; known: {', '.join(SYSTEMS)}")
    systems = ["vllm", *[s for s in SYSTEMS if s in wanted and s != "vllm"]]
    rounds = max(1, args.rounds)
    overrides = list(args.overrides)
    cfg = load_config([*BASE, *overrides])
    model_dir = str(ensure_target_model(cfg.target.model_path, cfg.cache_dir, cfg.target.model))
    tokenizer = load_tokenizer(model_dir)
    messages, _ = mixed_prompts(args.workloads.split(","), args.requests * len(clients) * rounds, tokenizer)
    lengths = request_lengths(len(messages), args.max_new_tokens, args.lengths)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="specd-bench-serve-vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs: dict[str, list[dict]] = {}
    for r in range(rounds):
        # a fresh server per system and round; odd rounds reverse the order, so a machine that speeds up or
        # slows down over the run favours no server
        for system in (systems if r % 2 == 0 else systems[::-1]):
            log = logs / f"{system}-{r + 1}.log"
            server = ServerProcess(server_overrides(system, overrides, max(clients)), log)
            try:
                for k, n in enumerate(clients):
                    first = (r * len(clients) + k) * args.requests
                    part = slice(first, first + args.requests)
                    # a server with spec.enabled=false refuses requests that ask for speculation
                    speculation = system != "vllm"
                    label = f"{system}, {n} clients" + (f", round {r + 1}/{rounds}" if rounds > 1 else "")
                    runs.setdefault(f"{system} c{n}", []).append(asyncio.run(
                        run_phase(server.address, messages[part], n, lengths[part], speculation, label)))
            finally:
                server.stop()
    results: dict[str, dict] = {}
    for name, per_round in runs.items():
        row = merge_rounds(per_round) if rounds > 1 else per_round[0]
        row.pop("_timings", None)
        system, n = name.rsplit(" c", 1)
        results[name] = {**row, "system": system, "clients": int(n)}
    figures = ratios(results, clients)
    print(render(results, figures))
    spread = round_ratios(results, clients)
    for key, value in spread.items():
        shown = f"{value:.3f}x" if isinstance(value, float) else ", ".join(f"{v:.3f}" for v in value)
        print(f"{key}: {shown}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"bench": "serve-vllm", "vllm_version": vllm.__version__, "clients": clients,
                "requests_per_phase": args.requests, "max_new_tokens": args.max_new_tokens,
                "rounds": rounds, "lengths": args.lengths, "workloads": args.workloads,
                "overrides": overrides,
                "base_overrides": BASE, "host_cpus": os.cpu_count(), "load_average_end": os.getloadavg(),
                "duration_s": time.time() - started, "logs": str(logs), "device": cfg.target.device.value}
        path.write_text(json.dumps({"meta": meta, "phases": results, "figures": figures, "rounds": spread},
                                   indent=2))
        print(f"wrote {path}")
        print(f"wrote {write_plot(path.with_suffix('.png'), results, clients)}")
    return 0
