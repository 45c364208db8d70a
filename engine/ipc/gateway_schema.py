"""OpenAI request parsing and response shapes for the gateway: pure functions.

Owns: turning a decoded JSON body of ``POST /v1/chat/completions`` or
``POST /v1/completions`` into a ``ChatRequest`` / ``CompletionRequest`` (or a
``BadRequest`` naming the field and the bad value), and building the response
objects (``chat.completion``, ``chat.completion.chunk``, ``text_completion``,
``list`` of models, error bodies) exactly as the OpenAI API shapes them.
Leaves to others: HTTP, authentication and the engine (``gateway.py``).

What is supported, ignored and refused (the table the tests follow):

* used: ``messages`` (roles system/developer/user/assistant; content a string or
  a list of ``{"type": "text"}`` parts), ``max_tokens`` / ``max_completion_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``stop`` (a string or up to 4), ``stream``,
  ``stream_options.include_usage``, ``n`` = 1; the llama.cpp-style extensions
  ``top_k``, ``min_p``, ``repeat_penalty``. Sampling fields left out take the
  engine's defaults (``protocol.SamplingParams``), not OpenAI's.
* ``model`` routes the request (``Gateway.route``: an installed model by name, else the
  default one; replies name the model that ran); ignored: ``user``,
  ``frequency_penalty``, ``presence_penalty``, ``metadata``, ``store``,
  ``service_tier``, ``parallel_tool_calls``, ``reasoning_effort``,
  ``modalities`` = ["text"], ``response_format`` = text, empty ``tools`` /
  ``logit_bias``, and any field not named here.
* refused (400): ``n`` > 1, non-empty ``tools`` / ``functions``, ``logprobs``,
  ``top_logprobs``, ``logit_bias``, ``response_format`` other than text, audio,
  image or other non-text content parts, and for completions ``echo``,
  ``suffix``, ``best_of`` > 1 and token-id prompts.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aotx.engine.ipc import protocol as P


class BadRequest(Exception):
    """A request the gateway refuses with 400; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Limits:
    """Per-request limits: bytes of body, messages, and the max_tokens ceiling."""

    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_tokens_ceiling: int = 4096
    default_max_tokens: int = P.SamplingParams().max_tokens


@dataclass(frozen=True)
class ChatRequest:
    """A parsed chat request. ``messages``: (role, text) with system/developer
    folded into ``system``; the last one is a user message."""

    system: str | None
    messages: list[tuple[str, str]]
    sampling: P.SamplingParams
    stream: bool
    include_usage: bool
    model: str | None


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    sampling: P.SamplingParams
    stream: bool
    include_usage: bool
    model: str | None


_ROLES = ("system", "developer", "user", "assistant")


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _param(body: dict, name: str, limit: P.Limit) -> float | int | None:
    """``body[name]`` checked against ``limit`` (the protocol's ranges), None when absent."""
    v = body.get(name)
    if v is None:
        return None
    if limit.integer:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        elif isinstance(v, bool) or not isinstance(v, int):
            raise BadRequest(f"'{name}' must be an integer, got {_type_name(v)}", name)
    elif isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{name}' must be a number, got {_type_name(v)}", name)
    why = P.limit_problem(f"'{name}'", v, limit)
    if why:
        raise BadRequest(why, name)
    return v if limit.integer else float(v)


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    return _param(body, name, P.Limit(lo, hi))


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    return _param(body, name, P.Limit(lo, hi, integer=True))


#: OpenAI documents temperature in [0, 2]; the engine takes more (``SAMPLING_LIMITS``)
OPENAI_MAX_TEMPERATURE = 2.0
#: the sampling fields the gateway takes, each with the protocol's range
SAMPLING_FIELDS: dict[str, P.Limit] = {
    "temperature": P.SAMPLING_LIMITS["temperature"]._replace(hi=OPENAI_MAX_TEMPERATURE),
    **{name: P.SAMPLING_LIMITS[name] for name in ("top_p", "top_k", "min_p", "repeat_penalty")},
}


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be a boolean, got {_type_name(v)}", name)
    return v


def _refuse_if(cond: bool, name: str, why: str) -> None:
    if cond:
        raise BadRequest(f"'{name}' is not supported: {why}", name, "unsupported_parameter")


def _common(body: Any, limits: Limits) -> tuple[P.SamplingParams, bool, bool, str | None]:
    """Sampling, stream, include_usage and model of either endpoint's body."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_type_name(body)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, got {_type_name(model)}", "model")
    n = _integer(body, "n", 1, 128)
    _refuse_if(n is not None and n != 1, "n", f"this server returns one choice per request (n=1), got n={n}")
    _refuse_if(body.get("logprobs") not in (None, False, 0), "logprobs", "log probabilities are not returned")
    _refuse_if(body.get("top_logprobs") not in (None, 0), "top_logprobs", "log probabilities are not returned")
    lb = body.get("logit_bias")
    _refuse_if(lb not in (None, {}) , "logit_bias", "logit bias is not applied")
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest(f"'stream_options' must be an object, got {_type_name(so)}", "stream_options")
    include_usage = bool(so and so.get("include_usage") is True)
    for name in ("frequency_penalty", "presence_penalty"):
        _number(body, name, -2.0, 2.0)  # checked, not applied
    mt = _integer(body, "max_completion_tokens", 1, 1 << 31)
    if mt is None:
        mt = _integer(body, "max_tokens", 1, 1 << 31)
    if mt is not None and mt > limits.max_tokens_ceiling:
        raise BadRequest(f"'max_tokens' is {mt}; this server allows at most {limits.max_tokens_ceiling}",
                         "max_tokens")
    sp = P.SamplingParams(max_tokens=mt if mt is not None else min(limits.default_max_tokens,
                                                                     limits.max_tokens_ceiling))
    for name, limit in SAMPLING_FIELDS.items():
        v = _param(body, name, limit)
        if v is not None:
            setattr(sp, name, v if name != "top_p" or v > 0 else 1e-6)  # OpenAI's top_p 0: the top token
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    if seed is not None:
        sp.seed = seed & 0x7FFFFFFFFFFFFFFF  # the engine takes a non-negative seed; negative ones wrap
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or an array of strings", "stop")
        if len(stop) > 4:
            raise BadRequest(f"'stop' has {len(stop)} strings; at most 4 are allowed", "stop")
        sp.stop = [s for s in stop if s]
    return sp, stream, include_usage, model


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise BadRequest(f"'{where}.content[{j}]' must be an object, got {_type_name(part)}", "messages")
            kind = part.get("type")
            if kind != "text":
                raise BadRequest(f"'{where}.content[{j}]' is of type {kind!r}; only text parts are supported",
                                 "messages", "unsupported_content")
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"'{where}.content[{j}].text' must be a string, got {_type_name(text)}", "messages")
            parts.append(text)
        return "".join(parts)
    raise BadRequest(f"'{where}.content' must be a string or an array of parts, got {_type_name(content)}", "messages")


def parse_chat(body: Any, limits: Limits) -> ChatRequest:
    """Validate a chat completions body. Raises BadRequest naming the field."""
    sp, stream, include_usage, model = _common(body, limits)
    for name in ("tools", "functions"):
        v = body.get(name)
        _refuse_if(v not in (None, []), name, "tool and function calling are not supported")
    tc = body.get("tool_choice")
    _refuse_if(tc not in (None, "none", "auto"), "tool_choice", "tool calling is not supported")
    _refuse_if(body.get("audio") is not None, "audio", "audio output is not supported")
    mods = body.get("modalities")
    _refuse_if(mods not in (None, ["text"]), "modalities", "only text output is supported")
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise BadRequest(f"'response_format' must be an object, got {_type_name(rf)}", "response_format")
        _refuse_if(rf.get("type") != "text", "response_format",
                   f"only {{\"type\": \"text\"}} is supported, got {rf.get('type')!r}")
    msgs = body.get("messages")
    if msgs is None:
        raise BadRequest("'messages' is required", "messages")
    if not isinstance(msgs, list):
        raise BadRequest(f"'messages' must be an array, got {_type_name(msgs)}", "messages")
    if not msgs:
        raise BadRequest("'messages' is empty; send at least one user message", "messages")
    if len(msgs) > limits.max_messages:
        raise BadRequest(f"'messages' has {len(msgs)} entries; this server allows at most {limits.max_messages}",
                         "messages")
    system: list[str] = []
    turns: list[tuple[str, str]] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{where}' must be an object, got {_type_name(m)}", "messages")
        role = m.get("role")
        if role not in _ROLES:
            if role in ("tool", "function"):
                raise BadRequest(f"'{where}.role' is {role!r}; tool messages are not supported", "messages",
                                 "unsupported_parameter")
            raise BadRequest(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
        if m.get("tool_calls"):
            raise BadRequest(f"'{where}.tool_calls': tool calling is not supported", "messages",
                             "unsupported_parameter")
        text = _text_of(m.get("content"), where)
        if role in ("system", "developer"):
            system.append(text)
        else:
            turns.append((role, text))
    if not turns or turns[-1][0] != "user":
        raise BadRequest("the last non-system message must have role 'user'", "messages")
    return ChatRequest(system="\n\n".join(system) if system else None, messages=turns, sampling=sp,
                       stream=stream, include_usage=include_usage, model=model)


def parse_completion(body: Any, limits: Limits) -> CompletionRequest:
    """Validate a (legacy) completions body; the prompt goes to the engine raw."""
    sp, stream, include_usage, model = _common(body, limits)
    _refuse_if(_bool(body, "echo"), "echo", "the prompt is not echoed")
    _refuse_if(body.get("suffix") not in (None, ""), "suffix", "insertion (suffix) is not supported")
    bo = _integer(body, "best_of", 1, 128)
    _refuse_if(bo is not None and bo != 1, "best_of", f"best_of must be 1, got {bo}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt")
    if not isinstance(prompt, str):
        if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            raise BadRequest(f"'prompt' has {len(prompt)} strings; send one prompt per request", "prompt")
        raise BadRequest(f"'prompt' must be a string (token-id prompts are not supported), got {_type_name(prompt)}",
                         "prompt")
    if not prompt:
        raise BadRequest("'prompt' is empty", "prompt")
    return CompletionRequest(prompt=prompt, sampling=sp, stream=stream, include_usage=include_usage, model=model)


# ---- response shapes -----------------------------------------------------------

FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class Reply:
    """What one generation produced, for the response builders."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    finish_reason: str = "stop"
    n_prompt: int = 0
    n_completion: int = 0
    aotx: dict[str, Any] = field(default_factory=dict)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": self.n_completion,
                "total_tokens": self.n_prompt + self.n_completion}


def chat_completion(r: Reply) -> dict[str, Any]:
    return {"id": r.id, "object": "chat.completion", "created": r.created, "model": r.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text, "refusal": None},
                         "logprobs": None, "finish_reason": FINISH.get(r.finish_reason, "stop")}],
            "usage": r.usage(), "aotx": r.aotx}


def chat_chunk(r: Reply, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": r.id, "object": "chat.completion.chunk", "created": r.created, "model": r.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": FINISH.get(finish, "stop") if finish else None}]}


def text_completion(r: Reply) -> dict[str, Any]:
    return {"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": r.text, "logprobs": None,
                         "finish_reason": FINISH.get(r.finish_reason, "stop")}],
            "usage": r.usage(), "aotx": r.aotx}


def text_chunk(r: Reply, text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": FINISH.get(finish, "stop") if finish else None}]}


def usage_chunk(r: Reply, chat: bool) -> dict[str, Any]:
    return {"id": r.id, "object": "chat.completion.chunk" if chat else "text_completion", "created": r.created,
            "model": r.model, "system_fingerprint": None, "choices": [], "usage": r.usage()}


def receipt_event(r: Reply, chat: bool) -> dict[str, Any]:
    """Data of the ``aotx.receipt`` SSE event: a well-formed chunk with an empty
    delta (so OpenAI clients, which do not skip named events, see a harmless
    chunk) plus the ``aotx`` object with the receipt."""
    base = (chat_chunk(r, {}, r.finish_reason) if chat else text_chunk(r, "", r.finish_reason))
    base["aotx"] = r.aotx
    return base


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    err = {"message": message, "type": type_, "param": param, "code": code}
    err.update(extra)
    return {"error": err}


def receipt_dict(rc: P.Receipt | None) -> dict[str, int] | None:
    if rc is None:
        return None
    return {"segment": rc.segment, "offset": rc.offset, "last_seq": rc.last_seq}
