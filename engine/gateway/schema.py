"""OpenAI request parsing for the gateway: pure functions.

Owns: turning a decoded JSON body of ``POST /v1/chat/completions`` or
``POST /v1/completions`` into a ``ChatRequest`` / ``CompletionRequest`` (or a
``BadRequest`` naming the field and the bad value), with several choices, tool calls
and log probabilities, and the ``Spec`` of one generation every API fills in. Leaves
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
* ``model`` routes the request (``Gateway.route``: an installed model by name, or
  "local" for the default one; any other name is a 404 ``model_not_found``; replies
  name the model that ran); ignored: ``user``,
  ``frequency_penalty``, ``presence_penalty``, ``metadata``, ``store``,
  ``service_tier``, ``reasoning_effort``, ``modalities`` = ["text"], empty
  ``logit_bias``, an image part's ``detail``, and any field not named here.
* refused (400): non-empty ``logit_bias``, ``functions`` (the deprecated form: use
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
from aotx.engine import protocol as P


class BadRequest(Exception):
    """A request the gateway refuses with 400 (or ``status``: 403 for a file the key may
    not read, 413 for a media part too large); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


# the key of a chat message made from another API's item (Responses' input, a Messages
# block) that holds where that item is in the request sent ("input[2]"): errors name it
AT = "_aotx_at"


def relabel(e: BadRequest, renames: tuple[tuple[str, str], ...], params: dict[str, str]) -> BadRequest:
    """``e`` in another API's terms: each (chat name, its name there) of ``renames``
    replaced in the message, the param mapped by ``params``."""
    msg = e.message
    for a, b in renames:
        msg = msg.replace(a, b)
    return BadRequest(msg, params.get(e.param, e.param), e.code, status=e.status)


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
class Tools:
    """What a request says about tools: the function ``tools`` (OpenAI's shape),
    ``choice`` "auto" | "none" | "required" | "function" (then ``name``), and whether
    several calls may come at once."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return bool(self.tools) and self.choice in ("required", "function")


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


def parse_tools(body: dict, tools_field: str = "tools", choice_field: str = "tool_choice") -> Tools:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat body. Raises BadRequest."""
    _refuse_if(body.get("functions") not in (None, []), "functions",
               "the deprecated 'functions' form; send 'tools' with {\"type\": \"function\", \"function\": ...}")
    raw = body.get(tools_field)
    tools: list[dict[str, Any]] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise BadRequest(f"'{tools_field}' must be an array, got {_type_name(raw)}", tools_field)
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or t.get("type", "function") != "function":
                raise BadRequest(f"'{tools_field}[{i}]' must be a function tool ({{\"type\": \"function\", "
                                 f"\"function\": {{...}}}})", tools_field)
            fn = t.get("function", t if "name" in t else None)
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise BadRequest(f"'{tools_field}[{i}].function.name' must be a non-empty string", tools_field)
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise BadRequest(f"'{tools_field}[{i}].function.parameters' must be a JSON schema object", tools_field)
            clean = {"name": fn["name"]}
            if isinstance(fn.get("description"), str):
                clean["description"] = fn["description"]
            clean["parameters"] = params if params is not None else {"type": "object", "properties": {}}
            tools.append({"type": "function", "function": clean})
        names = [t["function"]["name"] for t in tools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise BadRequest(f"'{tools_field}': the name {sorted(dup)[0]!r} is given twice", tools_field)
    tc = body.get(choice_field)
    choice, name = "auto", None
    if tc is None:
        choice = "auto" if tools else "none"
    elif isinstance(tc, str):
        if tc not in ("auto", "none", "required"):
            raise BadRequest(f"'{choice_field}' must be auto, none, required or a function, got {tc!r}", choice_field)
        choice = tc
    elif isinstance(tc, dict):
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        name = fn.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"'{choice_field}' names no function ({{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ...}}}})", choice_field)
        choice = "function"
    else:
        raise BadRequest(f"'{choice_field}' must be a string or an object, got {_type_name(tc)}", choice_field)
    if choice in ("required", "function") and not tools:
        raise BadRequest(f"'{choice_field}' is {choice!r} but the request has no tools", choice_field)
    if choice == "function" and name not in [t["function"]["name"] for t in tools]:
        raise BadRequest(f"'{choice_field}' names the function {name!r}, which is not in '{tools_field}' "
                         f"({', '.join(t['function']['name'] for t in tools)})", choice_field, "unknown_tool")
    par = body.get("parallel_tool_calls", True)
    if not isinstance(par, bool):
        raise BadRequest(f"'parallel_tool_calls' must be a boolean, got {_type_name(par)}", "parallel_tool_calls")
    return Tools(tools, choice, name, par)


def parse_constraint(body: dict) -> P.Constraint | None:
    """The constraint of ``response_format`` or ``grammar`` (at most one). Raises BadRequest."""
    out: list[P.Constraint] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise BadRequest(f"'response_format' must be an object, got {_type_name(rf)}", "response_format")
        kind = rf.get("type")
        if kind == "json_object":
            out.append(P.Constraint(kind="json_schema", grammar='{"type": "object"}', field="response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise BadRequest("'response_format.json_schema' must be an object with a 'schema'", "response_format")
            schema = js.get("schema", {})
            if not isinstance(schema, (dict, bool)):
                raise BadRequest("'response_format.json_schema.schema' must be a JSON schema object",
                                 "response_format")
            out.append(P.Constraint(kind="json_schema", grammar=json.dumps(schema),
                                    field="response_format.json_schema.schema"))
        elif kind not in ("text", None):
            raise BadRequest(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                             "response_format")
    g = body.get("grammar")
    if g is not None:
        if isinstance(g, str):
            g = {"type": "gbnf", "grammar": g}
        if not isinstance(g, dict):
            raise BadRequest(f"'grammar' must be a GBNF string or an object, got {_type_name(g)}", "grammar")
        kind = g.get("type", g.get("syntax", "gbnf"))
        text = g.get("grammar", g.get("value"))
        if kind not in ("lark", "gbnf", "regex"):
            raise BadRequest(f"'grammar.type' must be lark, gbnf or regex, got {kind!r}", "grammar")
        if not isinstance(text, str) or not text.strip():
            raise BadRequest("'grammar.grammar' must be the grammar's text", "grammar")
        out.append(P.Constraint(kind=kind, grammar=text, field="grammar"))
    if len(out) > 1:
        raise BadRequest("'response_format' and 'grammar' are two constraints; send one", "grammar")
    c = out[0] if out else None
    if c is not None and (why := P.constraint_problem(c)):
        raise BadRequest(why, c.field.split(".")[0])
    return c


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
