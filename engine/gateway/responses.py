"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``) on the journal.

Owns: parsing a Responses request into the gateway's ``Spec`` and answering in the
Responses shapes (a ``response`` object with ``message`` and ``function_call`` output
items; streaming as ``response.*`` events, ending with ``response.failed`` when the engine
fails or goes away mid-stream). A response id names where its reply lives
in the journal: ``resp_<conversation>_<reply message>``, so it is durable (it is the
journal's record, and survives an engine restart) and ``previous_response_id``
continues that conversation: the engine's next turn restores the conversation's
capsule (from memory, or from disk after a restart) instead of the client re-sending
the history. Continuing a response that is no longer the conversation's last reply
forks the conversation there first (``ForkConversation``), so both branches live on.
Function calls are named ``call_<reply message>_<i>``: a ``function_call_output`` is
checked against the calls its response really made, even after a restart.

Supported: ``input`` (a string, or message items with ``input_text`` / ``input_image``
parts, ``function_call`` and ``function_call_output`` items), ``instructions``,
``previous_response_id``, ``tools`` (function tools), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (text, json_object, json_schema),
``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs``, ``seed``,
``stream``. With ``previous_response_id``, ``instructions`` replaces the conversation's
system prompt when given and keeps it otherwise (OpenAI drops it; keeping it keeps the
restored state valid). Several new input items after ``previous_response_id`` start a
new conversation holding the history (the state is then found by prefix, in memory).
Leaves HTTP, auth and the engine to ``core.py``.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aotx.engine.errors import EngineError, ErrorCode
from aotx.engine.gateway import schema as S
from aotx.engine.gateway import shapes
from aotx.engine import protocol as P
from aotx.engine.model import tool_calls

RESPONSE_ID = re.compile(r"^resp_(c[A-Za-z0-9]{1,40})_(m[A-Za-z0-9]{1,40})$")
CALL_ID = re.compile(r"^call_(m[A-Za-z0-9]{1,40})_(\d{1,4})$")


# the meta key of a response's input message that names the response it continued
PREVIOUS = P.CLIENT_META_PREFIX + "previous_response_id"


def response_id(conv_id: str, reply_id: str) -> str:
    return f"resp_{conv_id}_{reply_id}"


# chat-completions names -> Responses' (errors from parse_chat name what the client sent)
CHAT_NAMES = ((".tool_calls[0].function.name", ".name"), (".tool_calls[0].function.arguments", ".arguments"),
              (".tool_calls[0]", ""), (".tool_call_id", ".call_id"), ("'max_tokens'", "'max_output_tokens'"),
              (".function.name", ".name"), (".function.parameters", ".parameters"),
              ('{"type": "function", "function": {...}}', '{"type": "function", "name": ..., "parameters": {...}}'))


def _flat_tools(body: dict) -> dict:
    """Responses' flat function tools -> the chat shape ``parse_tools`` reads."""
    raw = body.get("tools")
    if not isinstance(raw, list):
        return {"tools": raw, "tool_choice": body.get("tool_choice"),
                "parallel_tool_calls": body.get("parallel_tool_calls", True)}
    tools = []
    for t in raw:
        if isinstance(t, dict) and t.get("type") == "function" and "function" not in t:
            tools.append({"type": "function", "function": {k: v for k, v in t.items() if k not in ("type", "strict")}})
        else:
            tools.append(t)
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function" and "name" in tc:
        tc = {"type": "function", "function": {"name": tc["name"]}}
    return {"tools": tools, "tool_choice": tc, "parallel_tool_calls": body.get("parallel_tool_calls", True)}


def _text_format(body: dict) -> dict:
    text = body.get("text")
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise S.BadRequest("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise S.BadRequest("'text.format' must be an object", "text")
    if fmt.get("type") == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": fmt.get("schema", {}),
                                                                           "name": fmt.get("name")}}}
    return {"response_format": {"type": fmt.get("type")}}


def parse(body: Any, limits: S.Limits, file_roots: tuple) -> tuple[dict, list[dict], str | None]:
    """(the chat-shaped body, the input as chat messages, previous_response_id).
    Raises BadRequest naming the field."""
    if not isinstance(body, dict):
        raise S.BadRequest("the request body must be a JSON object")
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not RESPONSE_ID.match(prev)):
        raise S.BadRequest(f"'previous_response_id' {str(prev)[:80]!r} is not a response id of this server",
                           "previous_response_id")
    inp = body.get("input")
    if inp is None:
        raise S.BadRequest("'input' is required", "input")
    if isinstance(inp, str):
        items: list[Any] = [{"role": "user", "content": inp, S.AT: "input"}]
    elif isinstance(inp, list) and inp:
        items = inp
    else:
        raise S.BadRequest("'input' must be a string or a non-empty array of items", "input")
    msgs: list[dict] = []
    if isinstance(body.get("instructions"), str):
        msgs.append({"role": "system", "content": body["instructions"], S.AT: "instructions"})
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise S.BadRequest(f"'input[{i}]' must be an object", "input")
        kind = it.get("type", "message")
        at = it.get(S.AT, f"input[{i}]")
        if kind == "message":
            content = it.get("content")
            if isinstance(content, list):
                content = [_part(p) for p in content]
            msgs.append({"role": it.get("role"), "content": content, S.AT: at})
        elif kind == "function_call":
            msgs.append({"role": "assistant", "content": None, S.AT: at, "tool_calls": [
                {"id": it.get("call_id"), "type": "function",
                 "function": {"name": it.get("name"), "arguments": it.get("arguments", "{}")}}]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"), S.AT: at,
                         "content": out if isinstance(out, str) else json.dumps(out)})
        else:
            raise S.BadRequest(f"'input[{i}].type' {kind!r} is not taken (message, function_call, "
                               "function_call_output)", "input")
    # the fields chat completions takes under the same name (model was left out: every response
    # came from the default model, an unknown name got no 404; grammar and repeat_penalty too)
    chat = {k: v for k, v in body.items() if k in ("model", "temperature", "top_p", "top_k", "min_p", "seed",
                                                   "stream", "stop", "repeat_penalty", "grammar")}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("top_logprobs"):
        chat.update(logprobs=True, top_logprobs=body["top_logprobs"])
    chat.update(_flat_tools(body))
    chat.update(_text_format(body))
    return chat, msgs, prev


def _part(p: Any) -> Any:
    if isinstance(p, dict) and p.get("type") == "input_image":
        return {"type": "image_url", "image_url": {"url": p.get("image_url")}}
    return p


class ResponsesAPI:
    """The renderer ``Gateway.generate`` calls for ``/v1/responses``."""

    def __init__(self, body: dict, prev: str | None):
        self.body = body
        self.prev = prev
        self._id: str | None = None

    def new_id(self) -> str:
        return "resp_pending"

    @staticmethod
    def error(e) -> Response:
        return e.response()

    def _response(self, gen, reply: shapes.Reply, spec, status: str) -> dict[str, Any]:
        a = gen.accepted.get(0)
        rid = response_id(a.conv_id, a.reply_id) if a else reply.id
        c = reply.choices[0]
        incomplete = _incomplete(reply) if status == "completed" else False
        output: list[dict[str, Any]] = []
        if c.text or not c.tool_calls:
            part: dict[str, Any] = {"type": "output_text", "text": c.text, "annotations": []}
            if c.logprobs is not None:
                part["logprobs"] = c.logprobs
            output.append({"type": "message", "id": f"msg_{a.reply_id if a else ''}",
                           "status": "incomplete" if incomplete else status,
                           "role": "assistant", "content": [part] if status == "completed" or c.text else []})
        for k, call in enumerate(c.tool_calls):
            output.append({"type": "function_call", "id": f"fc_{a.reply_id}_{k}", "call_id": call["id"],
                           "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                           "status": "completed"})
        body = self.body
        return {
            "id": rid, "object": "response", "created_at": reply.created, "model": reply.model,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "instructions": body.get("instructions"), "output": output,
            "parallel_tool_calls": spec.tools.parallel, "previous_response_id": self.prev,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "text": body.get("text") or {"format": {"type": "text"}},
            "usage": {"input_tokens": reply.n_prompt, "output_tokens": reply.n_completion,
                      "total_tokens": reply.n_prompt + reply.n_completion,
                      "input_tokens_details": {"cached_tokens": reply.n_cached},
                      "output_tokens_details": {"reasoning_tokens": 0}} if status == "completed" else None,
            "store": True, "completed_at": time.time() if status == "completed" else None,
            "aotx": gen.aotx(0),
        }

    async def final(self, gw, gen, reply: shapes.Reply, spec) -> dict[str, Any]:
        return self._response(gen, reply, spec, "completed")

    def _failed(self, gen, reply: shapes.Reply, spec, message: str) -> dict[str, Any]:
        """The ``response.failed`` event that ends a stream the engine could not finish (it
        failed, or went away): the response with status "failed" and OpenAI's error object."""
        resp = self._response(gen, reply, spec, "in_progress")
        resp.update(status="failed", output=[], error={"code": "server_error", "message": message})
        return {"type": "response.failed", "response": resp}

    async def stream(self, gw, gen, reply: shapes.Reply, spec, states) -> AsyncIterator[bytes]:
        seq = 0

        def ev(obj: dict[str, Any]) -> bytes:
            nonlocal seq
            obj["sequence_number"] = seq
            seq += 1
            data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
            return f"event: {obj['type']}\ndata: {data}\n\n".encode()

        a = gen.accepted[0]
        head = self._response(gen, reply, spec, "in_progress")
        head["output"] = []
        yield ev({"type": "response.created", "response": head})
        yield ev({"type": "response.in_progress", "response": head})
        next_index = 0
        msg_index: int | None = None
        text = ""
        pending_lp: list = []
        calls: dict[int, dict[str, Any]] = {}  # call index -> {output_index, item}
        msg_id = f"msg_{a.reply_id}"
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
                        yield ev(self._failed(gen, reply, spec, "the engine failed while generating this reply"))
                        return
                    outs = st.committed(e)
                elif isinstance(e, P.Error):
                    yield ev(self._failed(gen, reply, spec, gw.engine_error(e).body["error"]["message"]))
                    return
                for o in outs:
                    if o.kind == "logprob":
                        pending_lp.append(o.entry)
                    elif o.kind == "content":
                        if msg_index is None:
                            msg_index, next_index = next_index, next_index + 1
                            yield ev({"type": "response.output_item.added", "output_index": msg_index,
                                      "item": {"type": "message", "id": msg_id, "status": "in_progress",
                                               "role": "assistant", "content": []}})
                            yield ev({"type": "response.content_part.added", "item_id": msg_id,
                                      "output_index": msg_index, "content_index": 0,
                                      "part": {"type": "output_text", "text": "", "annotations": []}})
                        text += o.text
                        yield ev({"type": "response.output_text.delta", "item_id": msg_id, "output_index": msg_index,
                                  "content_index": 0, "delta": o.text, "logprobs": pending_lp})
                        pending_lp = []
                    elif o.kind == "call":
                        idx, cid, name, args = o.call
                        if idx not in calls:
                            item = {"type": "function_call", "id": f"fc_{a.reply_id}_{idx}", "call_id": cid,
                                    "name": name, "arguments": "", "status": "in_progress"}
                            calls[idx] = {"output_index": next_index, "item": item}
                            next_index += 1
                            yield ev({"type": "response.output_item.added", "output_index": calls[idx]["output_index"],
                                      "item": dict(item)})
                        c = calls[idx]
                        c["item"]["arguments"] += args
                        if args:
                            yield ev({"type": "response.function_call_arguments.delta", "item_id": c["item"]["id"],
                                      "output_index": c["output_index"], "delta": args})
        except gw.api_error as err:  # the engine went away
            yield ev(self._failed(gen, reply, spec, err.body["error"]["message"]))
            return
        gw._finish_reply(gen, reply, states)
        if msg_index is not None:
            part = {"type": "output_text", "text": text, "annotations": []}
            yield ev({"type": "response.output_text.done", "item_id": msg_id, "output_index": msg_index,
                      "content_index": 0, "text": text, "logprobs": []})
            yield ev({"type": "response.content_part.done", "item_id": msg_id, "output_index": msg_index,
                      "content_index": 0, "part": part})
            yield ev({"type": "response.output_item.done", "output_index": msg_index,
                      "item": {"type": "message", "id": msg_id,
                               "status": "incomplete" if _incomplete(reply) else "completed", "role": "assistant",
                               "content": [part]}})
        for idx, c in sorted(calls.items()):
            item = dict(c["item"], status="completed")
            yield ev({"type": "response.function_call_arguments.done", "item_id": item["id"],
                      "output_index": c["output_index"], "arguments": item["arguments"]})
            yield ev({"type": "response.output_item.done", "output_index": c["output_index"], "item": item})
        final = self._response(gen, reply, spec, "completed")
        yield ev({"type": f"response.{final['status']}", "response": final})   # completed, or incomplete


def _incomplete(reply: shapes.Reply) -> bool:
    """The reply stopped at its max_output_tokens or the context (OpenAI: status
    "incomplete", reason max_output_tokens, on the response and its message item)."""
    return reply.choices[0].finish_reason in ("length", "context")


async def create(gw, request: Request) -> Response:
    """``POST /v1/responses``."""
    key = gw._auth(request)
    raw = await gw._json(request)
    chat, msgs, prev = parse(raw, gw.cfg.limits, gw.keys.file_roots(key))
    conv, after = None, ""
    if prev is not None:
        conv, msgs, after = await _continue(gw, prev, msgs)
    if not [m for m in msgs if m.get("role") not in ("system", "developer")]:
        raise S.BadRequest("'input' holds no message to answer", "input")
    try:
        req = S.parse_chat({**chat, "messages": msgs}, gw.cfg.limits, gw.keys.file_roots(key))
    except S.BadRequest as e:
        raise S.relabel(e, CHAT_NAMES, {"messages": "input", "max_tokens": "max_output_tokens"}) from None
    last = req.messages[-1]
    if prev is not None:  # noted on the message it answers, for GET /v1/responses/{id}
        last = S.Turn(last.role, last.text, {**last.meta, PREVIOUS: prev}, last.parts)
    spec = S.Spec(chat=True, system=req.system, history=req.messages[:-1], last=last,
                sampling=req.sampling, stream=req.stream, tools=req.tools, constraint=req.constraint,
                logprobs=req.logprobs, n=1, conversation=conv, after=after, title=req.messages[-1].text,
                  model=req.model)
    return await gw.generate(request, key, spec, ResponsesAPI(raw, prev))


async def _continue(gw, prev: str, msgs: list[dict]) -> tuple[str | None, list[dict], str]:
    """The conversation a ``previous_response_id`` continues (forked when the response is
    not its last reply), the input as chat messages with the calls it answers, and the
    message the reply must follow there ("" for a fork: nobody else writes to it; the
    conversation's own may move on before the message is taken, ``Gateway.begin`` forks
    then). With several new items, None and the whole history as messages (a new
    conversation)."""
    conv_id, reply_id = RESPONSE_ID.match(prev).groups()
    client = await gw.link.get()
    try:
        view = await client.show(conv_id)
    except EngineError as e:
        if e.code == ErrorCode.NOT_FOUND:
            raise gw.api_error(404, f"previous_response_id {prev!r}: no such response", "invalid_request_error",
                               param="previous_response_id", code="response_not_found") from None
        raise
    idx = next((i for i, m in enumerate(view.messages) if m.msg_id == reply_id and m.role == "assistant"), None)
    if idx is None:
        raise gw.api_error(404, f"previous_response_id {prev!r}: no such response", "invalid_request_error",
                           param="previous_response_id", code="response_not_found")
    if view.messages[idx].status in ("accepted", "streaming"):  # (a fork would take its text so far)
        raise gw.api_error(409, f"previous_response_id {prev!r} is still being generated; continue it once it "
                                f"has finished", "conflict_error", param="previous_response_id",
                           code="response_in_progress", headers={"Retry-After": str(gw.cfg.retry_after_s)})
    # the calls the previous reply made, as the template and the checks want them
    family = await gw.tool_format(client, view.model)
    _, calls = tool_calls.parse(view.messages[idx].text, family)
    prior_calls = [{"id": f"call_{reply_id}_{k}", "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(calls)]
    system = [m for m in msgs if m.get("role") in ("system", "developer")]
    new = [m for m in msgs if m.get("role") not in ("system", "developer")]
    for m in new:
        if m.get("role") == "tool":
            cid = str(m.get("tool_call_id"))
            cm = CALL_ID.match(cid)
            if cm is None or cm.group(1) != reply_id or int(cm.group(2)) >= len(calls):
                raise S.BadRequest(f"'input': function_call_output {cid!r} answers no call of {prev}", "input")
    # the previous reply as an assistant turn with its calls, so tool messages can be matched
    anchor = {"role": "assistant", "content": "", "tool_calls": prior_calls} if prior_calls else None
    if len(new) == 1:
        target, after = conv_id, reply_id
        if idx != len(view.messages) - 1:  # a branch: fork at that reply
            target, after = (await client.fork(conv_id, at_msg_id=reply_id)).conv_id, ""
        return target, system + ([anchor] if anchor else []) + new, after
    history = [{"role": m.role, "content": m.text} for m in view.messages[:idx + 1]
               if m.role in ("user", "assistant") and (m.text or m.role == "user")]
    if anchor and history:
        history[-1] = {**history[-1], "tool_calls": prior_calls}
    sys_msgs = system or ([{"role": "system", "content": view.system_prompt}] if view.system_prompt else [])
    return None, sys_msgs + history + new, ""


async def retrieve(gw, request: Request) -> Response:
    """``GET /v1/responses/{id}``: the stored response, from the journal."""
    gw._auth(request)
    rid = request.path_params["response_id"]
    m = RESPONSE_ID.match(rid)
    if m is None:
        raise gw.api_error(404, f"no response {rid[:80]!r}", "invalid_request_error", param="response_id",
                           code="response_not_found")
    conv_id, reply_id = m.groups()
    client = await gw.link.get()
    try:
        view = await client.show(conv_id)
    except EngineError:
        view = None
    msgs = view.messages if view else []
    at = next((i for i, x in enumerate(msgs) if x.msg_id == reply_id), None)
    msg = msgs[at] if at is not None else None
    if msg is None:
        raise gw.api_error(404, f"no response {rid!r}", "invalid_request_error", param="response_id",
                           code="response_not_found")
    content, calls = tool_calls.parse(msg.text, await gw.tool_format(client, msg.model or view.model))
    output: list[dict[str, Any]] = []
    if content or not calls:
        output.append({"type": "message", "id": f"msg_{reply_id}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": content, "annotations": []}]})
    for k, c in enumerate(calls):
        output.append({"type": "function_call", "id": f"fc_{reply_id}_{k}", "call_id": f"call_{reply_id}_{k}",
                       "name": c.name, "arguments": c.arguments, "status": "completed"})
    done = msg.status == "complete"
    return JSONResponse({"id": rid, "object": "response", "created_at": view.updated_at, "model": gw.link.model,
                         "status": "completed" if done else ("in_progress" if msg.status in ("accepted", "streaming")
                                                             else "incomplete"),
                         "output": output, "previous_response_id": _previous(msgs, at),
                         "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                         "aotx": {"conversation": conv_id, "reply_id": reply_id,
                                  "receipt": shapes.receipt_dict(msg.receipt)}})


def _previous(msgs: list[P.MessageView], at: int) -> str | None:
    """The ``previous_response_id`` of the reply ``msgs[at]``: the one its input message
    (the message just before it) was sent with, None when none was."""
    if at == 0 or msgs[at].role != "assistant" or msgs[at - 1].role == "assistant":
        return None
    prev = msgs[at - 1].meta.get(PREVIOUS)
    return prev if isinstance(prev, str) else None
