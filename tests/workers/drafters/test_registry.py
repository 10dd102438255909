import sys

import pytest

import specd.workers.drafters
from specd.workers.drafters.base import Drafter, DraftProposal
from specd.workers.drafters.ngram import NGramDrafter
from specd.workers.drafters.registry import DRAFTERS, build_drafter, register_drafter


class ToyDrafter(Drafter):
    """Always drafts token 0; enough to exercise the registry."""

    def __init__(self, token: int = 0) -> None:
        self.token = token
        self.version = "toy-1"

    @classmethod
    def from_config(cls, cfg, *, target_model_dir, cache_dir=None, seed=0):
        return cls(token=cfg.token)

    def add_request(self, request_id, prompt_tokens, seed=None):
        pass

    def propose(self, request_ids, gammas, params, policy=None, states=None):
        return DraftProposal(tokens=[[self.token] * g for g in gammas])

    def commit(self, request_id, num_accepted, new_tokens):
        pass

    def remove_request(self, request_id):
        pass


@pytest.fixture
def clean_registry():
    """Changes to DRAFTERS inside a test are undone afterwards."""
    saved = dict(DRAFTERS)
    yield DRAFTERS
    DRAFTERS.clear()
    DRAFTERS.update(saved)


def test_ngram_is_registered_and_built_from_config() -> None:
    assert DRAFTERS["ngram"] is NGramDrafter
    drafter = build_drafter("ngram", min_ngram=1, max_ngram=3)
    assert isinstance(drafter, NGramDrafter)
    assert (drafter.name, drafter.min_ngram, drafter.max_ngram) == ("ngram", 1, 3)


def test_register_and_build_a_new_drafter(clean_registry) -> None:
    register_drafter("toy")(ToyDrafter)
    assert ToyDrafter.name == "toy"
    drafter = build_drafter("toy", token=7)
    assert drafter.propose(["a"], [3], [None]).tokens == [[7, 7, 7]]


def test_taken_name_and_non_drafters_are_refused(clean_registry) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_drafter("ngram")(ToyDrafter)
    with pytest.raises(TypeError):
        register_drafter("not_a_drafter")(dict)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="ngram"):
        build_drafter("no_such_drafter")


def test_unknown_config_key_raises() -> None:
    with pytest.raises(TypeError):
        build_drafter("ngram", bogus=1)


def test_build_imports_the_drafter_module_on_first_use(clean_registry, monkeypatch) -> None:
    # Simulate a drafter whose module was never imported: build_drafter must import specd.workers.drafters.ngram.
    del DRAFTERS["ngram"]
    monkeypatch.delitem(sys.modules, "specd.workers.drafters.ngram")
    monkeypatch.delattr(specd.workers.drafters, "ngram")
    drafter = build_drafter("ngram")
    assert drafter.name == "ngram"
    assert "ngram" in DRAFTERS
