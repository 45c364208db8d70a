"""OpenAI's chat completions, (legacy) completions and models endpoints.

Owns: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (the body parsed by
``schema.py`` into a ``Spec``, run by ``core.Gateway.generate``; a final assistant message
is a prefill the reply continues, and holds the continuation only, as llama-server, vLLM's
``continue_final_message`` and Anthropic's Messages do), their renderer in
OpenAI's shapes (``shapes.py``: JSON with the ``X-AOTX-Receipt`` header and an
``aotx`` body field, or server-sent chunks ending with the usage chunk when asked,
an SSE comment ``: aotx.receipt {json}`` and ``data: [DONE]``), and ``GET /v1/models``
and ``GET /v1/models/{name}`` (every installed and loaded model, default first).
Leaves the conversation and the engine to ``core.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aotx.engine import protocol as P
from aotx.engine.gateway import schema as S
from aotx.engine.gateway import shapes
from aotx.engine.gateway.generation import ChoiceState, Generation, Out
from aotx.engine.gateway.limits import ApiError
from aotx.engine.gateway.link import engine_error
from aotx.engine.gateway.streaming import sse, sse_comment


def model_object(m: P.ModelInfo) -> dict[str, Any]:
    """One model as ``/v1/models`` lists it (``aotx``: what AOTX knows of it)."""
    # "context": what a prompt plus its reply may hold: the context a loaded model serves
    # (its slots' length), else the one it was trained for; "context_train": the latter
    ctx = m.n_ctx if m.loaded and m.n_ctx else m.n_ctx_train
    obj = {"id": m.name, "object": "model", "created": 0, "owned_by": "aotx" if m.kind == "gguf" else "remote",
           "aotx": {"loaded": m.loaded, "default": m.default, "kind": m.kind, "arch": m.arch, "quant": m.quant,
                    "context": ctx, "context_train": m.n_ctx_train, "size_bytes": m.size_bytes,
                    "needs_bytes": m.needs_bytes}}
    if m.loaded and m.n_ctx:
        obj["max_model_len"] = m.n_ctx      # the field vLLM's clients read
    return obj


async def models(gw, request: Request) -> Response:
    """``GET /v1/models``: every installed model (files, remote endpoints) and every
    loaded one, default first."""
    gw._auth(request)
    ms = sorted((m for m in await gw._models() if not m.error), key=lambda m: not m.default)
    return JSONResponse({"object": "list", "data": [model_object(m) for m in ms]})


async def model(gw, request: Request) -> Response:
    """``GET /v1/models/{name}``."""
    gw._auth(request)
    # the names a request's ``model`` takes (route: case, ``.gguf``, "local"), 404 for others
    found = await gw.route(request.path_params["name"])
    for m in await gw._models():
        if not m.error and ((m.name == found) if found else m.default):
            return JSONResponse(model_object(m))
    raise ApiError(404, f"the model {request.path_params['name'][:80]!r} is not available", "invalid_request_error",
                   param="model", code="model_not_found")


async def chat(gw, request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    key = gw._auth(request)
    body = await gw._json(request)
    prefill = ""
    if isinstance(body, dict):
        body, prefill = S.take_prefill(body)
    req = S.parse_chat(body, gw.cfg.limits, gw.keys.file_roots(key))
    if prefill and req.messages[-1].parts:
        raise S.BadRequest("an assistant prefill after a media part is not supported; send the media without it",
                           "messages")
    spec = S.Spec(chat=True, system=req.system, history=req.messages[:-1], last=req.messages[-1],
                  sampling=req.sampling, stream=req.stream, include_usage=req.include_usage, tools=req.tools,
                  constraint=req.constraint, logprobs=req.logprobs, n=req.n, title=req.messages[-1].text,
                  model=req.model, prefill=prefill, context=req.context)
    return await gw.generate(request, key, spec, CHAT)


async def completions(gw, request: Request) -> Response:
    """``POST /v1/completions``: the prompt goes to the engine raw (no chat template)."""
    key = gw._auth(request)
    req = S.parse_completion(await gw._json(request), gw.cfg.limits)
    spec = S.Spec(chat=False, system=None, history=[], last=S.Turn("user", req.prompt), sampling=req.sampling,
                  stream=req.stream, include_usage=req.include_usage, constraint=req.constraint,
                  logprobs=req.logprobs, n=req.n, title=req.prompt, model=req.model)
    return await gw.generate(request, key, spec, COMPLETION)


class _OpenAI:
    """Chat completions and (legacy) completions in OpenAI's shapes."""

    def __init__(self, chat: bool):
        self.chat = chat

    def new_id(self) -> str:
        return shapes.new_id("chatcmpl" if self.chat else "cmpl")

    @staticmethod
    def error(e: ApiError) -> Response:
        return e.response()

    async def final(self, gw, gen: Generation, reply: shapes.Reply, spec: S.Spec) -> dict[str, Any]:
        return shapes.chat_completion(reply) if self.chat else shapes.text_completion(reply)

    async def stream(self, gw, gen: Generation, reply: shapes.Reply, spec: S.Spec,
                     states: list[ChoiceState]) -> AsyncIterator[bytes]:
        chat = self.chat
        if chat:
            for st in states:
                yield sse(shapes.chat_chunk(reply, {"role": "assistant", "content": ""}, index=st.index))
        pending: dict[int, list] = {}
        offsets: dict[int, int] = {}  # per choice: the text its logprob tokens so far cover

        def chunk(o: Out) -> bytes | None:
            i = o.choice
            if o.kind == "logprob":
                pending.setdefault(i, []).append(o.entry)
                return None
            lp = pending.pop(i, None) if spec.logprobs >= 0 else None
            at = offsets.get(i, 0)
            if lp:
                offsets[i] = at + sum(len(e["token"]) for e in lp)
            if o.kind == "content":
                return sse(shapes.chat_chunk(reply, {"content": o.text}, index=i, logprobs=lp) if chat
                            else shapes.text_chunk(reply, o.text, index=i, logprobs=lp, offset0=at))
            if o.kind == "call":
                idx, cid, name, args = o.call
                call: dict[str, Any] = {"index": idx, "function": {"arguments": args}}
                if cid is not None:
                    call.update(id=cid, type="function")
                    call["function"]["name"] = name
                return sse(shapes.chat_chunk(reply, {"tool_calls": [call]}, index=i, logprobs=lp))
            # finish: any logprobs still pending ride on an empty delta first
            pre = (sse(shapes.chat_chunk(reply, {}, index=i, logprobs=lp) if chat
                        else shapes.text_chunk(reply, "", index=i, logprobs=lp, offset0=at)) if lp else b"")
            return pre + sse(shapes.chat_chunk(reply, {}, o.text, index=i) if chat
                              else shapes.text_chunk(reply, "", states[i].choice.finish_reason, index=i))

        try:
            async for ev in gen.events():
                outs: list[Out] = []
                if isinstance(ev, P.Token):
                    outs = states[ev.choice].token(ev)
                elif isinstance(ev, P.Committed):
                    if ev.choice == 0:
                        reply.n_prompt = ev.n_prompt
                        reply.n_cached = int(ev.timings.get("prompt_tokens_reused", 0))
                    if ev.finish_reason == "error":
                        yield sse(shapes.error_body("the engine failed while generating this reply", "server_error",
                                                code="generation_failed"))
                        yield b"data: [DONE]\n\n"
                        return
                    outs = states[ev.choice].committed(ev)
                elif isinstance(ev, P.Error):
                    e = engine_error(ev, None, gw.cfg.retry_after_s)
                    yield sse(e.body)
                    yield b"data: [DONE]\n\n"
                    return
                for o in outs:
                    b = chunk(o)
                    if b:
                        yield b
        except ApiError as e:
            yield sse(e.body)
            yield b"data: [DONE]\n\n"
            return
        gw._finish_reply(gen, reply, states)
        if spec.include_usage:               # the last chunk, as OpenAI sends it: no choices, the usage
            yield sse({**shapes.usage_chunk(reply, chat), "aotx": reply.aotx})
        # the receipt as an SSE comment: clients skip comments, and the openai client hands a
        # named event's data to the caller as one more chunk (with no choices, the quickstart's
        # chunk.choices[0] raised IndexError)
        yield sse_comment("aotx.receipt", reply.aotx)
        yield b"data: [DONE]\n\n"


CHAT, COMPLETION = _OpenAI(True), _OpenAI(False)
