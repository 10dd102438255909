"""validate_request: defaults, clamping, and one precise message per kind of bad input."""

from __future__ import annotations

import pytest

from specd.cluster.client import build_request
from specd.cluster.validation import Bounds, InvalidRequest, validate_request
from specd.configs.schema import SpecdConfig
from specd.proto.specd.v1 import serving_pb2


class ToyCodec:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text]

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if messages[0]["role"] == "assistant":
            raise ValueError("conversation must start with a user message")
        return [1] + [t for m in messages for t in self.encode(m["content"])] + [2]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(65 + t % 26) for t in token_ids)


BOUNDS = Bounds(vocab_size=50, max_seq_len=20, max_new_tokens_default=8, max_new_tokens_cap=16,
                temperature_max=1.5, gamma_default=4, gamma_min=1, gamma_max=6, tree_width_max=3)


def valid(**kw):
    return validate_request(build_request(**kw), BOUNDS, ToyCodec())


def invalid(message: str, bounds: Bounds = BOUNDS, **kw) -> None:
    with pytest.raises(InvalidRequest) as err:
        validate_request(build_request(**kw), bounds, ToyCodec())
    assert message in str(err.value)


def test_defaults_fill_unset_fields() -> None:
    v = valid(text="abc")
    assert v.prompt_token_ids == [ord(c) % 50 for c in "abc"]
    assert v.max_new_tokens == 8 and v.stop == () and not v.ignore_eos
    s = v.sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.0, 0, 1.0, None)
    assert (v.spec.gamma, v.spec.tree_width, v.spec.policy, v.spec.enabled) == (4, 1, "fixed", True)


def test_explicit_settings_pass_through() -> None:
    v = valid(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
              temperature=0.7, top_k=5, top_p=0.9, seed=2**63 + 1, stop=["\n\n"], ignore_eos=True,
              gamma=6, tree_width=3, gamma_policy="egag", max_new_tokens=5, request_id="mine")
    assert v.prompt_token_ids[0] == 1 and v.prompt_token_ids[-1] == 2
    assert v.sampling.temperature == pytest.approx(0.7) and v.sampling.top_k == 5
    assert v.sampling.seed == 2**63 + 1 and v.stop == ("\n\n",) and v.ignore_eos
    assert (v.spec.gamma, v.spec.tree_width, v.spec.policy) == (6, 3, "egag")
    assert v.max_new_tokens == 5 and v.client_request_id == "mine"
    assert valid(token_ids=[0, 49], speculation=False).spec.enabled is False


def test_max_new_tokens_is_clamped_to_the_context() -> None:
    assert valid(token_ids=list(range(15)), max_new_tokens=16).max_new_tokens == 5
    assert valid(token_ids=list(range(19))).max_new_tokens == 1


def test_top_k_beyond_the_vocabulary_means_off() -> None:
    assert valid(text="a", top_k=50).sampling.top_k == 0
    assert valid(text="a", top_k=49).sampling.top_k == 49


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(text=""), "empty prompt: text is empty"),
    (dict(messages=[]), "empty prompt: chat has no messages"),
    (dict(token_ids=[]), "empty prompt: token_ids is empty"),
    (dict(token_ids=list(range(20))), "prompt has 20 tokens; the context allows at most 19"),
    (dict(text="a", max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
    (dict(text="a", max_new_tokens=17), "max_new_tokens must be <= 16, got 17"),
    (dict(text="a", temperature=-0.5), "temperature must be >= 0"),
    (dict(text="a", temperature=float("inf")), "temperature must be <= 1.5"),
    (dict(text="a", temperature=1e-38), "temperature=1e-38 is out of range: 0 (greedy) or in [1e-05, 1.5]"),
    (dict(text="a", top_p=0.0), "top_p must be in (0, 1]"),
    (dict(text="a", top_p=float("nan")), "top_p must be in (0, 1]"),
    (dict(text="a", top_k=-1), "top_k must be >= 0"),
    (dict(text="a", gamma=0), "gamma must be in [1, 6], got 0"),
    (dict(text="a", gamma=7), "gamma must be in [1, 6], got 7"),
    (dict(text="a", tree_width=0), "tree_width must be in [1, 3]"),
    (dict(text="a", gamma_policy="greedy"), "gamma_policy 'greedy' is not one of"),
    (dict(token_ids=[3, 50]), "token_ids[1]=50 is not a token id of the model (vocabulary [0, 50))"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "chat.messages[0].role='wizard'"),
    (dict(messages=[{"role": "assistant", "content": "x"}]), "the chat template rejected the messages"),
    (dict(text="a", stop=["x"] * 17), "at most 16 stop strings"),
    (dict(text="a", stop=["x" * 300]), "stop[0] has 300 characters"),
    (dict(text="a", request_id="r" * 200), "request_id has 200 characters"),
])
def test_each_bad_input_has_a_precise_message(kwargs, message) -> None:
    invalid(message, **kwargs)


def test_request_without_input() -> None:
    with pytest.raises(InvalidRequest, match="no input"):
        validate_request(serving_pb2.GenerateRequest(), BOUNDS, ToyCodec())


def test_bad_numbers_are_reported_before_a_long_prompt_is_encoded() -> None:
    class Exploding(ToyCodec):
        def encode(self, text):
            raise AssertionError("should not encode")

    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        validate_request(build_request(text="a" * 1000, max_new_tokens=0), BOUNDS, Exploding())


def test_speculation_cannot_be_asked_for_when_the_operator_disabled_it() -> None:
    off = Bounds(vocab_size=50, max_seq_len=20, spec_enabled=False)
    assert validate_request(build_request(text="a"), off, ToyCodec()).spec.enabled is False
    invalid("speculation is disabled on this server", off, text="a", speculation=True)


def test_bounds_from_config_and_target_info() -> None:
    cfg = SpecdConfig(name="t")
    b = Bounds.from_config(cfg, {"vocab_size": 49152, "max_seq_len": 1024})
    assert (b.vocab_size, b.max_seq_len, b.gamma_max, b.max_new_tokens_cap) == (49152, 1024, 8, 1024)
    assert {"fixed", "egag", "adaptive"} <= set(b.policies)


def test_seed_range_edges() -> None:
    assert valid(text="a", seed=2**64 - 1).sampling.seed == 2**64 - 1
    assert valid(text="a", seed=0).sampling.seed == 0
    assert valid(text="a", temperature=1e-5).sampling.temperature == pytest.approx(1e-5)


def test_domain_tag_passes_through_and_is_bounded() -> None:
    assert valid(text="hi", domain="gsm8k").domain == "gsm8k"
    assert valid(text="hi").domain == ""
    invalid("domain must be at most 64", text="hi", domain="x" * 65)
    invalid("domain must be at most 64", text="hi", domain="bad\ntag")
