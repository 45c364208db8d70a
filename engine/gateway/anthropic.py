"""Anthropic's Messages API (``POST /v1/messages``) for clients that speak it.

Owns: parsing a Messages request (``system``, ``messages`` with ``text``, ``image``
(base64 source), ``tool_use`` and ``tool_result`` blocks, ``tools`` with
``input_schema``, ``tool_choice`` auto | any | tool | none, ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``stop_sequences``, ``stream``; a final
``assistant`` message is a prefill: the reply continues it and holds the continuation
only, as Anthropic's does) into the gateway's ``Spec``, and answering in Anthropic's shapes: a ``message`` with ``text``
and ``tool_use`` content blocks and a ``stop_reason`` (end_turn, max_tokens,
stop_sequence, tool_use), or the streaming events ``message_start``,
``content_block_start`` / ``_delta`` (``text_delta``, ``input_json_delta``) /
``_stop``, ``message_delta`` and ``message_stop``. Errors use Anthropic's body
(``{"type": "error", "error": {"type", "message"}}``; mid-stream, an ``error`` event with
it: an engine that fails or goes away is an ``api_error``). The key may come as
``x-api-key`` (Anthropic's clients) or as a bearer token. ``POST /v1/messages/count_tokens``
answers a Messages body's prompt token count (``{"input_tokens": N}``) without running it. Leaves HTTP, the engine
and tool-call parsing to ``core.py``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aotx.engine.errors import EngineError
from aotx.engine.gateway import media as M
from aotx.engine.gateway import schema as S
from aotx.engine.gateway import shapes
from aotx.engine import protocol as P
from aotx.engine.ipc.client import ConnectionLost

# chat-completions names -> Anthropic's (errors from parse_chat name what the client sent)
CHAT_NAMES = ((".tool_call_id", ".tool_use_id"), (".function.name", ".name"), (".function.parameters", ".input_schema"),
              ('{"type": "function", "function": {...}}', '{"name": ..., "input_schema": {...}}'))
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error"}
STOP = {"stop": "end_turn", "length": "max_tokens", "context": "max_tokens", "cancelled": "end_turn",
        "tool_calls": "tool_use"}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}},
                        status_code=status, headers=headers)


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise S.BadRequest(f"'{where}.content' must be a string or an array of blocks", "messages")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise S.BadRequest(f"'{where}.content[{j}]' must be a content block", "messages")
    return content


def _str(value: Any, where: str, param: str) -> str:
    """A block's text field: a string (absent: ""). Raises BadRequest naming ``where``."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise S.BadRequest(f"'{where}' must be a string, got {S._type_name(value)}", param)
    return value


def _texts(blocks: list, where: str, param: str) -> str:
    """The text of a list's ``text`` blocks (others skipped), each checked to be a string."""
    return "".join(_str(b.get("text"), f"{where}[{j}].text", param) for j, b in enumerate(blocks)
                   if isinstance(b, dict) and b.get("type") == "text")


def parse(body: Any, limits: S.Limits) -> tuple[dict, list[dict], list]:
    """(the chat-shaped fields, chat messages, the last message's media parts)."""
    if not isinstance(body, dict):
        raise S.BadRequest("the request body must be a JSON object")
    if body.get("max_tokens") is None:
        raise S.BadRequest("'max_tokens' is required", "max_tokens")
    msgs: list[dict] = []
    system = body.get("system")
    if isinstance(system, list):
        system = _texts(system, "system", "system")
    if system is not None and not isinstance(system, str):
        raise S.BadRequest("'system' must be a string or text blocks", "system")
    if system:
        msgs.append({"role": "system", "content": system, S.AT: "system"})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise S.BadRequest("'messages' must be a non-empty array", "messages")
    parts: list[M.MediaPart] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise S.BadRequest(f"'{where}.role' must be user or assistant", "messages")
        blocks = _blocks(m.get("content"), where)
        last = i == len(raw) - 1
        if m["role"] == "assistant":
            text = _texts(blocks, f"{where}.content", "messages")
            calls = [{"id": b.get("id"), "type": "function",
                      "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))}}
                     for b in blocks if b["type"] == "tool_use"]
            msgs.append({"role": "assistant", "content": text, S.AT: where, **({"tool_calls": calls} if calls else {})})
            continue
        texts: list[str] = []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            if b["type"] == "text":
                texts.append(_str(b.get("text"), f"{at}.text", "messages"))
            elif b["type"] == "tool_result":
                c = b.get("content", "")
                if isinstance(c, list):
                    c = _texts(c, f"{at}.content", "messages")
                msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), S.AT: at,
                             "content": _str(c, f"{at}.content", "messages")})
            elif b["type"] == "image":
                if not last:
                    raise S.BadRequest(f"'{at}': images are taken in the last message only", "messages")
                src = b.get("source")
                if not isinstance(src, dict):
                    raise S.BadRequest(f"'{at}.source' must be an object ({{\"type\": \"base64\", \"media_type\": "
                                       f"..., \"data\": ...}}), got {S._type_name(src)}", "messages")
                if src.get("type") != "base64":
                    raise S.BadRequest(f"'{at}.source': only base64 images are taken", "messages")
                try:
                    parts.append(M.MediaPart("image", f"{at}.source", data=M.decode_b64(_str(src.get("data"),
                                                                                             f"{at}.source.data",
                                                                                             "messages"),
                                                                                      f"{at}.source",
                                                                                      limits.max_part_bytes)))
                except M.MediaRefusal as e:
                    raise S.BadRequest(e.message, "messages", status=e.status) from None
            else:
                raise S.BadRequest(f"'{at}.type' {b['type']!r} is not taken (text, image, tool_result)", "messages")
        if texts or not msgs or msgs[-1].get("role") != "tool":
            msgs.append({"role": "user", "content": "".join(texts), S.AT: where})
    chat: dict[str, Any] = {"max_tokens": body["max_tokens"]}
    for k in ("model", "temperature", "top_p", "top_k", "stream"):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("stop_sequences") is not None:
        if not isinstance(body["stop_sequences"], list):
            raise S.BadRequest(f"'stop_sequences' must be an array of strings, got "
                               f"{S._type_name(body['stop_sequences'])}", "stop_sequences")
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise S.BadRequest("'tools' must be an array", "tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise S.BadRequest(f"'tools[{i}]' must be a tool object ({{\"name\": ..., \"input_schema\": ...}}), "
                                   f"got {S._type_name(t)}", "tools")
        chat["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                                           "parameters": t.get("input_schema")}} for t in tools]
        for t in chat["tools"]:
            if t["function"].get("description") is None:
                t["function"].pop("description")
    tc = body.get("tool_choice")
    if tc is not None:
        if not isinstance(tc, dict):
            raise S.BadRequest("'tool_choice' must be an object", "tool_choice")
        kind = tc.get("type")
        if not isinstance(kind, str):
            raise S.BadRequest(f"'tool_choice.type' must be auto, any, tool or none, got {S._type_name(kind)}",
                               "tool_choice")
        mapping = {"auto": "auto", "any": "required", "none": "none"}
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
        elif kind in mapping:
            chat["tool_choice"] = mapping[kind]
        else:
            raise S.BadRequest(f"'tool_choice.type' must be auto, any, tool or none, got {kind!r}", "tool_choice")
        if tc.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    return chat, msgs, parts


class MessagesAPI:
    """The renderer ``Gateway.generate`` calls for ``/v1/messages``."""

    def new_id(self) -> str:
        return "msg_" + uuid.uuid4().hex[:24]

    @staticmethod
    def error(e) -> Response:
        return error_response(e.status, e.body["error"]["message"], e.headers)

    def _content(self, c: shapes.Choice) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if c.text:
            out.append({"type": "text", "text": c.text})
        for call in c.tool_calls:
            try:
                args = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:
                args = {"_raw": call["function"]["arguments"]}
            out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": args})
        return out

    @staticmethod
    def _stop(c: shapes.Choice, spec) -> tuple[str, str | None]:
        if c.tool_calls:
            return "tool_use", None
        if c.finish_reason == "stop" and c.stop_sequence:
            return "stop_sequence", c.stop_sequence
        return STOP.get(c.finish_reason, "end_turn"), None

    async def final(self, gw, gen, reply: shapes.Reply, spec) -> dict[str, Any]:
        c = reply.choices[0]
        stop, seq = self._stop(c, spec)
        return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model,
                "content": self._content(c), "stop_reason": stop, "stop_sequence": seq,
                "usage": _usage(reply),
                "aotx": reply.aotx}

    async def stream(self, gw, gen, reply: shapes.Reply, spec, states) -> AsyncIterator[bytes]:
        def ev(obj: dict[str, Any]) -> bytes:
            return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

        a = gen.accepted.get(0)  # the prompt is known once the message is accepted
        yield ev({"type": "message_start", "message": {
            "id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(a.prompt_ids) if a else 0, "output_tokens": 0}}})
        block = -1
        open_kind: str | None = None
        call_block: dict[int, int] = {}
        st = states[0]
        try:
            async for e in gen.events():
                outs = []
                if isinstance(e, P.Token) and e.choice == 0:
                    outs = st.token(e)
                elif isinstance(e, P.Committed) and e.choice == 0:
                    reply.n_prompt = e.n_prompt
                    reply.n_cached = int(e.timings.get("prompt_tokens_reused", 0))
                    if e.finish_reason == "error":
                        yield ev({"type": "error", "error": {"type": "api_error", "message":
                                                             "the engine failed while generating this reply"}})
                        return
                    outs = st.committed(e)
                elif isinstance(e, P.Error):
                    err = gw.engine_error(e)
                    yield ev({"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"),
                                                         "message": err.body["error"]["message"]}})
                    return
                for o in outs:
                    if o.kind == "content":
                        if open_kind != "text":
                            if open_kind is not None:
                                yield ev({"type": "content_block_stop", "index": block})
                            block += 1
                            open_kind = "text"
                            yield ev({"type": "content_block_start", "index": block,
                                      "content_block": {"type": "text", "text": ""}})
                        yield ev({"type": "content_block_delta", "index": block,
                                  "delta": {"type": "text_delta", "text": o.text}})
                    elif o.kind == "call":
                        idx, cid, name, args = o.call
                        if idx not in call_block:
                            if open_kind is not None:
                                yield ev({"type": "content_block_stop", "index": block})
                            block += 1
                            open_kind = "tool"
                            call_block[idx] = block
                            yield ev({"type": "content_block_start", "index": block,
                                      "content_block": {"type": "tool_use", "id": cid, "name": name, "input": {}}})
                        if args:
                            yield ev({"type": "content_block_delta", "index": call_block[idx],
                                      "delta": {"type": "input_json_delta", "partial_json": args}})
        except gw.api_error as err:  # the engine went away: Anthropic's mid-stream error event
            yield ev({"type": "error", "error": {"type": "api_error", "message": err.body["error"]["message"]}})
            return
        if open_kind is not None:
            yield ev({"type": "content_block_stop", "index": block})
        gw._finish_reply(gen, reply, states)
        stop, seq = self._stop(reply.choices[0], spec)
        yield ev({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": seq},
                  "usage": _usage(reply),
                  "aotx": reply.aotx})
        yield ev({"type": "message_stop"})


async def create(gw, request: Request) -> Response:
    """``POST /v1/messages``."""
    key = gw._auth(request)
    chat, msgs, parts = parse(await gw._json(request), gw.cfg.limits)
    msgs, prefill = split_prefill(msgs)
    try:
        req = S.parse_chat({**chat, "messages": msgs}, gw.cfg.limits)
    except S.BadRequest as e:
        raise S.relabel(e, CHAT_NAMES, {}) from None
    last = req.messages[-1]
    if parts:
        if last.role != "user":
            raise S.BadRequest("images go with the user's text, after any tool results", "messages")
        last = S.Turn(last.role, last.text, last.meta, tuple(parts))
    if parts and prefill:
        raise S.BadRequest("an assistant prefill after an image is not supported; send the image without it",
                           "messages")
    spec = S.Spec(chat=True, system=req.system, history=req.messages[:-1], last=last, sampling=req.sampling,
                stream=req.stream, tools=req.tools, constraint=req.constraint, n=1, title=last.text,
                  model=req.model, prefill=prefill)
    return await gw.generate(request, key, spec, MessagesAPI())


async def count_tokens(gw, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt's token count
    as ``/v1/messages`` renders the same body (system, messages, tools, a prefill) on its
    model; nothing is stored or run. Images are refused (their count is the encoder's)."""
    gw._auth(request)
    body = await gw._json(request)
    if isinstance(body, dict) and body.get("max_tokens") is None:
        body = {**body, "max_tokens": 1}  # (a count takes no max_tokens)
    chat, msgs, parts = parse(body, gw.cfg.limits)
    if parts:
        raise S.BadRequest("count_tokens counts text: images are not counted here", "messages")
    msgs, prefill = split_prefill(msgs)
    chat.pop("stream", None)
    try:
        req = S.parse_chat({**chat, "messages": msgs}, gw.cfg.limits)
    except S.BadRequest as e:
        raise S.relabel(e, CHAT_NAMES, {}) from None
    target = await gw.route(req.model)
    client = await gw.link.get()
    try:
        n = await client.count_tokens([P.PriorMessage(t.role, t.text, t.meta) for t in req.messages],
                                      system_prompt=req.system, tools=req.tools.tools if req.tools.active else [],
                                      prefill=prefill, model=target)
    except ConnectionLost as e:
        raise gw.api_error(503, f"the engine went away: {e}", "server_error", code="engine_unavailable",
                           headers={"Retry-After": str(gw.cfg.retry_after_s)}) from None
    except EngineError as e:
        raise gw.engine_error(P.Error(id=0, code=e.code, message=str(e))) from None
    return JSONResponse({"input_tokens": n})


def split_prefill(msgs: list[dict]) -> tuple[list[dict], str]:
    """(the messages, the prefill): a final assistant message is the start of the reply,
    which continues it (Anthropic's prefill); an empty one asks for a plain reply. Raises
    BadRequest for one with tool_use blocks or trailing whitespace (Anthropic refuses it)."""
    if not msgs or msgs[-1].get("role") != "assistant":
        return msgs, ""
    m = msgs[-1]
    where = m.get(S.AT, "messages")
    if m.get("tool_calls"):
        raise S.BadRequest(f"'{where}': a final assistant message (a prefill) takes text only, not tool_use",
                           "messages")
    text = m.get("content") or ""
    if text != text.rstrip():
        raise S.BadRequest(f"'{where}': final assistant content cannot end with trailing whitespace", "messages")
    if len(msgs) == 1 or all(x.get("role") == "system" for x in msgs[:-1]):
        raise S.BadRequest(f"'{where}': an assistant prefill needs a user message before it", "messages")
    return msgs[:-1], text


def _usage(reply: shapes.Reply) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` counts the prompt tokens NOT read from the cache
    (the restored capsule's), ``cache_read_input_tokens`` those that were; their sum is the
    prompt (OpenAI's prompt_tokens counts the cached ones in)."""
    cached = min(reply.n_cached, reply.n_prompt)
    return {"input_tokens": reply.n_prompt - cached, "output_tokens": reply.n_completion,
            "cache_read_input_tokens": cached}

