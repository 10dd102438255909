"""Fast first start: with no bootstrapped drafter, serve takes the quick one where it was built, else the
seed (built once); a bootstrapped one wins; config that names a drafter, or needs none, is left alone.
(Building the seed and the quick drafter themselves is tested in tests/drafter_trainer.)"""

from __future__ import annotations

import json

import specd.drafter_trainer.seed as seed
from specd.cluster.first_start import (
    ensure_serving_drafter,
    quick_drafter_dirs,
    seed_drafter_dirs,
    trained_sources,
)
from specd.configs import load_config
from specd.workers.prompts import GENERAL_SOURCES


def _mark(path, sources=None) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if sources is not None:
        meta = {"format_version": 1, "train": {"prompts": {"sources": list(sources)}}}
        (path / "specd_drafter.json").write_text(json.dumps(meta))


def test_quick_drafter_when_none_is_bootstrapped(tmp_path) -> None:
    cfg = load_config([f"cache_dir={tmp_path}"])
    token, hidden = quick_drafter_dirs(str(tmp_path))
    _mark(token)
    _mark(hidden)
    assert ensure_serving_drafter(cfg, "unused") == str(hidden)
    assert cfg.drafter.path == str(hidden)
    cfg = load_config([f"cache_dir={tmp_path}", "drafter.target_hidden=false"])
    assert ensure_serving_drafter(cfg, "unused") == str(token)


def test_bootstrapped_or_configured_drafters_win(tmp_path) -> None:
    _mark(tmp_path / "drafters" / "boot-hidden")
    cfg = load_config([f"cache_dir={tmp_path}"])
    assert ensure_serving_drafter(cfg, "unused") is None and cfg.drafter.path is None
    cfg = load_config([f"cache_dir={tmp_path}", f"drafter.path={tmp_path}/mine"])
    assert ensure_serving_drafter(cfg, "unused") is None
    cfg = load_config([f"cache_dir={tmp_path / 'empty'}", "drafter=ngram"])
    assert ensure_serving_drafter(cfg, "unused") is None


def _fake_seed(built: list):
    def build(model_dir, token_dir, hidden_dir=None):    # the real build is tests/drafter_trainer's
        built.append((str(token_dir), str(hidden_dir) if hidden_dir else None))
        for path in (token_dir, hidden_dir):
            if path is not None:
                _mark(path, GENERAL_SOURCES)
    return build


def test_the_seed_is_built_once_when_nothing_was_trained(tmp_path, monkeypatch) -> None:
    built: list = []
    monkeypatch.setattr(seed, "build_seed_drafter", _fake_seed(built))
    token, hidden = seed_drafter_dirs(str(tmp_path))
    assert ensure_serving_drafter(load_config([f"cache_dir={tmp_path}"]), "unused") == str(hidden)
    assert built == [(str(token), str(hidden))]
    assert ensure_serving_drafter(load_config([f"cache_dir={tmp_path}"]), "unused") == str(hidden)
    assert len(built) == 1                            # in the cache now: reused
    cfg = load_config([f"cache_dir={tmp_path}", "drafter.target_hidden=false"])
    assert ensure_serving_drafter(cfg, "unused") == str(token) and len(built) == 1


def test_a_quick_drafter_from_other_sources_gives_way_to_the_seed(tmp_path, monkeypatch) -> None:
    token, hidden = quick_drafter_dirs(str(tmp_path))
    _mark(hidden, ["gsm8k", "humaneval"])            # built by an earlier version's quick preset
    built: list = []
    monkeypatch.setattr(seed, "build_seed_drafter", _fake_seed(built))
    assert trained_sources(hidden) == ["gsm8k", "humaneval"]
    assert ensure_serving_drafter(load_config([f"cache_dir={tmp_path}"]), "unused") == str(
        seed_drafter_dirs(str(tmp_path))[1])
    assert len(built) == 1
    (hidden / "specd_drafter.json").write_text("not json")   # unrecorded: served as it is
    assert ensure_serving_drafter(load_config([f"cache_dir={tmp_path}"]), "unused") == str(hidden)
    assert trained_sources(hidden) is None and len(built) == 1
