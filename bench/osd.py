"""`specd bench osd`: does the drafter learn from the traffic it serves (online distillation)?

Through the router on the real models, one run: a stream of GSM8K train prompts, then a shift to
HumanEval train prompts, served once with the online trainer on and once with it off (the same
stream, fresh servers, each with its own managed Redis and version store), starting from the quick
drafter (`--from-offline`: the bootstrapped one). Clients stream greedy completions concurrently.

It prints and plots (PNG) each request's acceptance α = accepted / drafted against its index, with
the swap events (a request drafted by a version not seen before) and the domain shift marked. Held-out
acceptance per domain is measured on eval prompts the stream never sends, in this process with the
in-process engine (so evaluation never enters the replay stream): `before` with the starting drafter,
`after` with the version serving at the end of the trainer-on run. `--json PATH` writes those, the
failed request count and the throughput with the trainer on and off.

    specd bench osd --quick                           # a smoke run (a few requests, short outputs)
    specd bench osd --requests-per-domain 400 --json bench/results/osd.json --plot bench/results/osd.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specd.bench.osd_versions import published_events, serving_at_domain_end, swap_events
from specd.bench.report import save_figure
from specd.bench.serve import ServerProcess
from specd.cluster.client import AsyncSpecdClient
from specd.cluster.online import SWAP_POLL_S

SWAP_DELAY_S = SWAP_POLL_S + 1.0   # a published version serves within the server's poll and a load

DOMAINS = ("gsm8k", "humaneval")


def stream_prompts(
    domains: tuple[str, ...], per_domain: int, split: str, seen: frozenset[tuple[str, int]] = frozenset()
) -> list[tuple[str, Any]]:
    """`per_domain` prompts of each domain in turn, the ones in `seen` ((source, row) pairs the starting
    drafter was trained on) last, cycling when a split has fewer rows (HumanEval's train split has 120)."""
    from specd.workers.prompts import load_split

    out = []
    for d in domains:
        rows = load_split(d, split)
        rows = [p for p in rows if (p.source, p.index) not in seen] + [
            p for p in rows if (p.source, p.index) in seen
        ]
        out += [(d, rows[i % len(rows)]) for i in range(per_domain)]
    return out


def bootstrap_prompts(from_offline: bool) -> frozenset[tuple[str, int]]:
    """The train prompts the starting drafter was distilled on (bootstrap.py takes the first
    num_prompts of the interleaved train prompts; its hidden stage hidden_num_prompts of them)."""
    from specd.drafter_trainer.bootstrap import BootstrapConfig
    from specd.workers.prompts import load_prompts

    cfg = BootstrapConfig() if from_offline else BootstrapConfig.quick()
    limit = max(cfg.num_prompts, cfg.hidden_num_prompts or 0)
    return frozenset((p.source, p.index) for p in load_prompts("train", cfg.sources, limit=limit))


async def run_stream(
    address: str, prompts: list[tuple[str, Any]], clients: int, max_new_tokens: int, desc: str
) -> dict[str, Any]:
    """Each request's domain, α, tokens and drafter versions, in submission order; failures counted."""
    from tqdm import tqdm

    from specd.workers.prompts import chat_messages

    client = AsyncSpecdClient(address, timeout=3600)
    queue = list(enumerate(prompts))
    rows: list[dict | None] = [None] * len(prompts)
    failed = 0
    bar = tqdm(total=len(prompts), desc=desc, unit="req")

    async def one_client() -> None:
        nonlocal failed
        while queue:
            index, (domain, prompt) = queue.pop(0)
            usage, tokens = {}, 0
            try:
                async for chunk in client.stream(
                    messages=chat_messages(prompt),
                    max_new_tokens=max_new_tokens,
                    ignore_eos=True,
                    temperature=0.0,
                    domain=domain,
                ):
                    tokens += len(chunk.token_ids)
                    usage = chunk.usage or usage
            except Exception as exc:  # a failed request is a result of the benchmark, not its end
                failed += 1
                rows[index] = {"index": index, "domain": domain, "error": f"{type(exc).__name__}: {exc}"}
                bar.update(1)
                continue
            drafted, accepted = usage.get("drafted", 0), usage.get("accepted", 0)
            rows[index] = {
                "index": index,
                "domain": domain,
                "tokens": tokens,
                "drafted": drafted,
                "accepted": accepted,
                "alpha": accepted / drafted if drafted else 0.0,
                "tokens_per_step": usage.get("tokens_per_step", 0.0),
                "versions": list(usage.get("drafter_versions", [])),
                "done_at": time.time(),
            }
            bar.update(1)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*[one_client() for _ in range(clients)])
    finally:
        bar.close()
        await client.close()
    wall = time.perf_counter() - t0
    done = [r for r in rows if r and "error" not in r]
    tokens = sum(r["tokens"] for r in done)
    return {
        "requests": rows,
        "failed_requests": failed,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "swaps": swap_events(rows),
    }


def heldout_acceptance(
    overrides: list[str], store: Path | None, per_domain: int, max_new_tokens: int,
    after: dict[str, str] | None = None, gamma: int = 3, domains: tuple[str, ...] = DOMAINS,
) -> dict[str, dict[str, Any]]:
    """{domain: {"before", "after", "after_version", "final"}}: α on eval prompts, in process, with the
    starting drafter (`before`), with `after[domain]` (the version serving when that domain's stream
    ended) and with the version CURRENT names in `store` at the end (`final`). No store: before only.
    Each also as `<key>_first`: the acceptance of the first draft of a step alone.

    Drafts are chains of a fixed `gamma`, whatever the serving policy: α = accepted / drafted falls with
    γ (every position after a rejection counts as drafted), so only a fixed γ compares drafters. The first
    draft of a greedy step is accepted exactly when the drafter's token is the target's next token after
    the target's own prefix: `_first` is the OSD paper's token acceptance rate under greedy decoding,
    which no chain length dilutes."""
    from dataclasses import replace

    from specd.configs import load_config
    from specd.workers.core.sampling import SamplingParams
    from specd.workers.engine.build import build_engine
    from specd.workers.engine.types import NewRequest, SpecParams
    from specd.workers.models.loader import load_tokenizer
    from specd.workers.prompts import encode_prompt

    cfg = load_config(heldout_overrides(overrides))
    engine = build_engine(cfg, max_running=4)
    target, drafter = engine.target, engine.drafter
    tokenizer = load_tokenizer(target.model_dir)
    spec = replace(SpecParams.from_config(cfg.spec, enabled=True), policy="fixed", tree_width=1, gamma=gamma)
    prompts = {
        d: [encode_prompt(tokenizer, p) for _, p in stream_prompts((d,), per_domain, "eval")] for d in domains
    }

    def measure(into: dict[str, Any], key: str, domain: str) -> None:
        reqs = [
            NewRequest(f"{key}-{domain}-{i}", p, SamplingParams(), max_new_tokens, spec)
            for i, p in enumerate(prompts[domain])
        ]
        stats = [s.stats for s in engine.generate(reqs, ignore_eos=True)]
        into[key] = _ratio(sum(s.accepted for s in stats), sum(s.drafted for s in stats))
        first = [s for s in stats if s.drafted_per_position]
        # accepted_per_position grows only as far as a step accepted: empty where nothing was
        into[f"{key}_first"] = _ratio(sum((s.accepted_per_position or [0])[0] for s in first),
                                      sum(s.drafted_per_position[0] for s in first))

    def serve_version(version: str | None) -> str:
        """Pin `version` (None: CURRENT) and apply it between "steps"; returns the version serving."""
        drafter._swapper.pin = version
        drafter._swapper.check()
        drafter.propose([])
        return drafter.version()

    result: dict[str, dict[str, Any]] = {d: {} for d in domains}
    for d in domains:
        measure(result[d], "before", d)
    if store is None or not (store / "CURRENT").is_file():
        return result
    drafter.watch_versions(str(store), str(target.model_dir), poll_s=3600)
    drafter._swapper.stop()   # only serve_version's checks below: the thread's first one loaded CURRENT
    for d in domains:
        if after and after.get(d):
            result[d]["after_version"] = serve_version(after[d])
            measure(result[d], "after", d)
    final = serve_version(None)
    for d in domains:
        result[d]["final_version"] = final
        measure(result[d], "final", d)
        if "after" not in result[d]:
            result[d].update(after_version=final, after=result[d]["final"],
                             after_first=result[d]["final_first"])
    return result


def heldout_overrides(overrides: list[str]) -> list[str]:
    """The held-out evaluation measures what a drafter accepts, not whether drafting pays: the speculation
    guard (spec.guard_window_steps) would switch drafting off where it is slower than plain decoding, and
    did, after a weak drafter's windows: a later drafter then drafted nothing and read α = 0."""
    return [*overrides, "spec.guard_window_steps=0"]


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


def start_drafter(from_offline: bool, cache_dir: str | None, model_dir: str) -> str:
    """The drafter both runs start from: the quick one (built when missing) or the bootstrapped one."""
    from specd.workers.drafters.model import default_drafter_dir

    if from_offline:
        path = default_drafter_dir(cache_dir, target_hidden=True)
        if not (path / "config.json").exists():
            raise SystemExit(
                f"--from-offline: no bootstrapped drafter at {path} (run specd bootstrap-drafter)"
            )
        return str(path)
    from specd.cluster.first_start import build_quick_drafter

    return str(build_quick_drafter(cache_dir, model_dir))


def wait_for_trainer(store: Path, timeout_s: float = 600) -> None:
    """The trainer publishes the starting drafter into its store once it is up: start the stream then,
    so that its start-up (loading the target) is not counted against the trainer-on throughput."""
    deadline = time.monotonic() + timeout_s
    while not (store / "CURRENT").is_file():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the trainer did not come up within {timeout_s:.0f} s (no {store}/CURRENT)")
        time.sleep(1.0)


def write_plot(path: Path, runs: dict[str, dict], shift: int | None, title: str) -> Path:
    """α per request over the stream, per trainer mode; `shift`: where the second domain starts (None:
    one domain)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, run in runs.items():
        # a request the policy drafted nothing for has no α (plotted as 0 it read as a collapse)
        rows = [r for r in run["requests"] if r and r.get("drafted")]
        xs, ys = [r["index"] for r in rows], [r["alpha"] for r in rows]
        window = max(1, len(ys) // 25)
        smooth = [
            sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
            for i in range(len(ys))
        ]
        line = ax.plot(xs, smooth, label=f"trainer {name} (moving mean of {window})")[0]
        ax.scatter(xs, ys, s=4, alpha=0.25, color=line.get_color())
        # a version's first drafting request; where none drafted, when it was published and served
        drafted_by = {ev["version"] for ev in run["swaps"]}
        for ev in run["swaps"]:
            ax.axvline(ev["index"], color=line.get_color(), alpha=0.4, linestyle=":")
        for ev in run.get("published", []):
            if ev["version"] not in drafted_by:
                ax.axvline(ev["index"], color=line.get_color(), alpha=0.25, linestyle="-.")
    if shift is not None:
        ax.axvline(shift, color="black", linestyle="--", label="GSM8K -> HumanEval")
    ax.set_xlabel("request index")
    ax.set_ylabel("acceptance rate α (accepted / drafted)")
    ax.set_title(title)
    ax.legend(loc="lower right")
    return save_figure(fig, path)


def run_bench(args: argparse.Namespace) -> int:
    if args.arms:
        from specd.bench.osd_arms import run_arms

        return run_arms(args)
    overrides, cfg, drafter, work, seen = prepare(args, "specd-bench-osd-")
    domains = tuple(d for d in args.domains.split(",") if d)
    unknown = set(domains) - set(DOMAINS)
    if unknown or not domains:
        raise SystemExit(f"--domains: choose from {', '.join(DOMAINS)} (got {args.domains!r})")
    prompts = stream_prompts(domains, args.requests_per_domain, "train", seen)
    print(f"stream: {args.requests_per_domain} requests per domain; "
          f"{sum((p.source, p.index) in seen for _, p in prompts)} of them on prompts the starting drafter "
          "was trained on", flush=True)
    base = [
        *overrides,
        f"drafter.path={drafter}",
        "drafter.kind=model",
        "server.port=0",
        "server.http_port=null",
        "server.metrics_port=0",
        f"server.max_running={max(args.clients, cfg.server.max_running)}",
    ]
    started = time.time()
    runs: dict[str, dict] = {}
    for mode in [m for m in args.modes.split(",") if m]:
        store = work / f"store-{mode}"
        if store.exists():
            # the trainer resumes from a store's CURRENT: an earlier run's would replace the starting drafter
            print(f"removing {store} (an earlier run's version store)", flush=True)
            shutil.rmtree(store)
        server = ServerProcess(
            # every version stays on disk, so the one serving when a domain ended can be evaluated
            [*base, f"trainer.enabled={'true' if mode == 'on' else 'false'}", f"trainer.out_dir={store}",
             "trainer.keep_versions=1000"],
            work / f"server-{mode}.log",
        )
        try:
            if mode == "on":
                wait_for_trainer(store)
            runs[mode] = asyncio.run(
                run_stream(server.address, prompts, args.clients, args.max_new_tokens, f"trainer {mode}")
            )
        finally:
            server.stop()
        runs[mode]["store"] = str(store)
        if mode == "on":
            runs[mode]["published"] = published_events(runs[mode]["requests"], store, SWAP_DELAY_S)
    on_store = Path(runs["on"]["store"]) if "on" in runs else None
    heldout = heldout_acceptance(
        [*overrides, f"drafter.path={drafter}", "drafter.kind=model"],
        on_store,
        args.heldout,
        args.max_new_tokens,
        serving_at_domain_end(runs["on"]["requests"], on_store, SWAP_DELAY_S) if "on" in runs else None,
        gamma=args.gamma,
    )
    reference = reference_drafter(args, drafter, cfg.cache_dir)
    if reference:
        # the same held-out evaluation of another drafter (by default the offline one): how far online
        # training took the starting drafter toward it
        ref = heldout_acceptance([*overrides, f"drafter.path={reference}", "drafter.kind=model"], None,
                                 args.heldout, args.max_new_tokens, gamma=args.gamma)
        for d in DOMAINS:
            heldout[d].update(reference=ref[d]["before"], reference_first=ref[d]["before_first"])
    failed = sum(r["failed_requests"] for r in runs.values())
    tput = {m: round(r["tokens_per_s"], 3) for m, r in runs.items()}
    print(f"held-out acceptance: {json.dumps(heldout)}")
    print(
        f"throughput tok/s: {tput}; failed requests: {failed}; "
        f"versions published during the stream (trainer on): {len(runs.get('on', {}).get('published', []))}, "
        f"of which seen drafting: {len(runs.get('on', {}).get('swaps', []))}"
    )
    if runs:
        domains = [d for d in args.domains.split(",") if d]
        plot = write_plot(
            Path(args.plot) if args.plot else work / "osd.png",
            runs,
            args.requests_per_domain if len(domains) > 1 else None,
            "specd bench osd: " + " then ".join(f"{args.requests_per_domain} {d}" for d in domains),
        )
        print(f"plot: {plot}")
    if args.json:
        write_json(Path(args.json), args, heldout, failed, tput, runs, (drafter, reference), overrides,
                   started, work)
    return 0


def prepare(args: argparse.Namespace, prefix: str) -> tuple[list[str], Any, str, Path, frozenset]:
    """(overrides, config, starting drafter, work dir, the prompts that drafter was trained on), shared by
    the on/off run and the arms; --quick shrinks the run first."""
    from specd.configs import load_config
    from specd.workers.models.loader import ensure_target_model

    if args.quick:
        args.requests_per_domain, args.heldout = min(args.requests_per_domain, 6), min(args.heldout, 2)
        args.max_new_tokens = min(args.max_new_tokens, 16)
    overrides = list(args.overrides)
    cfg = load_config(overrides)
    model_dir = str(ensure_target_model(cfg.target.model_path, cfg.cache_dir, cfg.target.model))
    drafter = args.drafter or start_drafter(args.from_offline, cfg.cache_dir, model_dir)
    work = Path(args.log_dir or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    # A stream of what the drafter never saw, where the split allows (the offline drafter saw it all).
    seen = frozenset() if args.drafter else bootstrap_prompts(args.from_offline)
    return overrides, cfg, drafter, work, seen


def reference_drafter(args: argparse.Namespace, start: str, cache_dir: str | None) -> str | None:
    """--reference DIR, else the offline (bootstrapped) drafter when it exists and is not the start."""
    if args.reference:
        return None if args.reference == "none" else args.reference
    from specd.workers.drafters.model import default_drafter_dir

    offline = default_drafter_dir(cache_dir, target_hidden=True)
    if (offline / "config.json").exists() and offline.resolve() != Path(start).resolve():
        return str(offline)
    return None


def write_json(path: Path, args, heldout, failed, tput, runs, drafters, overrides, started, work) -> None:
    """--json: per-domain held-out acceptance before/after (α of γ-chains; `first_position`: of the first
    draft alone; `reference`: another drafter's, the offline one by default), failed requests,
    throughput on/off, runs."""
    drafter, reference = drafters
    out = {d: heldout[d] for d in DOMAINS}
    keys = ("before", "after", "final", "reference")
    doc = {
        **{k: {d: heldout[d].get(k) for d in DOMAINS} for k in keys},
        "first_position": {k: {d: heldout[d].get(f"{k}_first") for d in DOMAINS} for k in keys},
        "failed_requests": failed,
        "throughput_tokens_per_s": tput,
        "throughput_ratio_on_off": round(tput["on"] / tput["off"], 4) if tput.get("off") else None,
        "heldout": out,
        "meta": {
            "requests_per_domain": args.requests_per_domain,
            "heldout_per_domain": args.heldout,
            "max_new_tokens": args.max_new_tokens,
            "clients": args.clients,
            "heldout_gamma": args.gamma,
            "start_drafter": drafter,
            "reference_drafter": reference,
            "overrides": overrides,
            "duration_s": round(time.time() - started, 1),
            "work_dir": str(work),
        },
        "runs": runs,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests-per-domain", type=int, default=400, help="stream requests per domain")
    parser.add_argument("--domains", default=",".join(DOMAINS),
                        help="the stream's domains, in order (a shorter run: --domains gsm8k); the held-out "
                             "evaluation scores both")
    parser.add_argument("--heldout", type=int, default=24, help="held-out eval prompts per domain")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=2, help="concurrent streaming clients")
    parser.add_argument("--gamma", type=int, default=3, help="draft length of the held-out evaluation")
    parser.add_argument("--arms", default="",
                        help="compare arms instead of trainer on/off (bench/osd_arms.py): any of "
                             "suffix-frozen,default-online,model-online,offline-frozen; --domains may "
                             "include openchat")
    parser.add_argument("--offline-drafter", default=None, metavar="DIR",
                        help="the drafter the offline-frozen arm serves (trained offline on the domain)")
    parser.add_argument("--modes", default="on,off",
                        help="trainer modes to run, in order (default on,off; '' = held-out evaluation only)")
    parser.add_argument("--reference", default=None, metavar="DIR",
                        help="another drafter the held-out evaluation also measures (default: the offline "
                             "one, if built; 'none': no other)")
    parser.add_argument("--from-offline", action="store_true", help="start from the bootstrapped drafter")
    parser.add_argument("--drafter", default=None, metavar="DIR", help="start from this drafter directory")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 6 requests per domain, 16 tokens")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--plot", default=None, metavar="PATH", help="PNG path (default: in the log dir)")
    parser.add_argument(
        "--log-dir", default=None, help="server logs and version stores (default: a temp dir)"
    )
    parser.add_argument("overrides", nargs="*", default=[], help="config overrides, e.g. trainer.lr=3e-4")


def main(argv: list[str] | None = None) -> int:
    from specd.bench.cli import run_alone

    return run_alone("osd", sys.modules[__name__], argv)
