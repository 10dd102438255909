"""specd's learned model drafter served by vLLM's own `draft_model` proposer (target.vllm_speculation=
vllm-draft-model), its new versions loaded into the running engine by vLLM's draft-weight update calls.

Why beside the custom_class proposer (vllm_proposer.py). That proposer runs specd's DraftWorker inside
vLLM's step, which forces vLLM's V1 runner, turns async scheduling off and is invisible to CUDA graphs
and tensor parallelism. vLLM's own draft_model proposer keeps all of those: the drafter is one more model
of the engine, drafted with vLLM's batched kernels. What it gives up: specd's γ policies (the budget is
engine-wide, num_speculative_tokens = spec.gamma), the suffix index and per-request on/off (the router
refuses those requests with INVALID_ARGUMENT), and the drafted ids of rejected positions in the replay
records (the records carry the accepted prefix, as for vLLM's n-gram proposer).

At start the serving drafter directory is exported as a plain Llama checkpoint
(workers/drafters/native_export.py). With a version store (online training on), a DrafterSwapper
(hot_swap.py) watches CURRENT in the background, downloads and verifies each new version (sha256, the
serving target's checksum, every tensor's name and shape against the served checkpoint), and the
engine's step thread applies it between two steps: the version's tensors in checkpoint form go to a
file every vLLM worker reads (vllm_weights.py). A step is drafted by one version from its first token
to its last; output stays exact, since the target verifies every draft.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from safetensors.torch import load_file

from specd.workers.drafters.model import read_drafter_version, resolve_drafter_dir
from specd.workers.drafters.native_export import (
    WEIGHTS_FILE,
    check_same_shapes,
    export_native_dir,
    tensor_shapes,
    write_update_file,
)

SWAP_POLL_S = 2.0

log = logging.getLogger(__name__)


class NativeDrafter:
    """The exported checkpoint of one engine, and the versions that follow it."""

    def __init__(self, cfg, target_dir: str | Path, workdir: Path, versions: str | dict | None = None):
        """target_dir: the served target (versions are checked against its checksum). versions: the
        published version store to follow (a directory or a Redis source; None: keep the drafter it
        starts with)."""
        # the suffix drafter (the default) combines the suffix index with a model drafter: vLLM's proposer
        # takes the model part (the index has no place in it; vllm_limits says so at start)
        if cfg.drafter.kind not in ("model", "suffix"):
            raise ValueError(f"target.vllm_speculation=vllm-draft-model serves a model drafter; drafter.kind "
                             f"is {cfg.drafter.kind!r} (use target.vllm_speculation=specd for it)")
        self.source_dir = resolve_drafter_dir(cfg.drafter.path, cfg.cache_dir, False)
        self.workdir = Path(workdir)
        self.export_dir = export_native_dir(self.source_dir, self.workdir / "native-drafter")
        self.version = read_drafter_version(self.source_dir)
        self.vocab_size = int(tensor_shapes(self.export_dir / WEIGHTS_FILE)["lm_head.weight"][0])
        # a version fits when it has the serving drafter's own tensors (specd form: reduced head and all)
        self._fits = functools.partial(check_same_shapes, tensor_shapes(self.source_dir / WEIGHTS_FILE))
        self.swaps = 0
        self.swapper = None
        if versions is not None:
            from specd.workers.engine.hot_swap import DrafterSwapper

            self.swapper = DrafterSwapper(versions, target_dir, self._fits, self.version, SWAP_POLL_S,
                                          cache_root=self.workdir / "versions").start()

    def engine_kwargs(self) -> dict:
        """What the vLLM engine needs for the updates: the weight-transfer backend of vllm_weights.py."""
        from specd.workers.engine.vllm_weights import BACKEND, register

        register()
        return {"weight_transfer_config": {"backend": BACKEND}}

    def apply_pending(self, llm_engine) -> str | None:
        """Between two engine steps: load the version the swapper verified, if one waits."""
        ready = self.swapper.take() if self.swapper is not None else None
        if ready is None:
            return None
        version, tensors, _meta = ready
        try:
            self._load(llm_engine, tensors, version)
        except Exception as exc:  # vLLM's errors are its own types; the serving version stays on failure
            self.swapper.rejected[version] = repr(exc)
            log.exception("drafter version %s failed to load into vLLM's draft model; %s stays",
                          version, self.version)
            return None
        self.swapper.applied(version)
        return version

    def load_dir(self, llm_engine, path: str | Path) -> str:
        """Load a drafter directory's weights at once (call between steps); returns its version."""
        tensors = load_file(str(Path(path) / WEIGHTS_FILE))
        self._fits(tensors)
        return self._load(llm_engine, tensors, read_drafter_version(path))

    def _load(self, llm_engine, tensors: dict, version: str) -> str:
        from specd.workers.engine.vllm_weights import update_draft_weights

        update = write_update_file(tensors, self.workdir / "draft-update.safetensors", self.vocab_size)
        try:
            update_draft_weights(llm_engine, str(update))
        finally:
            update.unlink(missing_ok=True)
        self.version = version
        self.swaps += 1
        log.info("vLLM's draft model now serves drafter version %s", version)
        return version

    def swap_stats(self) -> dict:
        rejected = dict(self.swapper.rejected) if self.swapper is not None else {}
        return {"version": self.version, "swaps": self.swaps, "rejected": rejected}

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.stop()
