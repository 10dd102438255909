"""The OpenAI-compatible request and response shapes, and their translation to specd's own request.

Requests are pydantic models in strict mode: a known field of the wrong type (a string temperature, a
boolean max_tokens) is refused with a 400 naming it, before any tokenizing. Fields that would change
what a client gets and that specd cannot honour (n > 1, logprobs, penalties, logit_bias, tools, JSON
modes, echo, suffix, best_of) are refused by name, never ignored. Fields OpenAI's clients send that
change nothing here (user, store, metadata, ...) are accepted; unknown fields are ignored, as vLLM's
server does, so newer SDKs keep working.

Defaults follow OpenAI's API, not specd's gRPC API: an unset temperature is 1.0 (gRPC: greedy).

Translation goes to `serving_pb2.GenerateRequest`, the serving core's one request form
(cluster/serving.py), after the fields whose names differ from the gRPC API's (max_tokens,
speculation.gamma_max, speculation.policy) were checked against the operator's bounds under the names
the client used. Responses follow vLLM's server: `usage` has OpenAI's three counts plus specd's
`speculation` object.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specd.cluster.serving import ErrorCode, FinalEvent, ServingError
from specd.cluster.validation import Bounds
from specd.proto.specd.v1 import serving_pb2
from specd.workers.core.sampling import SEED_RANGE
from specd.workers.engine.types import FinishReason

OPENAI_TEMPERATURE_DEFAULT = 1.0
# OpenAI's finish reasons: "stop" for a stop string or an end-of-sequence token, "length" for the limit
_FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop",
           FinishReason.CANCELLED: "abort"}
# messages of cluster/validation.py start with the field they are about; these are OpenAI's names too
_SAME_NAMES = ("temperature", "top_k", "top_p", "seed", "stop", "tree_width")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Speculation(_Strict):
    """specd's extension: per-request speculation within the operator's bounds."""

    model_config = ConfigDict(strict=True, extra="forbid")
    enabled: bool | None = None
    gamma_max: int | None = None        # draft-length budget of a step (the gRPC API's gamma)
    tree_width: int | None = None       # 1 = chain; > 1 = token tree
    policy: str | None = None           # goodput, fixed, egag, confidence or adaptive


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None            # vLLM's extra; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False            # vLLM's extra, for benchmarks
    speculation: Speculation | None = None


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


def invalid(message: str, param: str | None = None) -> ServingError:
    return ServingError(ErrorCode.INVALID_ARGUMENT, message, param)


def parse(model: type[_Strict], body: Any) -> Any:
    """A request model from the decoded JSON body; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise invalid(f"{where}: {err['msg']}" if where else err["msg"], where or None) from None


def _refuse_unsupported(req: _Common) -> None:
    if req.n != 1:
        raise invalid(f"n={req.n} is not supported: specd returns one choice per request (n=1)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise invalid(f"{name} is not supported: it would change the target's distribution, and "
                          "specd's output is exactly the target's", name)
    if req.logit_bias:
        raise invalid("logit_bias is not supported", "logit_bias")
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs or req.top_logprobs:
            raise invalid("logprobs are not available: specd's engine does not return log-probabilities",
                          "logprobs")
        if req.tools:
            raise invalid("tools are not supported: specd parses no tool calls", "tools")
        kind = (req.response_format or {}).get("type", "text")
        if kind != "text":
            raise invalid(f"response_format type {kind!r} is not supported (only 'text')", "response_format")
    else:
        if req.logprobs is not None:
            raise invalid("logprobs are not available: specd's engine does not return log-probabilities",
                          "logprobs")
        if req.echo:
            raise invalid("echo is not supported", "echo")
        if req.suffix:
            raise invalid("suffix is not supported", "suffix")
        if req.best_of not in (None, 1):
            raise invalid(f"best_of={req.best_of} is not supported (1 only)", "best_of")


def _content(i: int, content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid(f"messages[{i}].content[{j}]: only text parts are supported, got {part.type!r}",
                          f"messages.{i}.content.{j}")
        texts.append(part.text)
    return "".join(texts)


def _sampling(req: _Common, max_tokens: int | None, name: str, bounds: Bounds) -> serving_pb2.SamplingOptions:
    opts = serving_pb2.SamplingOptions(ignore_eos=req.ignore_eos)
    if max_tokens is not None:
        if not 1 <= max_tokens <= bounds.max_new_tokens_cap:
            raise invalid(f"{name} must be in [1, {bounds.max_new_tokens_cap}] "
                          f"(sampling.max_new_tokens_cap), got {max_tokens}", name)
        opts.max_new_tokens = max_tokens
    opts.temperature = OPENAI_TEMPERATURE_DEFAULT if req.temperature is None else req.temperature
    if req.top_p is not None:
        opts.top_p = req.top_p
    if req.top_k is not None:
        opts.top_k = 0 if req.top_k == -1 else req.top_k
    if req.seed is not None:
        if not 0 <= req.seed < SEED_RANGE:
            raise invalid(f"seed={req.seed} is out of range: [0, 2**64 - 1]", "seed")
        opts.seed = req.seed
    if req.stop is not None:
        opts.stop.extend([req.stop] if isinstance(req.stop, str) else req.stop)
    return opts


def _speculation(spec: Speculation | None, bounds: Bounds) -> serving_pb2.SpeculationOptions:
    opts = serving_pb2.SpeculationOptions()
    if spec is None:
        return opts
    if spec.enabled is not None:
        if spec.enabled and not bounds.spec_enabled:
            raise invalid("speculation is disabled on this server (spec.enabled=false)",
                          "speculation.enabled")
        opts.enabled = spec.enabled
    if spec.gamma_max is not None:
        if not bounds.gamma_min <= spec.gamma_max <= bounds.gamma_max:
            raise invalid(f"speculation.gamma_max must be in [{bounds.gamma_min}, {bounds.gamma_max}] "
                          f"(the operator's spec.gamma_min, spec.gamma_max), got {spec.gamma_max}",
                          "speculation.gamma_max")
        opts.gamma = spec.gamma_max
    if spec.tree_width is not None:
        if not 1 <= spec.tree_width <= bounds.tree_width_max:
            raise invalid(f"speculation.tree_width must be in [1, {bounds.tree_width_max}] "
                          f"(1 = chain; the operator's spec.tree_width_max), got {spec.tree_width}",
                          "speculation.tree_width")
        opts.tree_width = spec.tree_width
    if spec.policy is not None:
        if spec.policy not in bounds.policies:
            raise invalid(f"speculation.policy {spec.policy!r} is not one of {list(bounds.policies)}",
                          "speculation.policy")
        opts.gamma_policy = spec.policy
    return opts


def to_generate_request(req: _Common, bounds: Bounds, request_id: str = "") -> serving_pb2.GenerateRequest:
    """The serving core's request for an OpenAI chat or completion request (raises ServingError)."""
    _refuse_unsupported(req)
    spec = _speculation(req.speculation, bounds)
    out = serving_pb2.GenerateRequest(request_id=request_id, speculation=spec)
    if isinstance(req, ChatCompletionRequest):
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise invalid("set max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        out.sampling.CopyFrom(_sampling(req, req.max_completion_tokens or req.max_tokens, name, bounds))
        for i, m in enumerate(req.messages):
            role = "system" if m.role == "developer" else m.role    # OpenAI's newer name for system
            out.chat.messages.add(role=role, content=_content(i, m.content))
        return out
    out.sampling.CopyFrom(_sampling(req, req.max_tokens, "max_tokens", bounds))
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise invalid(f"prompt holds {len(prompt)} prompts; specd takes one prompt per request "
                          "(send one request each)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        out.text = prompt
    else:
        out.token_ids.ids.extend(prompt)
    return out


def param_of(err: ServingError) -> str | None:
    """The request field an error is about: its own, or the one a validation message starts with."""
    if err.param is not None:
        return err.param
    word = err.message.split(" ", 1)[0].split("=", 1)[0].split("[", 1)[0]
    return word if word in _SAME_NAMES else None


def usage(final: FinalEvent) -> dict[str, Any]:
    """OpenAI's usage counts plus the `speculation` object (the glossary's words; MAL as vLLM defines
    it: 1 + accepted / drafting steps)."""
    stats, spec = final.stats, final.stats.spec
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": stats.prompt_tokens + final.completion_tokens,
        "speculation": {
            "steps": spec.steps,
            "drafting_steps": spec.drafting_steps,
            "drafted": spec.drafted,
            "accepted": spec.accepted,
            "recovered": spec.recovered,
            "bonus": spec.bonus,
            "acceptance_rate": spec.acceptance_rate,
            "mean_accepted_length": spec.mean_accepted_length,
            "tokens_per_step": spec.tokens_per_step,
            "drafted_per_position": list(spec.drafted_per_position),
            "accepted_per_position": list(spec.accepted_per_position),
            "drafter_versions": list(spec.drafter_versions),
            "time_to_first_token_s": stats.time_to_first_token,
            "queue_time_s": stats.queue_time,
            "total_time_s": stats.total_time,
        },
    }


def finish_reason(final: FinalEvent) -> str:
    return _FINISH.get(final.reason, "stop")


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict[str, Any]:
    """The fields every response and chunk of one request shares."""
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{request_id}", "object": kind, "created": created or int(time.time()),
            "model": model}
