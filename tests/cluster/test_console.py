"""`specd serve`'s console (cluster/console.py): phase lines and specd's warnings on the console, every
record in the log file, everything on the console again with verbose."""

from __future__ import annotations

import io
import logging

import pytest

from specd.cluster import console


@pytest.fixture
def restore_root():
    import tqdm.std

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    bars = tqdm.std.tqdm.__dict__["__init__"]
    yield
    tqdm.std.tqdm.__init__ = bars          # quiet setup turned every bar off
    tqdm.std.tqdm._specd_quiet = False
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])
    logging.captureWarnings(False)
    from transformers.utils import logging as hf_logging  # quiet setup turned its handler and bars off

    hf_logging.enable_default_handler()
    hf_logging.disable_propagation()
    hf_logging.enable_progress_bar()


def _emit() -> None:
    console.phase("model %s ready", "M")
    logging.getLogger("specd.cluster.serve").info("an INFO of specd's")
    logging.getLogger("specd.cluster.online").warning("a warning of specd's")
    logging.getLogger("ray._private.worker").warning("SIGTERM handler is not set")   # after quiet_ray_logger
    logging.getLogger("some.library").error("a third-party error")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("specd.cluster.serve").exception("it failed")


def _run(tmp_path, monkeypatch, verbose: bool) -> tuple[str, str]:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    log_file = console.setup(verbose, tmp_path / "logs" / "serve.log")
    ray_log = logging.getLogger("ray")       # as serve does before ray.init; Ray's own state comes back
    monkeypatch.setattr(ray_log, "handlers", list(ray_log.handlers))
    monkeypatch.setattr(ray_log, "propagate", ray_log.propagate)
    console.quiet_ray_logger(False)
    _emit()
    for handler in logging.getLogger().handlers:
        handler.flush()
    return err.getvalue(), log_file.read_text()


def test_quiet_console_shows_phases_and_specds_warnings_only(tmp_path, monkeypatch, restore_root) -> None:
    shown, filed = _run(tmp_path, monkeypatch, verbose=False)
    lines = shown.splitlines()
    assert lines[0].startswith("specd: model M ready (") and lines[0].endswith(" s)")
    assert lines[1:] == ["specd warning: a warning of specd's",
                         "specd error: it failed (the traceback is in the log file)"]
    for text in ("model M ready", "an INFO of specd's", "a warning of specd's", "SIGTERM handler is not set",
                 "a third-party error", "RuntimeError: boom"):
        assert text in filed


def test_verbose_console_shows_every_record(tmp_path, monkeypatch, restore_root) -> None:
    shown, filed = _run(tmp_path, monkeypatch, verbose=True)
    for text in ("model M ready", "an INFO of specd's", "SIGTERM handler is not set", "a third-party error"):
        assert text in shown and text in filed
