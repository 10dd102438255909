"""Check a GenerateRequest against the operator's bounds and turn it into what the scheduler runs.

Every rule here exists so that nothing a client sends reaches a worker in a shape it cannot handle: the
router answers INVALID_ARGUMENT with the message of `InvalidRequest` instead. Plain functions over the
proto message, the bounds and a text codec, so they are tested without a server.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Protocol

from specd.configs.schema import SpecdConfig
from specd.proto.specd.v1 import serving_pb2
from specd.workers.core.gamma import GAMMA_POLICIES
from specd.workers.core.sampling import MIN_TEMPERATURE, SEED_RANGE, SamplingParams
from specd.workers.engine.types import SpecParams

# Generous but finite: stop strings are searched in the decoded text after every step.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_DOMAIN_LENGTH = 64
MAX_REQUEST_ID_LENGTH = 128
CHAT_ROLES = ("system", "user", "assistant", "tool")
# server.max_prompt_chars unset: this many characters per token of the context. Real text averages
# 3-5 characters per token; the longest SmolLM2 tokens are 81 (runs of spaces or '#'), so only a
# prompt made mostly of such runs is refused before it could have fit.
PROMPT_CHARS_PER_TOKEN = 32
# The proto carries temperature as float32: compare with the float32 nearest to the bound.
_MIN_TEMPERATURE_F32 = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]


class InvalidRequest(ValueError):
    """A request the server refuses; str(exc) is the precise message the client sees."""


class TextCodec(Protocol):
    """What the router needs from a tokenizer (the real one is workers/models/chat.py, tests use a toy)."""

    def encode(self, text: str) -> list[int]: ...
    def render_chat(self, messages: list[dict[str, str]]) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Bounds:
    """The operator's limits, from the config and the target model's info()."""

    vocab_size: int
    max_seq_len: int
    max_new_tokens_default: int = 128
    max_new_tokens_cap: int = 1024
    temperature_max: float = 2.0
    spec_enabled: bool = True
    gamma_default: int = 4
    gamma_min: int = 0
    gamma_max: int = 8
    tree_width_default: int = 1
    tree_width_max: int = 4
    policy_default: str = "fixed"
    policies: tuple[str, ...] = tuple(sorted(GAMMA_POLICIES))
    # longest text or chat prompt in characters, checked before tokenizing; 0 = derived from max_seq_len
    max_prompt_chars: int = 0
    # False: a request may not set speculation on/off or γ (a vLLM engine whose proposer cannot hear them)
    per_request_speculation: bool = True

    @property
    def prompt_chars_limit(self) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.max_seq_len

    @classmethod
    def from_config(cls, cfg: SpecdConfig, target_info: dict) -> Bounds:
        return cls(
            vocab_size=int(target_info["vocab_size"]),
            max_seq_len=int(target_info.get("max_seq_len", cfg.target.max_seq_len)),
            max_new_tokens_default=cfg.sampling.max_new_tokens_default,
            max_new_tokens_cap=cfg.sampling.max_new_tokens_cap,
            temperature_max=cfg.sampling.temperature_max,
            spec_enabled=cfg.spec.enabled,
            gamma_default=cfg.spec.gamma,
            gamma_min=cfg.spec.gamma_min,
            gamma_max=cfg.spec.gamma_max,
            tree_width_default=cfg.spec.tree_width,
            tree_width_max=cfg.spec.tree_width_max,
            policy_default=cfg.spec.policy,
            max_prompt_chars=cfg.server.max_prompt_chars or 0,
        )


@dataclass(frozen=True)
class ValidRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int            # already clamped to what the context leaves after the prompt
    spec: SpecParams
    stop: tuple[str, ...]
    ignore_eos: bool
    client_request_id: str
    domain: str = ""
    skip_replay: bool = False


def _prompt(req: serving_pb2.GenerateRequest, bounds: Bounds, codec: TextCodec) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("request has no input: set one of chat, text or token_ids")
    if kind == "text":
        if not req.text:
            raise InvalidRequest("empty prompt: text is empty")
        _check_chars("text", len(req.text), bounds)
        ids = codec.encode(req.text)
    elif kind == "chat":
        messages = req.chat.messages
        if not messages:
            raise InvalidRequest("empty prompt: chat has no messages")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"chat.messages[{i}].role={m.role!r} is not one of {list(CHAT_ROLES)}")
        _check_chars("chat", sum(len(m.content) for m in messages), bounds)
        try:
            ids = codec.render_chat([{"role": m.role, "content": m.content} for m in messages])
        except Exception as exc:  # a template may reject an order of roles; that is the client's input
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc
    else:
        if len(req.token_ids.ids) >= bounds.max_seq_len:    # before copying or scanning a huge list
            raise InvalidRequest(
                f"prompt has {len(req.token_ids.ids)} tokens; the context allows at most "
                f"{bounds.max_seq_len - 1} (max_seq_len {bounds.max_seq_len} minus one generated token)"
            )
        ids = list(req.token_ids.ids)
        if not ids:
            raise InvalidRequest("empty prompt: token_ids is empty")
        for i, tok in enumerate(ids):
            if not 0 <= tok < bounds.vocab_size:
                raise InvalidRequest(
                    f"token_ids[{i}]={tok} is not a token id of the model "
                    f"(vocabulary [0, {bounds.vocab_size}))"
                )
    if not ids:
        raise InvalidRequest(f"empty prompt: the {kind} input encodes to no tokens")
    if len(ids) >= bounds.max_seq_len:
        raise InvalidRequest(
            f"prompt has {len(ids)} tokens; the context allows at most {bounds.max_seq_len - 1} "
            f"(max_seq_len {bounds.max_seq_len} minus one generated token)"
        )
    return ids


def _check_chars(kind: str, chars: int, bounds: Bounds) -> None:
    """Refuse a text too long to fit before the tokenizer spends time on it."""
    limit = bounds.prompt_chars_limit
    if chars > limit:
        raise InvalidRequest(f"the {kind} prompt has {chars} characters; at most {limit} "
                             f"(server.max_prompt_chars)")


def _sampling(opts: serving_pb2.SamplingOptions, bounds: Bounds) -> SamplingParams:
    temperature = opts.temperature if opts.HasField("temperature") else 0.0
    if not temperature >= 0.0:  # also NaN
        raise InvalidRequest(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not (math.isfinite(temperature) and temperature <= bounds.temperature_max):
        raise InvalidRequest(f"temperature must be <= {bounds.temperature_max}, got {temperature}")
    if 0.0 < temperature < _MIN_TEMPERATURE_F32:
        raise InvalidRequest(
            f"temperature={temperature:.6g} is out of range: 0 (greedy) or in "
            f"[{MIN_TEMPERATURE:g}, {bounds.temperature_max:g}]"
        )
    top_k = opts.top_k if opts.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {top_k}")
    if top_k >= bounds.vocab_size:
        top_k = 0  # keeping every token is top-k off; a k beyond the vocabulary would break torch.topk
    top_p = opts.top_p if opts.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    seed = opts.seed if opts.HasField("seed") else None
    if seed is not None and not 0 <= seed < SEED_RANGE:
        raise InvalidRequest(f"seed={seed} is out of range: [0, 2**64 - 1]")
    return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=seed)


def _max_new_tokens(opts: serving_pb2.SamplingOptions, bounds: Bounds, prompt_len: int) -> int:
    n = opts.max_new_tokens if opts.HasField("max_new_tokens") else bounds.max_new_tokens_default
    if n <= 0:
        raise InvalidRequest(f"max_new_tokens must be >= 1, got {n}")
    if n > bounds.max_new_tokens_cap:
        raise InvalidRequest(f"max_new_tokens must be <= {bounds.max_new_tokens_cap}, got {n}")
    return min(n, bounds.max_seq_len - prompt_len)


def _stop(opts: serving_pb2.SamplingOptions) -> tuple[str, ...]:
    stop = tuple(opts.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequest(f"stop[{i}] is empty")
        if len(s) > MAX_STOP_LENGTH:
            raise InvalidRequest(f"stop[{i}] has {len(s)} characters; at most {MAX_STOP_LENGTH}")
    return stop


def _spec(opts: serving_pb2.SpeculationOptions, bounds: Bounds) -> SpecParams:
    enabled = opts.enabled if opts.HasField("enabled") else bounds.spec_enabled
    if enabled and not bounds.spec_enabled:
        raise InvalidRequest("speculation is disabled on this server (spec.enabled=false)")
    gamma = opts.gamma if opts.HasField("gamma") else bounds.gamma_default
    fixed = not bounds.per_request_speculation
    if fixed and (enabled != bounds.spec_enabled or gamma != bounds.gamma_default):
        field = "enabled" if enabled != bounds.spec_enabled else "gamma"
        raise InvalidRequest(f"speculation.{field} cannot be set per request on this server: its vLLM "
                             "engine's proposer does not hear request settings (vLLM's own proposer, or "
                             "specd's outside the serving process): speculation is engine-wide here")
    if not bounds.gamma_min <= gamma <= bounds.gamma_max:
        raise InvalidRequest(f"gamma must be in [{bounds.gamma_min}, {bounds.gamma_max}], got {gamma}")
    width = opts.tree_width if opts.HasField("tree_width") else bounds.tree_width_default
    if not 1 <= width <= bounds.tree_width_max:
        raise InvalidRequest(
            f"tree_width must be in [1, {bounds.tree_width_max}] (1 = chain), got {width}"
        )
    policy = opts.gamma_policy or bounds.policy_default
    if policy not in bounds.policies:
        raise InvalidRequest(f"gamma_policy {policy!r} is not one of {list(bounds.policies)}")
    return SpecParams(gamma=gamma, policy=policy, tree_width=width, enabled=enabled)


def validate_request(
    req: serving_pb2.GenerateRequest, bounds: Bounds, codec: TextCodec
) -> ValidRequest:
    """The scheduler-ready form of `req`; raises InvalidRequest with a precise message."""
    if len(req.request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidRequest(
            f"request_id has {len(req.request_id)} characters; at most {MAX_REQUEST_ID_LENGTH}"
        )
    # Cheap checks first, so a bad number is reported without tokenizing a long prompt.
    sampling = _sampling(req.sampling, bounds)
    stop = _stop(req.sampling)
    spec = _spec(req.speculation, bounds)
    if req.sampling.HasField("max_new_tokens"):
        _max_new_tokens(req.sampling, bounds, prompt_len=0)
    ids = _prompt(req, bounds, codec)
    return ValidRequest(
        prompt_token_ids=ids,
        sampling=sampling,
        max_new_tokens=_max_new_tokens(req.sampling, bounds, prompt_len=len(ids)),
        spec=spec,
        stop=stop,
        ignore_eos=req.sampling.ignore_eos,
        client_request_id=req.request_id,
        domain=_domain(req.domain),
        skip_replay=req.skip_replay,
    )


def _domain(domain: str) -> str:
    if len(domain) > MAX_DOMAIN_LENGTH or not domain.isprintable():
        raise InvalidRequest(f"domain must be at most {MAX_DOMAIN_LENGTH} printable characters, "
                             f"got {domain[:80]!r}")
    return domain
