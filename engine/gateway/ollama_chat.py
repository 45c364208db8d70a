"""Ollama's ``POST /api/chat`` and ``POST /api/generate``: requests and answers in Ollama's shapes.

Owns: parsing an Ollama chat or generate body into the gateway's ``Spec`` (through the
chat-completions parser, so every field is checked the same way and errors name
Ollama's fields), and the renderer ``Gateway.generate`` calls: one JSON object, or
newline-delimited JSON chunks (``stream`` is true unless sent false, as Ollama does)
ending with ``done: true``, the ``done_reason``, the token counts and durations in
nanoseconds, and the reply's receipts in an ``aotx`` field; an engine failure mid-stream
is a last ``{"error": ...}`` line. Every chat is a journaled conversation like any other
request (named in ``X-AOTX-Conversation``).

Taken: ``messages`` (system, user, assistant with ``tool_calls``, tool with ``tool_name``;
``images`` as base64 on the last user message), ``prompt``, ``system``, ``raw``,
``images``, ``tools``, ``format`` ("json" or a JSON schema), ``stream``, ``keep_alive``
(``ollama.py``), ``logprobs`` / ``top_logprobs``, ``think`` false, and ``options``:
``num_predict`` (-1 and -2: until the reply ends or the context is full), ``temperature``,
``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``, ``repeat_penalty``, ``repeat_last_n``,
``presence_penalty``, ``frequency_penalty``; ``num_ctx`` is honoured up to the context
the engine serves (``aotx serve --context``: a larger one is refused, naming both),
and the options that only tune Ollama's runner (``num_thread``, ``num_gpu``,
``num_batch``, ``use_mmap``, ...) have nothing to tune here. Refused (400): ``think``
true (no model here separates its thinking), ``suffix``, ``template``, ``context`` (send
the conversation to ``/api/chat``), ``mirostat``, ``typical_p`` and ``tfs_z`` other
than off, and any unknown option. Leaves the engine and the conversation to ``core.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from aotx.engine import protocol as P
from aotx.engine.gateway import media as M
from aotx.engine.gateway import schema as S
from aotx.engine.gateway import shapes
from aotx.engine.gateway.streaming import ndjson

# chat-completions names -> Ollama's (errors from parse_chat name what the client sent)
CHAT_NAMES = ((".tool_call_id", ".tool_name"), ("'max_tokens'", "'options.num_predict'"),
              ("'response_format", "'format"))
#: options taken as chat-completions fields of the same meaning
OPTION_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "seed": "seed", "stop": "stop", "repeat_penalty": "repeat_penalty",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "num_predict": "max_tokens"}
#: options of Ollama's runner (threads, GPU layers, batch, memory mapping): how AOTX runs a
#: model is the engine's (``aotx serve``), so a request has nothing of these to change
RUNNER_OPTIONS = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                            "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
                            "penalize_newline"})
#: sampling options AOTX's sampler does not have: accepted only at the value that turns them off
OFF_VALUES = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0, "mirostat_tau": None, "mirostat_eta": None}
DONE = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop", "tool_calls": "stop"}


def created_at(t: float | None = None) -> str:
    """Ollama's timestamp: RFC 3339 in UTC with microseconds."""
    return datetime.fromtimestamp(time.time() if t is None else t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _type_name(v: Any) -> str:
    return S._type_name(v)


def options(body: dict, served_ctx: int) -> dict[str, Any]:
    """The chat-completions fields of ``body["options"]`` (and ``repeat_last_n`` as
    ``_repeat_last_n``). Raises BadRequest naming the option."""
    opts = body.get("options")
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise S.BadRequest(f"'options' must be an object, got {_type_name(opts)}", "options")
    out: dict[str, Any] = {}
    for k, v in opts.items():
        if v is None or k in RUNNER_OPTIONS:
            continue
        if k in OPTION_FIELDS:
            if k == "num_predict":
                if isinstance(v, bool) or not isinstance(v, int):
                    raise S.BadRequest(f"'options.num_predict' must be an integer, got {_type_name(v)}", "options")
                if v < -2 or v == 0:
                    raise S.BadRequest(f"'options.num_predict' is {v}: use a positive count, or -1 (until the "
                                       "reply ends) or -2 (until the context is full)", "options")
                if v < 0:
                    continue  # the engine's default: until the reply ends or the context is full
            out[OPTION_FIELDS[k]] = v
        elif k == "repeat_last_n":
            if isinstance(v, bool) or not isinstance(v, int) or v < -1:
                raise S.BadRequest(f"'options.repeat_last_n' must be an integer of at least -1, got {v!r}",
                                   "options")
            out["_repeat_last_n"] = v
        elif k == "num_ctx":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise S.BadRequest(f"'options.num_ctx' must be a positive integer, got {v!r}", "options")
            if served_ctx and v > served_ctx:
                raise S.BadRequest(f"'options.num_ctx' is {v:,}, past the context of {served_ctx:,} tokens this "
                                   "engine serves the model with (start it with a larger `aotx serve --context`)",
                                   "options", "context_length_exceeded")
        elif k in OFF_VALUES:
            off = OFF_VALUES[k]
            if off is not None and v != off:
                raise S.BadRequest(f"'options.{k}' is {v!r}: this server's sampler has no {k} (send {off!r}, "
                                   "its value when off)", "options", "unsupported_parameter")
        else:
            raise S.BadRequest(f"'options.{k}' is not an option this server knows", "options",
                               "unsupported_parameter")
    return out


def _images(raw: Any, where: str, limits: S.Limits) -> list[M.MediaPart]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise S.BadRequest(f"'{where}' must be an array of base64 images", "messages")
    parts = []
    for j, b64 in enumerate(raw):
        at = f"{where}[{j}]"
        if not isinstance(b64, str):
            raise S.BadRequest(f"'{at}' must be a base64 string, got {_type_name(b64)}", "messages")
        try:
            parts.append(M.MediaPart("image", at, data=M.decode_b64(b64, at, limits.max_part_bytes)))
        except M.MediaRefusal as e:
            raise S.BadRequest(e.message, "messages", status=e.status) from None
    return parts


def _common(body: Any, served_ctx: int) -> dict[str, Any]:
    """The chat-completions fields every Ollama generation takes (model, options, format,
    stream, logprobs). Raises BadRequest."""
    if not isinstance(body, dict):
        raise S.BadRequest(f"the request body must be a JSON object, got {_type_name(body)}")
    think = body.get("think")
    if think not in (None, False):
        raise S.BadRequest("'think': the models of this server do not think apart from their reply (send false)",
                           "think", "unsupported_parameter")
    chat: dict[str, Any] = {"model": body.get("model"), **options(body, served_ctx)}
    stream = body.get("stream", True)
    chat["stream"] = True if stream is None else stream
    fmt = body.get("format")
    if fmt == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt}}
    elif fmt not in (None, ""):
        raise S.BadRequest(f"'format' must be \"json\" or a JSON schema, got {fmt!r}"[:200], "format")
    if body.get("logprobs"):
        chat["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat["top_logprobs"] = body["top_logprobs"]
    return chat


def _finish(req: S.ChatRequest, chat: dict[str, Any]) -> None:
    """Options the chat parser does not take: ``repeat_last_n``."""
    if "_repeat_last_n" in chat:
        req.sampling.repeat_last_n = chat["_repeat_last_n"]


def parse_chat(body: Any, limits: S.Limits, served_ctx: int) -> tuple[S.ChatRequest | None, list[M.MediaPart]]:
    """An ``/api/chat`` body as a ChatRequest (None when it has no messages: a load or an
    unload of the model) and the last message's images."""
    chat = _common(body, served_ctx)
    raw = body.get("messages")
    if raw is None or raw == []:
        return None, []
    if not isinstance(raw, list):
        raise S.BadRequest(f"'messages' must be an array, got {_type_name(raw)}", "messages")
    msgs: list[dict] = []
    calls: list[tuple[str, str]] = []  # (id, name) of the assistant's calls, answered in order
    parts: list[M.MediaPart] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise S.BadRequest(f"'{where}' must be an object, got {_type_name(m)}", "messages")
        role = m.get("role")
        out = {"role": role, "content": m.get("content") or "", S.AT: where}
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise S.BadRequest(f"'{where}.tool_calls' must be an array", "messages")
            tcs = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    raise S.BadRequest(f"'{where}.tool_calls[{j}].function' must be an object", "messages")
                cid = f"call_{len(calls)}"
                calls.append((cid, str(fn.get("name"))))
                tcs.append({"id": cid, "type": "function", "function": {"name": fn.get("name"),
                                                                        "arguments": fn.get("arguments", {})}})
            out["tool_calls"] = tcs
        if role == "tool":
            name = m.get("tool_name") or m.get("name")
            at = next((k for k, (_, n) in enumerate(calls) if name is None or n == name), None)
            if at is None:
                raise S.BadRequest(f"'{where}': a tool result{f' of {name!r}' if name else ''} answers no earlier "
                                   "assistant tool call", "messages", "unknown_tool_call")
            out["tool_call_id"] = calls.pop(at)[0]
        if m.get("images"):
            if i != len(raw) - 1 or role != "user":
                raise S.BadRequest(f"'{where}.images': images are taken in the last user message only (continue a "
                                   "conversation with X-AOTX-Conversation to keep earlier pictures)", "messages")
            parts = _images(m["images"], f"{where}.images", limits)
        msgs.append(out)
    cbody, prefill = S.take_prefill({**{k: v for k, v in chat.items() if not k.startswith("_")}, "messages": msgs,
                                     "tools": body.get("tools")})
    if prefill and parts:
        raise S.BadRequest("an assistant message after images is continued as a prefill, which takes no images; "
                           "send the images without it", "messages")
    try:
        req = S.parse_chat(cbody, limits)
    except S.BadRequest as e:
        raise S.relabel(e, CHAT_NAMES, {"max_tokens": "options", "response_format": "format"}) from None
    _finish(req, chat)
    return dataclasses.replace(req, prefill=prefill), parts  # a final assistant message: Ollama continues it


def parse_generate(body: Any, limits: S.Limits, served_ctx: int) -> tuple[S.ChatRequest | None, list[M.MediaPart],
                                                                            bool]:
    """An ``/api/generate`` body as a one-turn ChatRequest (None without a prompt: a load
    or an unload), its images and whether it is ``raw`` (no chat template)."""
    chat = _common(body, served_ctx)
    for name in ("suffix", "template"):
        if body.get(name):
            raise S.BadRequest(f"'{name}' is not supported: the model's own chat template is used", name,
                               "unsupported_parameter")
    if body.get("context"):
        raise S.BadRequest("'context' (the token ids of an earlier reply) is not taken: send the conversation to "
                           "/api/chat", "context", "unsupported_parameter")
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise S.BadRequest(f"'prompt' must be a string, got {_type_name(prompt)}", "prompt")
    if not prompt:
        return None, [], False
    raw = bool(body.get("raw"))
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise S.BadRequest(f"'system' must be a string, got {_type_name(system)}", "system")
    msgs = ([{"role": "system", "content": system}] if system and not raw else []) + [
        {"role": "user", "content": prompt, S.AT: "prompt"}]
    try:
        req = S.parse_chat({**{k: v for k, v in chat.items() if not k.startswith("_")}, "messages": msgs}, limits)
    except S.BadRequest as e:
        raise S.relabel(e, CHAT_NAMES, {"max_tokens": "options", "response_format": "format"}) from None
    _finish(req, chat)
    return req, _images(body.get("images"), "images", limits), raw


def spec_of(req: S.ChatRequest, parts: list[M.MediaPart], raw: bool = False) -> S.Spec:
    last = req.messages[-1]
    if parts:
        last = S.Turn(last.role, last.text, last.meta, tuple(parts))
    return S.Spec(chat=not raw, system=None if raw else req.system, history=req.messages[:-1], last=last,
                  sampling=req.sampling, stream=req.stream, tools=req.tools, constraint=req.constraint,
                  logprobs=req.logprobs, n=1, title=last.text, model=req.model)


def _durations(gen: Any, reply: shapes.Reply, t0: float) -> dict[str, Any]:
    """Ollama's counts and durations (nanoseconds) of a finished reply."""
    c = gen.committed.get(0)
    tm = c.timings if c is not None else {}
    ttft = float(tm.get("ttft_s", 0.0))
    queue = float(tm.get("queue_s", 0.0))
    tps = float(tm.get("decode_tokens_per_s", 0.0))
    n = reply.n_completion
    return {"total_duration": int((time.monotonic() - t0) * 1e9), "load_duration": 0,
            "prompt_eval_count": reply.n_prompt, "prompt_eval_duration": int(max(0.0, ttft - queue) * 1e9),
            "eval_count": n, "eval_duration": int((n - 1) / tps * 1e9) if tps > 0 and n > 1 else 0}


def _logprob(entry: dict[str, Any]) -> dict[str, Any]:
    out = {"token": entry["token"], "logprob": entry["logprob"]}
    if "top_logprobs" in entry:
        out["top_logprobs"] = [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]]
    return out


class OllamaAPI:
    """The renderer ``Gateway.generate`` calls for ``/api/chat`` (``chat``) and
    ``/api/generate``."""

    media_type = "application/x-ndjson"

    def __init__(self, chat: bool, on_done: Any = None):
        self.chat = chat
        self.t0 = time.monotonic()
        self.on_done = on_done  # called with the model's name when the reply ends (keep_alive)

    def new_id(self) -> str:
        return shapes.new_id("ollama")

    @staticmethod
    def error(e) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"error": e.body["error"]["message"]}, status_code=e.status, headers=e.headers)

    def _calls(self, c: shapes.Choice) -> list[dict[str, Any]]:
        import json

        out = []
        for k, call in enumerate(c.tool_calls):
            try:
                args = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:
                args = {"_raw": call["function"]["arguments"]}
            out.append({"id": call["id"], "function": {"index": k, "name": call["function"]["name"],
                                                        "arguments": args}})
        return out

    def _piece(self, reply: shapes.Reply, text: str, calls: list | None = None,
               logprobs: list | None = None) -> dict[str, Any]:
        obj: dict[str, Any] = {"model": reply.model, "created_at": created_at()}
        if self.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = calls
            obj["message"] = msg
        else:
            obj["response"] = text
        if logprobs:
            obj["logprobs"] = [_logprob(e) for e in logprobs]
        obj["done"] = False
        return obj

    def _done(self, gw, gen, reply: shapes.Reply, text: str, calls: list | None = None,
              logprobs: list | None = None) -> dict[str, Any]:
        obj = self._piece(reply, text, calls, logprobs)
        c = reply.choices[0]
        obj.update(done=True, done_reason=DONE.get(c.finish_reason, "stop"), **_durations(gen, reply, self.t0),
                   aotx=reply.aotx)
        if self.on_done is not None:
            self.on_done(reply.model)
        return obj

    async def final(self, gw, gen, reply: shapes.Reply, spec) -> dict[str, Any]:
        c = reply.choices[0]
        return self._done(gw, gen, reply, c.text, self._calls(c), c.logprobs)

    async def stream(self, gw, gen, reply: shapes.Reply, spec, states) -> AsyncIterator[bytes]:
        st = states[0]
        pending: list[dict[str, Any]] = []
        try:
            async for e in gen.events():
                outs = []
                if isinstance(e, P.Token) and e.choice == 0:
                    outs = st.token(e)
                elif isinstance(e, P.Committed) and e.choice == 0:
                    reply.n_prompt = e.n_prompt
                    reply.n_cached = int(e.timings.get("prompt_tokens_reused", 0))
                    if e.finish_reason == "error":
                        yield ndjson({"error": "the engine failed while generating this reply"})
                        return
                    outs = st.committed(e)
                elif isinstance(e, P.Error):
                    yield ndjson({"error": gw.engine_error(e).body["error"]["message"]})
                    return
                for o in outs:
                    if o.kind == "logprob":
                        pending.append(o.entry)
                    elif o.kind == "content":
                        yield ndjson(self._piece(reply, o.text, logprobs=pending))
                        pending = []
        except gw.api_error as err:  # the engine went away
            yield ndjson({"error": err.body["error"]["message"]})
            return
        gw._finish_reply(gen, reply, states)
        calls = self._calls(reply.choices[0])
        if calls:  # Ollama sends a reply's calls whole, in a chunk of their own
            yield ndjson(self._piece(reply, "", calls))
        yield ndjson(self._done(gw, gen, reply, "", logprobs=pending))
