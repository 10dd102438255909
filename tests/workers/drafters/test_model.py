"""ModelDrafter on a tiny random Llama: seeds at the edge of the 64-bit range."""

from __future__ import annotations

import pytest

from workers.core.sampling import SamplingParams
from workers.drafters.model import ModelDrafter


@pytest.fixture(scope="module")
def drafter(tiny_llama_dir):
    return ModelDrafter(tiny_llama_dir, max_slots=4, max_seq_len=64, pack="none")


def test_seed_at_the_top_of_the_uint64_range_drafts(drafter):
    # The API accepts any uint64 seed; the drafter derives its own stream from it without overflow.
    sampled = SamplingParams(temperature=1.0, seed=2**64 - 1)
    runs = []
    for rid in ("a", "b"):
        drafter.add_request(rid, [3, 4, 5], seed=sampled.seed)
        runs.append(drafter.propose([rid], [4], [sampled]).tokens[0])
        drafter.remove_request(rid)
    assert len(runs[0]) == 4 and runs[0] == runs[1]  # seeded: reproducible
