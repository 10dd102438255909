"""A named target made in the test: a tiny GGUF written with `gguf`, split into part packages laid out as
the real ones on PyPI (`<module>/data/partNN.bin`), on sys.path, registered with its size and SHA-256."""

from __future__ import annotations

import hashlib
import importlib
import string
from pathlib import Path

import numpy as np

from specd.workers.models.targets import NamedTarget

TEST_TARGET = "tiny-test-llama"
VOCAB = 64


def write_tiny_gguf(path: Path, seed: int = 0) -> bytes:
    """A 2-layer float32 Llama with a byte-level BPE tokenizer that transformers' GGUF loader reads.
    Returns the file's bytes (about 30 KB)."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, inter, layers, heads, kv_heads = 16, 32, 2, 2, 1
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(VOCAB)
    # 3 specials, 60 single characters, one merge ("a b" -> "ab"): transformers' BPE needs a merge
    chars = (string.ascii_lowercase + string.ascii_uppercase + string.digits)[: VOCAB - 4]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "<unk>", *chars, "ab"])
    w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(VOCAB, hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(hidden, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(head_dim * kv_heads, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(head_dim * kv_heads, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(hidden, hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(inter, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(inter, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(hidden, inter))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(VOCAB, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def install_parts(site: Path, data: bytes, parts: int, module: str = "tinytest_part{n}") -> list[Path]:
    """Split `data` into `parts` packages under `site` (`<module>/__init__.py`, `<module>/data/partNN.bin`)
    as the real wheels lay them out; returns the part files in order."""
    cuts = np.linspace(0, len(data), parts + 1).astype(int)
    files = []
    for n in range(1, parts + 1):
        pkg = site / module.format(n=n)
        (pkg / "data").mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("raise ImportError('a part package is never imported')\n")
        f = pkg / "data" / f"part{n:02d}.bin"
        f.write_bytes(data[cuts[n - 1]:cuts[n]])
        files.append(f)
    importlib.invalidate_caches()      # the caller puts `site` on sys.path (monkeypatch.syspath_prepend)
    return files


def tiny_target(data: bytes, parts: int, sha256: str | None = None, size: int | None = None) -> NamedTarget:
    """A registry entry for parts made by install_parts (the pinned figures: `data`'s unless given)."""
    return NamedTarget(
        name=TEST_TARGET, display_name="Tiny-Test-Llama", params="30 K",
        distribution="tinytest-part{n}", module="tinytest_part{n}", part_file="data/part{n:02d}.bin",
        parts=parts, version="0.1.0", size=len(data) if size is None else size,
        sha256=sha256 or hashlib.sha256(data).hexdigest(), gguf_name="Tiny-Test-Llama-F32.gguf",
        licence="Apache-2.0", source="made in the test", scope=TEST_TARGET,
    )
