"""Fast first start: with no bootstrapped drafter, serve takes the quick one; a bootstrapped one wins;
config that names a drafter, or needs none, is left alone. (Building the quick drafter itself is the
bootstrap's --quick preset, tested in tests/drafter_trainer.)"""

from __future__ import annotations

from cluster.first_start import ensure_serving_drafter, quick_drafter_dirs
from configs import load_config


def _mark(path) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")


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
