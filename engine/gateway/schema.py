"""OpenAI request parsing for the gateway: pure functions.

Owns: turning a decoded JSON body of ``POST /v1/chat/completions`` or
``POST /v1/completions`` into a ``ChatRequest`` / ``CompletionRequest`` (or a
``BadRequest`` naming the field and the bad value; ``fields.py`` holds the errors and
the tools and response-format parsing, re-exported here), with several choices, tool
calls and log probabilities, and the ``Spec`` of one generation every API fills in. Leaves
to others: the response objects (``shapes.py``), HTTP, authentication and the engine
(``server.py``), media parts (``media.py``).

What is supported, ignored and refused (the table the tests follow):

* used: ``messages`` (roles system/developer/user/assistant/tool; content a string
  or a list of ``text``, ``image_url`` and ``input_audio`` parts; an assistant's
  ``tool_calls``; a tool message's ``tool_call_id``), ``tools`` (functions),
  ``tool_choice`` (auto, none, required, a named function), ``parallel_tool_calls``,
  ``response_format`` (text, json_object, json_schema), ``max_tokens`` /
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` (a string
  or up to 4), ``n`` (up to 16), ``logprobs`` and ``top_logprobs`` (up to 20),
  ``stream``, ``stream_options.include_usage``; the llama.cpp-style extensions
  ``top_k``, ``min_p``, ``repeat_penalty`` and ``grammar`` (a GBNF string, or
  ``{"type": "lark" | "gbnf" | "regex", "grammar": ...}``). Sampling fields left out
  take the engine's defaults (``protocol.SamplingParams``), not OpenAI's, except
  ``repeat_penalty``: 1 (none) on a reply with tools or a constraint unless sent.
  ``frequency_penalty`` and ``presence_penalty`` (applied with the repetition penalty, over
  its last ``repeat_last_n`` tokens, as llama.cpp does) and ``logit_bias`` (token ids, as
  ``/tokenize`` gives them).
* ``model`` routes the request (``Gateway.route``: an installed model by name, or
  "local" for the default one; any other name is a 404 ``model_not_found``; replies
  name the model that ran); ignored: ``user``, ``metadata``, ``store``,
  ``service_tier``, ``reasoning_effort``, ``modalities`` = ["text"], an image part's
  ``detail``, and any field not named here.
* refused (400): ``functions`` (the deprecated form: use
  ``tools``), audio output, a tool message whose ``tool_call_id`` no earlier
  assistant call has, a ``tool_choice`` naming no tool in ``tools``, two
  constraints at once (a schema or grammar and a required tool call), media parts
  before the last message (send the conversation's later turns with
  ``X-AOTX-Conversation``), and for completions ``echo``, ``suffix``, ``best_of`` > 1
  and token-id prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aotx.engine.gateway import media as M
from aotx.engine.gateway.fields import (  # noqa: F401 (re-exported: S.BadRequest, S.Tools, ...)
    AT, BadRequest, Tools, _refuse_if, _type_name, parse_constraint, parse_tools, relabel,
)
from aotx.engine import protocol as P


@dataclass(frozen=True)
class Limits:
    """Per-request limits: bytes of body (pictures come as data URLs: 32 MiB), messages,
    the max_tokens ceiling, and the decoded bytes of one media part. ``max_tokens_ceiling``
    None (the default): a reply runs until it ends, its max_tokens or the context, as
    llama.cpp's server, Ollama and vLLM do; a number caps every reply there (a request
    asking more is served up to it and ends with finish reason "length")."""

    max_body_bytes: int = 32 << 20
    max_messages: int = 256
    max_tokens_ceiling: int | None = None
    default_max_tokens: int = P.SamplingParams().max_tokens
    max_part_bytes: int = M.MAX_PART_BYTES


@dataclass(frozen=True)
class Turn:
    """One message of a request: ``role`` user | assistant | tool, its text, its
    chat-template fields (``meta``: an assistant's ``tool_calls``, a tool result's
    ``tool_call_id`` and ``name``) and its media parts (the last message only)."""

    role: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    parts: tuple[M.MediaPart, ...] = ()


@dataclass(frozen=True)
class ChatRequest:
    """A parsed chat request. ``messages``: the turns, with system/developer folded
    into ``system``; the last one is a user or tool message. ``constraint``: the
    response format's or grammar's (the tool call's, when forced, is made by the
    gateway, which knows the model's tool format). ``logprobs``: -1 or top-k."""

    system: str | None
    messages: list[Turn]
    sampling: P.SamplingParams
    stream: bool
    include_usage: bool
    model: str | None
    tools: Tools = field(default_factory=Tools)
    constraint: P.Constraint | None = None
    logprobs: int = -1
    n: int = 1
    context: str = ""  # ``context_policy``: the conversation's context policy ("": the engine's)
    prefill: str = ""  # a final assistant message the reply continues (``take_prefill``)


@dataclass
class Spec:
    """One generation as every API asks for it (chat, completions, responses, messages):
    the conversation's ``system`` prompt and earlier ``history`` (turns stored with a new
    conversation), the ``last`` turn submitted, sampling, tools, the constraint of a
    response format or grammar, logprobs (-1: none) and the number of choices."""

    chat: bool
    system: str | None
    history: list[Turn]
    last: Turn
    sampling: P.SamplingParams
    stream: bool = False
    include_usage: bool = False
    tools: Tools = field(default_factory=Tools)
    constraint: P.Constraint | None = None
    logprobs: int = -1
    n: int = 1
    conversation: str | None = None  # continue this conversation (else the request's header, else a new one)
    # ``conversation`` is continued after this message only: when another turn came after it
    # (or is being generated), the reply goes to a fork of the conversation at this message
    after: str = ""
    model: str | None = None  # the request's ``model`` (``Gateway.route`` picks the engine model)
    title: str = ""
    prefill: str = ""  # the start of the reply, which continues it (Anthropic's final assistant message)
    context: str = ""  # the conversation's context policy (P.CONTEXT_POLICIES; "": unchanged, or the engine's)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    sampling: P.SamplingParams
    stream: bool
    include_usage: bool
    model: str | None
    constraint: P.Constraint | None = None
    logprobs: int = -1
    n: int = 1


_ROLES = ("system", "developer", "user", "assistant", "tool")


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


def _common(body: Any, limits: Limits) -> tuple[P.SamplingParams, bool, bool, str | None]:
    """Sampling, stream, include_usage and model of either endpoint's body."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_type_name(body)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, got {_type_name(model)}", "model")
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest(f"'stream_options' must be an object, got {_type_name(so)}", "stream_options")
    include_usage = bool(so and so.get("include_usage") is True)
    mt = _integer(body, "max_completion_tokens", 1, 1 << 31)
    if mt is None:
        mt = _integer(body, "max_tokens", 1, 1 << 31)
    ceiling = limits.max_tokens_ceiling
    if mt is None:
        mt = limits.default_max_tokens
    if ceiling is not None:       # capped, not refused: clients send their own maxima (Claude Code 32,000)
        mt = min(mt, ceiling)
    sp = P.SamplingParams(max_tokens=mt)
    for name, limit in SAMPLING_FIELDS.items():
        v = _param(body, name, limit)
        if v is not None:
            setattr(sp, name, v if name != "top_p" or v > 0 else 1e-6)  # OpenAI's top_p 0: the top token
    for name in ("frequency_penalty", "presence_penalty"):
        v = _number(body, name, -2.0, 2.0)
        if v is not None:
            setattr(sp, name, v)
    sp.logit_bias = _logit_bias(body.get("logit_bias"))
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


def _logit_bias(raw: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias`` ({"token id": bias in [-100, 100]}) as the engine's. Raises
    BadRequest naming the bad entry (an id past the model's vocabulary: the engine's 400)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadRequest(f"'logit_bias' must be an object of token ids and biases, got {_type_name(raw)}",
                         "logit_bias")
    if len(raw) > P.MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' has {len(raw)} entries; at most {P.MAX_LOGIT_BIAS}", "logit_bias")
    out: dict[int, float] = {}
    for k, v in raw.items():
        key = str(k)
        if not key.isdigit() or len(key) > 12:
            raise BadRequest(f"'logit_bias': {key[:40]!r} is not a token id (use /tokenize to find one)",
                             "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise BadRequest(f"'logit_bias[{key}]' must be a number between -100 and 100, got {v!r}"[:160],
                             "logit_bias")
        out[int(key)] = float(v)
    return out


def _structured_penalty(body: dict, sp: P.SamplingParams, structured: bool) -> None:
    """No repetition penalty by default on a reply with tools or a constraint: the
    engine's default (``protocol.REPEAT_PENALTY``, against free-chat loops) pushes the
    model off markup and structure that the prompt has just shown, so a Qwen model asked
    for a call wrote a fenced JSON block instead of its ``<tool_call>``. A client's own
    ``repeat_penalty`` is kept."""
    if structured and body.get("repeat_penalty") is None:
        sp.repeat_penalty = 1.0


def _n(body: dict) -> int:
    n = _integer(body, "n", 1, 128)
    if n is not None and n > P.MAX_CHOICES:
        raise BadRequest(f"'n' is {n}; this server returns at most {P.MAX_CHOICES} choices", "n")
    return n or 1


def _chat_logprobs(body: dict) -> int:
    """-1 without ``logprobs``; else ``top_logprobs`` (0 when absent)."""
    want = _bool(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, P.MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not want:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if want else -1


class _Parts:
    """Collects a message's content: text, and media parts with the field path of each."""

    def __init__(self, limits: Limits, file_roots: tuple):
        self.limits = limits
        self.file_roots = file_roots

    def read(self, content: Any, where: str, media_ok: bool) -> tuple[str, list[M.MediaPart]]:
        if isinstance(content, str):
            return content, []
        if content is None:
            return "", []
        if not isinstance(content, list):
            raise BadRequest(f"'{where}.content' must be a string or an array of parts, got {_type_name(content)}",
                             "messages")
        texts: list[str] = []
        media: list[M.MediaPart] = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise BadRequest(f"'{at}' must be an object, got {_type_name(part)}", "messages")
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadRequest(f"'{at}.text' must be a string, got {_type_name(text)}", "messages")
                texts.append(text)
                continue
            if kind not in ("image_url", "input_audio", "input_image"):
                raise BadRequest(f"'{at}' is of type {kind!r}; the parts taken are text, image_url and input_audio",
                                 "messages", "unsupported_content")
            if not media_ok:
                raise BadRequest(f"'{at}': media parts are taken in the last message only (continue a conversation "
                                 "with X-AOTX-Conversation to keep earlier pictures)", "messages", "unsupported_content")
            try:
                if kind == "input_audio":
                    a = part.get("input_audio")
                    if not isinstance(a, dict):
                        raise BadRequest(f"'{at}.input_audio' must be an object", "messages")
                    media.append(M.audio_part(a.get("data"), a.get("format", "wav"), f"{at}.input_audio",
                                              self.limits.max_part_bytes))
                else:
                    iu = part.get("image_url")
                    url = iu.get("url") if isinstance(iu, dict) else iu
                    media.append(M.image_url_part(url, f"{at}.image_url", self.file_roots,
                                                  self.limits.max_part_bytes))
            except M.MediaRefusal as e:
                raise BadRequest(e.message, "messages", "invalid_media" if e.status == 400 else
                                 "media_too_large" if e.status == 413 else "file_not_allowed", status=e.status) from None
        return "".join(texts), media


def take_prefill(body: dict, where: str = "messages") -> tuple[dict, str]:
    """(the body without its final assistant message, that message's text): the start of the
    reply, which the reply continues (an assistant prefill, as llama-server and Anthropic
    take it; vLLM's ``continue_final_message``). ("", body) when the last message is not an
    assistant's. Raises BadRequest for vLLM's flags set against it, or a final assistant
    message with tool calls or without a user message before it."""
    msgs = body.get("messages")
    cont, gen_prompt = body.get("continue_final_message"), body.get("add_generation_prompt")
    for name, v in (("continue_final_message", cont), ("add_generation_prompt", gen_prompt)):
        if v is not None and not isinstance(v, bool):
            raise BadRequest(f"'{name}' must be a boolean, got {_type_name(v)}", name)
    if cont and gen_prompt:
        raise BadRequest("'continue_final_message' and 'add_generation_prompt' are both true: a reply either "
                         "continues the final assistant message or starts a new one", "add_generation_prompt")
    last = msgs[-1] if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) else None
    final = last is not None and last.get("role") == "assistant"
    if cont and not final:
        raise BadRequest(f"'continue_final_message' is true but the last of '{where}' is not an assistant message",
                         "continue_final_message")
    if gen_prompt is False and not final:
        raise BadRequest("'add_generation_prompt' false asks for a prompt that ends without the assistant's turn: "
                         "this server always starts or continues one (end with an assistant message to continue "
                         "it)", "add_generation_prompt", "unsupported_parameter")
    if not final:
        return body, ""
    at = last.get(AT) if isinstance(last.get(AT), str) else f"{where}[{len(msgs) - 1}]"
    if cont is False:
        raise BadRequest(f"'{at}': the last message is an assistant's and 'continue_final_message' is false; this "
                         "server answers a user or tool message, or continues a final assistant message",
                         "continue_final_message")
    if last.get("tool_calls"):
        raise BadRequest(f"'{at}': a final assistant message (a prefill) takes text only, not tool calls", where)
    if not any(isinstance(m, dict) and m.get("role") in ("user", "tool") for m in msgs[:-1]):
        raise BadRequest(f"'{at}': an assistant prefill needs a user message before it", where)
    text, _ = _Parts(Limits(), ()).read(last.get("content"), at, media_ok=False)
    return {**body, "messages": msgs[:-1]}, text


def parse_chat(body: Any, limits: Limits, file_roots: tuple = ()) -> ChatRequest:
    """Validate a chat completions body. Raises BadRequest naming the field.
    ``file_roots``: the directories the request's key may read for ``file://`` images."""
    sp, stream, include_usage, model = _common(body, limits)
    tools = parse_tools(body)
    constraint = parse_constraint(body)
    if constraint is not None and tools.forced:
        raise BadRequest(f"'{constraint.field.split('.')[0]}' and a required tool call ('tool_choice') are two "
                         "constraints on one reply; send one", "tool_choice")
    _structured_penalty(body, sp, tools.active or constraint is not None)
    _refuse_if(body.get("audio") is not None, "audio", "audio output is not supported")
    mods = body.get("modalities")
    _refuse_if(mods not in (None, ["text"]), "modalities", "only text output is supported")
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
    turns: list[Turn] = []
    reader = _Parts(limits, file_roots)
    calls: dict[str, str] = {}  # tool_call_id -> function name, of the assistant calls so far
    for i, m in enumerate(msgs):
        where = m[AT] if isinstance(m, dict) and isinstance(m.get(AT), str) else f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{where}' must be an object, got {_type_name(m)}", "messages")
        role = m.get("role")
        if role not in _ROLES:
            if role == "function":
                raise BadRequest(f"'{where}.role' is 'function' (the deprecated form); send role 'tool'", "messages",
                                 "unsupported_parameter")
            raise BadRequest(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
        last = i == len(msgs) - 1
        if m.get("content") is None and role != "assistant":  # (an assistant's may be null: its tool calls)
            raise BadRequest(f"'{where}.content' is required in a {role} message", "messages")
        text, parts = reader.read(m.get("content"), where, media_ok=last and role == "user")
        if role in ("system", "developer"):
            system.append(text)
            continue
        meta: dict[str, Any] = {}
        if role == "assistant" and m.get("tool_calls"):
            meta["tool_calls"] = _assistant_calls(m["tool_calls"], where, calls)
        elif m.get("tool_calls"):
            raise BadRequest(f"'{where}.tool_calls': only an assistant message has tool calls", "messages")
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise BadRequest(f"'{where}.tool_call_id' must name the call this message answers", "messages")
            if cid not in calls:
                raise BadRequest(f"'{where}.tool_call_id' is {cid!r}, but no earlier assistant message made that call",
                                 "messages", "unknown_tool_call")
            meta["tool_call_id"] = cid
            meta["name"] = calls[cid]
        turns.append(Turn(role, text, meta, tuple(parts)))
    if not turns or turns[-1].role not in ("user", "tool"):
        raise BadRequest("the last non-system message must have role 'user' or 'tool'", "messages")
    return ChatRequest(system="\n\n".join(system) if system else None, messages=turns, sampling=sp,
                       stream=stream, include_usage=include_usage, model=model, tools=tools, constraint=constraint,
                       logprobs=_chat_logprobs(body), n=_n(body), context=context_policy(body))


def context_policy(body: dict[str, Any]) -> str:
    """``context_policy``: what the conversation does once its history outgrows the
    context (``rolling``, ``middle``, ``stop``; absent: the engine's default)."""
    v = body.get("context_policy")
    if v is None:
        return ""
    if v not in P.CONTEXT_POLICIES:
        raise BadRequest(f"'context_policy' must be one of {', '.join(P.CONTEXT_POLICIES)}, got {v!r}",
                         "context_policy")
    return v


def _assistant_calls(raw: Any, where: str, calls: dict[str, str]) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise BadRequest(f"'{where}.tool_calls' must be an array", "messages")
    out = []
    for j, c in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"'{at}.function.name' must be a string", "messages")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise BadRequest(f"'{at}.function.arguments' must be JSON text", "messages")
        cid = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else f"call_{len(calls)}"
        calls[cid] = fn["name"]
        out.append({"id": cid, "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def parse_completion(body: Any, limits: Limits) -> CompletionRequest:
    """Validate a (legacy) completions body; the prompt goes to the engine raw."""
    sp, stream, include_usage, model = _common(body, limits)
    _refuse_if(_bool(body, "echo"), "echo", "the prompt is not echoed")
    _refuse_if(body.get("suffix") not in (None, ""), "suffix", "insertion (suffix) is not supported")
    bo = _integer(body, "best_of", 1, 128)
    _refuse_if(bo is not None and bo != 1, "best_of", f"best_of must be 1, got {bo}")
    lp = _integer(body, "logprobs", 0, P.MAX_TOP_LOGPROBS)
    constraint = parse_constraint(body)
    _structured_penalty(body, sp, constraint is not None)
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
    return CompletionRequest(prompt=prompt, sampling=sp, stream=stream, include_usage=include_usage, model=model,
                             constraint=constraint, logprobs=-1 if lp is None else lp, n=_n(body))
