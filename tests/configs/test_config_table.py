"""docs/operations.md's configuration table is generated from configs/schema.py and must be current; every
key has a meaning (its comment in the schema)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specd.configs import flatten, load_config

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_operations_doc_table_is_current() -> None:
    script = load_script()
    doc = (ROOT / "docs" / "operations.md").read_text()
    assert script.render(doc) == doc, "stale config table: python scripts/config_table.py"
    assert script.main(["--check"]) == 0


def test_every_key_is_in_the_table_with_a_meaning_and_its_default() -> None:
    rows = {key: (default, meaning) for key, _, default, meaning in load_script().rows()}
    flat = flatten(load_config())
    assert set(rows) == set(flat)
    for key, (default, meaning) in rows.items():
        assert meaning, f"{key} has no comment in configs/schema.py"
        if key not in ("drafter.max_seq_len", "drafter.device", "name"):    # resolved / set by config.yaml
            assert default == flat[key], key
