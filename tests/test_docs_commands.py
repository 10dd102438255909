"""Every `specd ...` command line shown in README.md, docs/ and the chart's README parses with the real
CLI, and every `specd serve` / `specd train` / `specd admin set` one passes the configuration's
validation: an example that could not start fails here. Config keys named in the docs exist in the
schema, and the defaults README's table states are the schema's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from specd.cluster.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
# decision records keep the commands of their day (history); these pages must be runnable now
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "helm" / "specd" / "README.md"]
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
INLINE = re.compile(r"`(specd [^`]+)`")
# a value the reader fills in: `drafter.version_pin=<version>`, `...`, brace expansions, your own yaml
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|…|\{[^}]*\}|[ =][A-Z](?![\w.])|/etc/specd --config-name")
# shown as what is refused: the test checks that they are
REFUSED = {"specd serve server.host=0.0.0.0"}
OVERRIDES_FILE = "spec.gamma=4\n"      # what `--overrides-file overrides.txt` reads in these tests


def commands(text: str) -> list[str]:
    """The `specd` command lines of a markdown text: in fenced blocks (continued with a backslash) and
    in inline code."""
    found = []
    for block in FENCE.findall(text):
        lines = block.split("\n")
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            if "specd " in line and (line.startswith(("specd ", "$ specd ")) or " && specd " in line):
                cmd = line[line.index("specd "):]
                while cmd.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    cmd = cmd[:-1] + " " + lines[i].strip()
                found.append(cmd)
            i += 1
    found += [" ".join(c.split()) for c in INLINE.findall(FENCE.sub("", text))]
    return found


CASES = [(doc, cmd) for doc in DOCS for cmd in commands(doc.read_text())]
RUNNABLE = [(d, c) for d, c in CASES if not PLACEHOLDER.search(c)]


def test_the_docs_show_many_runnable_commands() -> None:
    assert len(RUNNABLE) > 80 and len(CASES) - len(RUNNABLE) < 15


@pytest.mark.parametrize(("doc", "command"), RUNNABLE, ids=[f"{d.name}:{c[:60]}" for d, c in RUNNABLE])
def test_command_parses_and_its_config_validates(doc: Path, command: str, tmp_path, monkeypatch) -> None:
    from specd.cluster.admin import LIVE_KEYS
    from specd.cluster.serve import config_from_args
    from specd.configs import ConfigError, load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "overrides.txt").write_text(OVERRIDES_FILE)
    argv = shlex.split(command, comments=True)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{doc.name}: `{command}` does not parse (exit {exc.code})")
    try:
        if argv[:1] == ["serve"]:
            config_from_args(args)
        elif argv[:1] == ["train"]:
            load_config(list(args.overrides))
        elif argv[:2] == ["admin", "set"]:
            keys = [o.split("=", 1)[0] for o in args.overrides]
            assert set(keys) <= set(LIVE_KEYS), f"{doc.name}: `{command}`: not live keys: {keys}"
            load_config(list(args.overrides))
    except ConfigError as err:
        if command not in REFUSED:
            pytest.fail(f"{doc.name}: `{command}` is refused: {err}")
        return
    assert command not in REFUSED, f"{doc.name} says `{command}` is refused, but it validates"


KEY = re.compile(r"`((?:target|drafter|spec|sampling|server|ray|replay|trainer)\.[a-z_][a-z0-9_.]*)")
# pages that name Helm values (target.gpus, trainer.gpus, ...), not config keys, in the same form
HELM_PAGES = {ROOT / "docs" / "kubernetes.md", ROOT / "helm" / "specd" / "README.md"}
NOT_KEYS = {"ray.kill"}      # Ray's own function, in backticks


def _schema_values() -> dict[str, str]:
    from specd.configs import flatten, load_config

    return flatten(load_config([]))


def test_every_config_key_the_docs_name_exists() -> None:
    values = _schema_values()
    unknown = {}
    for doc in sorted(set(DOCS) - HELM_PAGES):
        for key in set(KEY.findall(doc.read_text())) - NOT_KEYS:
            key = key.rstrip(".")
            # a key inside a mapping (target.resources.specd_target) names its mapping's key; `replay.tls_*`
            # names several
            if key not in values and not any(key.startswith(k + ".") for k in values) and not (
                    key.endswith("_") and any(k.startswith(key) for k in values)):
                unknown.setdefault(doc.name, []).append(key)
    assert not unknown, f"keys named in docs that configs/schema.py does not have: {unknown}"


def test_readme_table_states_the_schema_defaults() -> None:
    """README's table of first keys: each row's defaults (one per key, or one for several) are the
    schema's."""
    values = _schema_values()
    rows = re.findall(r"^\| (`[a-z][^|]*) \| ([^|]*) \|", (ROOT / "README.md").read_text(), re.M)
    checked = 0
    for keys_cell, default_cell in rows:
        keys = re.findall(r"`([a-z_]+\.[a-z_.]+)`", keys_cell)
        if not keys or not all(k in values for k in keys):
            continue
        stated = [d.strip().strip("`") for d in default_cell.split(",")] if len(keys) > 1 else [
            default_cell.strip().strip("`")]
        if len(stated) == 1 and len(keys) > 1:
            stated = stated * len(keys)
        for key, default in zip(keys, stated, strict=True):
            actual = values[key]
            said = f"README says {key} defaults to {default}; schema: {actual}"
            if default == "unset":
                assert actual in ("None", "null", ""), said
            elif re.fullmatch(r"\d+(\.\d+)?", default) and re.fullmatch(r"\d+(\.\d+)?", actual):
                assert float(default) == float(actual), said
            else:
                assert default == actual, said
            checked += 1
    assert checked >= 15
