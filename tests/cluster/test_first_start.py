"""Fast first start: with no bootstrapped drafter, serve takes the quick one; a bootstrapped one wins;
config that names a drafter, or needs none, is left alone. (Building the quick drafter itself is the
bootstrap's --quick preset, tested in tests/drafter_trainer.)"""

from __future__ import annotations

import json

import specd.drafter_trainer.bootstrap as bootstrap
from specd.cluster.first_start import ensure_serving_drafter, quick_drafter_dirs, trained_sources
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


def test_a_quick_drafter_from_other_sources_is_rebuilt_once(tmp_path, monkeypatch) -> None:
    token, hidden = quick_drafter_dirs(str(tmp_path))
    _mark(hidden, ["gsm8k", "humaneval"])            # built by an earlier version's quick preset
    built = []

    def fake_bootstrap(cfg):                          # the real build is tests/drafter_trainer's
        built.append(list(cfg.sources))
        (hidden / "specd_drafter.json").write_text(
            json.dumps({"train": {"prompts": {"sources": list(cfg.sources)}}}))

    monkeypatch.setattr(bootstrap, "bootstrap_drafter", fake_bootstrap)
    assert trained_sources(hidden) == ["gsm8k", "humaneval"]
    cfg = load_config([f"cache_dir={tmp_path}"])
    assert ensure_serving_drafter(cfg, "unused") == str(hidden)
    assert built == [list(GENERAL_SOURCES)]
    ensure_serving_drafter(load_config([f"cache_dir={tmp_path}"]), "unused")
    assert len(built) == 1                            # current now: kept
    (hidden / "specd_drafter.json").write_text("not json")
    ensure_serving_drafter(load_config([f"cache_dir={tmp_path}"]), "unused")
    assert len(built) == 1 and trained_sources(hidden) is None   # unrecorded: kept, never rebuilt blindly
