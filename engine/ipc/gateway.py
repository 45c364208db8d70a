"""``aotx gateway``: an OpenAI-compatible HTTP API in front of the engine.

Owns: the HTTP side (Starlette on uvicorn), bearer-key authentication, limits
against abuse, and the mapping between OpenAI requests and engine
conversations: a request continues the conversation named by its
``X-AOTX-Conversation`` header or creates one (the system message becomes its
system prompt), submits the last user message, and answers in OpenAI's shapes
(``gateway_schema.py``) with the durable receipt of the reply: the
``X-AOTX-Receipt`` header (JSON) and an ``aotx`` body field when not streaming,
an ``event: aotx.receipt`` SSE event just before ``data: [DONE]`` when
streaming. Every response names its conversation in ``X-AOTX-Conversation``.
Leaves to others: generation, conversations and the journal (the engine, over
its local socket through ``client.EngineClient``), keys on disk
(``gateway_auth.py``).

HTTP status of engine outcomes: too_long -> 400 (with the prompt's and the
context's token counts), busy (the conversation is generating) -> 409,
not_found -> 404, not_ready or no engine -> 503 with Retry-After; the gateway's
own limits: more generations in flight than ``max_queue`` or than
``per_key_concurrency`` for one key -> 429 with Retry-After, a body over
``max_body_bytes`` -> 413. A client that disconnects cancels its generation.

A multi-turn request on a fresh conversation stores its earlier turns as the new
conversation's history (``CreateConversation.messages``), so the chat template sees
them as real turns. Frequency/presence penalties are accepted but not applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aotx.engine.errors import AotxError, EngineError, ErrorCode, UsageError
from aotx.engine.ipc import gateway_schema as S
from aotx.engine.ipc import protocol as P
from aotx.engine.ipc.client import ConnectionLost, EngineClient
from aotx.engine.ipc.gateway_auth import KeyRing
from aotx.engine.ipc.server import raise_fd_limit

_CONV_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class GatewayConfig:
    """Limits and timeouts of one gateway. ``max_queue``: generations in flight
    across all keys (running and queued in the engine); ``durable_timeout_s``: how
    long a finished reply waits for its receipt before it is sent without one."""

    limits: S.Limits = field(default_factory=S.Limits)
    per_key_concurrency: int = 16
    max_queue: int = 64
    retry_after_s: int = 1
    durable_timeout_s: float = 30.0
    # concurrent HTTP connections (idle keep-alives included) before uvicorn answers 503
    max_connections: int = 512


class ApiError(Exception):
    """An HTTP error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.body = S.error_body(message, type_, param, code, **extra)
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


class _ClientGone(Exception):
    pass


MODEL_LIST_TTL_S = 1.0  # the engine's model list is asked at most this often

# ---- the engine connection ------------------------------------------------------

class EngineLink:
    """The gateway's one engine connection (requests multiplex over it), opened
    again when it drops. ``connect`` opens a new ``EngineClient``."""

    def __init__(self, connect: Callable[[], Awaitable[EngineClient]], retry_after_s: int = 1):
        self._connect = connect
        self._client: EngineClient | None = None
        self._lock = asyncio.Lock()
        self.retry_after_s = retry_after_s
        self.model = ""

    async def get(self) -> EngineClient:
        """The live client. Raises ApiError 503 when no engine answers."""
        c = self._client
        if c is not None and not c.closed:
            return c
        async with self._lock:
            c = self._client
            if c is not None and not c.closed:
                return c
            try:
                c = await self._connect()
            except (AotxError, OSError) as e:
                raise ApiError(503, f"the engine is not available: {e}", "server_error", code="engine_unavailable",
                               headers={"Retry-After": str(self.retry_after_s)}) from None
            self._client = c
            self.model = c.welcome.model
            return c

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


# ---- in-flight accounting ---------------------------------------------------------

class InFlight:
    """Counts generations in flight, in all and per key; refuses with 429 past the limits."""

    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.total = 0
        self.per_key: dict[str, int] = {}

    def enter(self, key: str) -> None:
        retry = {"Retry-After": str(self.cfg.retry_after_s)}
        if self.total >= self.cfg.max_queue:
            raise ApiError(429, f"the server's queue is full ({self.total} generations in flight, the limit is "
                                f"{self.cfg.max_queue}); retry later", "rate_limit_error", code="queue_full",
                           headers=retry)
        n = self.per_key.get(key, 0)
        if n >= self.cfg.per_key_concurrency:
            raise ApiError(429, f"this API key has {n} requests in flight, the limit is "
                                f"{self.cfg.per_key_concurrency}; retry when one finishes", "rate_limit_error",
                           code="concurrency_limit", headers=retry)
        self.total += 1
        self.per_key[key] = n + 1

    def leave(self, key: str) -> None:
        self.total -= 1
        n = self.per_key.get(key, 1) - 1
        if n:
            self.per_key[key] = n
        else:
            self.per_key.pop(key, None)


# ---- one generation -----------------------------------------------------------------

class Generation:
    """One message submitted to the engine and its events.

    ``start`` reads events up to ``Accepted`` (so refusals become HTTP statuses
    before a response starts); ``events`` yields the rest and stops at the reply's
    final receipt, or ``durable_timeout_s`` after ``Committed`` without one."""

    def __init__(self, client: EngineClient, conv_id: str, created: bool, cfg: GatewayConfig):
        self.client = client
        self.conv_id = conv_id
        self.created = created
        self.cfg = cfg
        self.accepted: P.Accepted | None = None
        self.committed: P.Committed | None = None
        self.receipt: P.Receipt | None = None
        self.user_receipt: P.Receipt | None = None
        self._agen: AsyncIterator[P.Message] | None = None
        self._done = False

    async def _next(self) -> P.Message | None:
        try:
            return await self._agen.__anext__()
        except StopAsyncIteration:
            self._done = True
            return None
        except ConnectionLost as e:
            self._done = True
            raise ApiError(503, f"the engine went away: {e}", "server_error", code="engine_unavailable",
                           headers={"Retry-After": str(self.cfg.retry_after_s)}) from None

    async def start(self, text: str, sampling: P.SamplingParams, raw: bool, model: str = "") -> None:
        """Submit (on ``model``; "" the conversation's); return once accepted. Raises
        ApiError for a refusal."""
        self._agen = self.client.submit(self.conv_id, text, sampling=sampling, raw=raw, model=model)
        refused: P.Notice | None = None
        while True:
            ev = await self._next()
            if ev is None:
                raise ApiError(502, "the engine ended the request without accepting it", "server_error")
            if isinstance(ev, P.Notice):
                if ev.kind == "refused":
                    refused = ev
            elif isinstance(ev, P.Error):
                self._done = True
                if self.created:
                    await self._forget()
                raise _engine_error(ev, refused, self.cfg.retry_after_s)
            elif isinstance(ev, P.Accepted):
                self.accepted = ev
                return

    async def events(self) -> AsyncIterator[P.Message]:
        while not self._done:
            if self.committed is not None:
                try:
                    ev = await asyncio.wait_for(self._next(), self.cfg.durable_timeout_s)
                except asyncio.TimeoutError:
                    self._done = True
                    return
            else:
                ev = await self._next()
            if ev is None:
                return
            if isinstance(ev, P.Committed):
                self.committed = ev
            elif isinstance(ev, P.Durable):
                if self.accepted is not None and ev.msg_id == self.accepted.msg_id:
                    self.user_receipt = ev.receipt
                if self.committed is not None and ev.receipt.last_seq >= self.committed.seq:
                    self.receipt = ev.receipt
            elif isinstance(ev, P.Error):
                self._done = True
            yield ev

    def aotx(self) -> dict[str, Any]:
        """The ``aotx`` object of a reply: conversation, message ids, receipts."""
        a = self.accepted
        return {"conversation": self.conv_id, "msg_id": a.msg_id if a else None,
                "reply_id": a.reply_id if a else None, "receipt": S.receipt_dict(self.receipt),
                "user_receipt": S.receipt_dict(self.user_receipt)}

    async def abandon(self) -> None:
        """The client went away: cancel the generation unless it finished. The
        cancel is sent without waiting for the engine's answer (it comes after
        the current tick), so the HTTP side is released at once."""
        if self.committed is None:
            if self.accepted is not None:
                op = self.client.cancel(target=self.accepted.id)
            else:
                op = self.client.cancel(conv_id=self.conv_id)
            task = asyncio.ensure_future(op)
            _background.add(task)
            task.add_done_callback(_settle)
        if self._agen is not None:
            try:
                await self._agen.aclose()
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - closing a half-read stream
                pass

    async def _forget(self) -> None:
        try:
            await self.client.delete(self.conv_id)
        except (AotxError, OSError):
            pass


_background: set[asyncio.Future] = set()


def _settle(task: asyncio.Future) -> None:
    _background.discard(task)
    if not task.cancelled():
        task.exception()  # a lost engine or a finished request: nothing to do


def _engine_error(ev: P.Error, refused: P.Notice | None, retry_after_s: int) -> ApiError:
    retry = {"Retry-After": str(retry_after_s)}
    if ev.code == ErrorCode.TOO_LONG:
        extra = {}
        if refused is not None:
            extra = {"prompt_tokens": refused.asked - 1, "context_tokens": refused.free}
        return ApiError(400, f"{ev.message}; shorten the messages", "invalid_request_error",
                        param="messages", code="context_length_exceeded", **extra)
    if ev.code == ErrorCode.BUSY:
        return ApiError(409, ev.message, "conflict_error", code="conversation_busy")
    if ev.code == ErrorCode.NOT_FOUND:
        return ApiError(404, ev.message, "not_found_error", code="conversation_not_found")
    if ev.code == ErrorCode.NOT_READY:
        return ApiError(503, ev.message, "server_error", code="not_ready", headers=retry)
    if ev.code in (ErrorCode.BAD_REQUEST, ErrorCode.UNSUPPORTED_MEDIA):
        return ApiError(400, ev.message, "invalid_request_error", code=ev.code)
    return ApiError(500, f"the engine failed: {ev.message}", "server_error", code=ev.code)


# ---- HTTP helpers ---------------------------------------------------------------------

async def _until_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _race_disconnect(request: Request, coro: Awaitable):
    """Await ``coro``; raise _ClientGone (after cancelling it) if the client leaves first."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        gone.cancel()
        raise
    if work.done():
        gone.cancel()
        return work.result()
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone; nobody reads it
        pass
    raise _ClientGone()


def _sse(obj: Any, event: str | None = None) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + b"data: " + data.encode() + b"\n\n"


class EventStream(Response):
    """A server-sent-events response that watches for the client leaving while it
    streams, and then cancels the body and calls ``on_close(gone=True)``."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str],
                 on_close: Callable[[bool], Awaitable[None]]):
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        work = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_until_disconnect(receive))
        gone = False
        try:
            try:
                await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the server is shutting down: end the stream, cancel the reply
                gone = True
                work.cancel()
                for step in (lambda: work, lambda: send({"type": "http.response.body", "body": b"",
                                                          "more_body": False})):
                    try:
                        await step()
                    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - best effort on the way out
                        pass
                return
            if work.done():
                watch.cancel()
                try:
                    work.result()
                except OSError:
                    gone = True
            else:
                gone = True
                work.cancel()
                try:
                    await work
                except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone
                    pass
        finally:
            if not work.done():
                work.cancel()
            watch.cancel()
            await self.on_close(gone)


# ---- the application ----------------------------------------------------------------

class Gateway:
    """The endpoints. ``keys``: the KeyRing; ``link``: the EngineLink."""

    def __init__(self, cfg: GatewayConfig, keys: KeyRing, link: EngineLink):
        self.cfg = cfg
        self.keys = keys
        self.link = link
        self.inflight = InFlight(cfg)
        self._model_cache: tuple[float, list[P.ModelInfo]] | None = None

    # -- auth and body --

    def _auth(self, request: Request) -> str:
        fp = self.keys.check(request.headers.get("authorization"))
        if fp is None:
            given = "authorization" in request.headers
            raise ApiError(401, "incorrect API key provided" if given else
                           "no API key provided: send 'Authorization: Bearer <key>' (the key file's path is printed "
                           "when `aotx gateway` starts)", "invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return fp

    async def _json(self, request: Request) -> Any:
        lim = self.cfg.limits.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise ApiError(400, f"Content-Length {cl!r} is not a number", "invalid_request_error") from None
            if n > lim:
                raise ApiError(413, f"the request body is {n} bytes; the limit is {lim}", "invalid_request_error",
                               code="body_too_large")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > lim:
                raise ApiError(413, f"the request body exceeds the limit of {lim} bytes", "invalid_request_error",
                               code="body_too_large")
        if not buf:
            raise ApiError(400, "the request body is empty; send a JSON object", "invalid_request_error")
        try:
            return json.loads(bytes(buf))
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_request_error",
                           code="invalid_json") from None

    async def _conversation(self, client: EngineClient, request: Request, system: str | None,
                            title: str, history: list[tuple[str, str]] = (), model: str = "") -> tuple[str, bool]:
        """(conversation id, created) for a request: the header's, or a new one holding
        ``history`` (the request's earlier turns) as finished messages."""
        hdr = request.headers.get("x-aotx-conversation")
        if hdr:
            if not _CONV_ID.match(hdr):
                raise ApiError(400, f"X-AOTX-Conversation {hdr[:80]!r} is not a conversation id",
                               "invalid_request_error", param="X-AOTX-Conversation")
            try:
                view = await client.show(hdr)
            except ConnectionLost as e:
                raise ApiError(503, f"the engine went away: {e}", "server_error", code="engine_unavailable",
                               headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
            except EngineError as e:
                code = e.code  # the engine's error code (the client library sets it)
                if code != ErrorCode.NOT_FOUND:
                    raise _engine_error(P.Error(id=0, code=code, message=str(e)), None,
                                        self.cfg.retry_after_s) from None
                raise ApiError(404, f"X-AOTX-Conversation: {e}", "not_found_error",
                               param="X-AOTX-Conversation", code="conversation_not_found") from None
            if system is not None and system != (view.system_prompt or ""):
                try:
                    await client.update(hdr, system_prompt=system)
                except EngineError as e:
                    raise _engine_error(P.Error(id=0, code=e.code, message=str(e)), None,
                                        self.cfg.retry_after_s) from None
            return hdr, False
        try:
            conv = await client.create_conversation(title=" ".join(title.split())[:60], system_prompt=system,
                                                    messages=list(history), model=model)
        except ConnectionLost as e:
            raise ApiError(503, f"the engine went away: {e}", "server_error", code="engine_unavailable",
                           headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
        return conv.conv_id, True

    # -- endpoints --

    async def health(self, request: Request) -> Response:
        try:
            client = await self.link.get()
            st = await client.status()
        except (ApiError, AotxError, OSError) as e:
            msg = e.body["error"]["message"] if isinstance(e, ApiError) else str(e)
            return JSONResponse({"status": "unavailable", "message": msg}, status_code=503,
                                headers={"Retry-After": str(self.cfg.retry_after_s)})
        status = "loading" if not st.ready else "degraded" if st.degraded else "ok"
        body = {"status": status, "model": st.model, "device": st.device,
                "ready": st.ready, "context": st.n_ctx, "slots": len(st.slots), "queue": st.queue,
                "in_flight": self.inflight.total}
        if st.degraded:  # the journal's disk is full: new work is held until space returns
            body["degraded"] = st.degraded
        if st.notices:
            body["notices"] = st.notices
        return JSONResponse(body, status_code=200 if status == "ok" else 503,
                            headers={} if status == "ok" else {"Retry-After": str(self.cfg.retry_after_s)})

    async def _models(self) -> list[P.ModelInfo]:
        """The engine's models (installed and loaded), asked at most once a second."""
        now = time.monotonic()
        if self._model_cache is not None and now - self._model_cache[0] < MODEL_LIST_TTL_S:
            return self._model_cache[1]
        client = await self.link.get()
        try:
            models = (await client.list_models()).models
        except AotxError as e:
            raise ApiError(503, f"the engine did not list its models: {e}", "server_error",
                           code="engine_unavailable", headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
        self._model_cache = (now, models)
        return models

    async def route(self, name: str | None) -> str:
        """The engine model a request's ``model`` names ("" the default): an installed or
        loaded model by name (``NAME.gguf`` and case aside); a name that matches none
        (clients send placeholders such as ``gpt-4o``) runs on the default model, as a
        single-model server would, and the reply's ``model`` says which one it was."""
        if not name:
            return ""
        models = await self._models()
        names = {m.name for m in models if not m.error}
        if name in names:
            return name
        low = {n.lower(): n for n in names}
        return low.get(name.lower().removesuffix(".gguf"), "")

    def _model_obj(self, m: P.ModelInfo) -> dict[str, Any]:
        return {"id": m.name, "object": "model", "created": 0, "owned_by": "aotx" if m.kind == "gguf" else "remote",
                "aotx": {"loaded": m.loaded, "default": m.default, "kind": m.kind, "arch": m.arch, "quant": m.quant,
                         "context": m.n_ctx_train, "size_bytes": m.size_bytes, "needs_bytes": m.needs_bytes}}

    async def models(self, request: Request) -> Response:
        """Every installed model (files, remote endpoints) and every loaded one, default first."""
        self._auth(request)
        models = sorted((m for m in await self._models() if not m.error), key=lambda m: not m.default)
        return JSONResponse({"object": "list", "data": [self._model_obj(m) for m in models]})

    async def model(self, request: Request) -> Response:
        self._auth(request)
        name = request.path_params["name"]
        models = [m for m in await self._models() if not m.error]
        for m in models:
            if m.name == name:
                return JSONResponse(self._model_obj(m))
        raise ApiError(404, f"the model {name!r} does not exist; this server has "
                            f"{', '.join(m.name for m in models) or 'none'}",
                       "invalid_request_error", param="model", code="model_not_found")

    async def chat(self, request: Request) -> Response:
        key = self._auth(request)
        req = S.parse_chat(await self._json(request), self.cfg.limits)
        return await self._generate(request, key, chat=True, system=req.system, title=req.messages[-1][1],
                                    turns=req.messages, sampling=req.sampling, stream=req.stream,
                                    include_usage=req.include_usage, model=req.model)

    async def completions(self, request: Request) -> Response:
        key = self._auth(request)
        req = S.parse_completion(await self._json(request), self.cfg.limits)
        return await self._generate(request, key, chat=False, system=None, title=req.prompt,
                                    turns=[("user", req.prompt)], sampling=req.sampling, stream=req.stream,
                                    include_usage=req.include_usage, model=req.model)

    async def _generate(self, request: Request, key: str, *, chat: bool, system: str | None, title: str,
                        turns: list[tuple[str, str]], sampling: P.SamplingParams, stream: bool,
                        include_usage: bool, model: str | None = None) -> Response:
        self.inflight.enter(key)
        handed_over = False
        gen: Generation | None = None
        try:
            client = await self.link.get()
            target = await self.route(model)
            conv_id, created = await self._conversation(client, request, system, title,
                                                        history=turns[:-1] if chat else [], model=target)
            text = turns[-1][1]
            gen = Generation(client, conv_id, created, self.cfg)
            await _race_disconnect(request, gen.start(text, sampling, raw=not chat, model=target))
            self._model_cache = None  # it may have loaded a model
            reply = S.Reply(id=S.new_id("chatcmpl" if chat else "cmpl"), model=target or self.link.model)
            headers = {"X-AOTX-Conversation": conv_id}
            if stream:
                body = self._stream_body(gen, reply, chat, include_usage)

                async def on_close(gone: bool) -> None:
                    if gone:
                        await gen.abandon()
                    self.inflight.leave(key)

                handed_over = True
                return EventStream(body, headers, on_close)
            await _race_disconnect(request, self._collect(gen, reply))
            headers["X-AOTX-Receipt"] = json.dumps(reply.aotx["receipt"], separators=(",", ":"))
            return JSONResponse(S.chat_completion(reply) if chat else S.text_completion(reply), headers=headers)
        except _ClientGone:
            if gen is not None:
                await gen.abandon()
            return Response(status_code=499)
        except asyncio.CancelledError:  # the server is shutting down under this request
            if gen is not None:
                await gen.abandon()
            raise
        finally:
            if not handed_over:
                self.inflight.leave(key)

    async def _collect(self, gen: Generation, reply: S.Reply) -> None:
        async for ev in gen.events():
            if isinstance(ev, P.Committed):
                reply.text = ev.text
                reply.finish_reason = ev.finish_reason
                reply.n_prompt, reply.n_completion = ev.n_prompt, ev.n_completion
            elif isinstance(ev, P.Error):
                raise _engine_error(ev, None, self.cfg.retry_after_s)
        if gen.committed is None:
            raise ApiError(502, "the engine ended the reply without finishing it", "server_error")
        if gen.committed.finish_reason == "error":
            raise ApiError(500, "the engine failed while generating this reply", "server_error",
                           code="generation_failed", aotx=gen.aotx())
        reply.aotx = gen.aotx()

    async def _stream_body(self, gen: Generation, reply: S.Reply, chat: bool,
                           include_usage: bool) -> AsyncIterator[bytes]:
        sent = ""
        if chat:
            yield _sse(S.chat_chunk(reply, {"role": "assistant", "content": ""}))
        try:
            async for ev in gen.events():
                if isinstance(ev, P.Token) and ev.text:
                    sent += ev.text
                    yield _sse(S.chat_chunk(reply, {"content": ev.text}) if chat else S.text_chunk(reply, ev.text))
                elif isinstance(ev, P.Committed):
                    rest = ev.text[len(sent):] if ev.text.startswith(sent) else ""
                    if rest:
                        yield _sse(S.chat_chunk(reply, {"content": rest}) if chat else S.text_chunk(reply, rest))
                    reply.text = ev.text
                    reply.finish_reason = ev.finish_reason
                    reply.n_prompt, reply.n_completion = ev.n_prompt, ev.n_completion
                    if ev.finish_reason == "error":
                        yield _sse(S.error_body("the engine failed while generating this reply", "server_error",
                                                code="generation_failed"))
                        yield b"data: [DONE]\n\n"
                        return
                    yield _sse(S.chat_chunk(reply, {}, ev.finish_reason) if chat
                               else S.text_chunk(reply, "", ev.finish_reason))
                    if include_usage:
                        yield _sse(S.usage_chunk(reply, chat))
                elif isinstance(ev, P.Error):
                    e = _engine_error(ev, None, self.cfg.retry_after_s)
                    yield _sse(e.body)
                    yield b"data: [DONE]\n\n"
                    return
        except ApiError as e:
            yield _sse(e.body)
            yield b"data: [DONE]\n\n"
            return
        reply.aotx = gen.aotx()
        yield _sse(S.receipt_event(reply, chat), event="aotx.receipt")
        yield b"data: [DONE]\n\n"


def create_app(cfg: GatewayConfig, keys: KeyRing, link: EngineLink, *, connect_at_start: bool = True) -> Starlette:
    """The ASGI application. With ``connect_at_start`` its lifespan opens the engine
    connection (a failure there is logged; requests answer 503 until it works)."""
    gw = Gateway(cfg, keys, link)

    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    async def bad_request(request: Request, exc: S.BadRequest) -> Response:
        return JSONResponse(S.error_body(exc.message, "invalid_request_error", exc.param, exc.code), status_code=400)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(S.error_body(f"{request.method} {request.url.path}: {exc.detail}", type_),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def internal(request: Request, exc: Exception) -> Response:
        print(f"aotx gateway: internal error on {request.method} {request.url.path}: {exc!r}", file=sys.stderr)
        return JSONResponse(S.error_body("internal error in the gateway", "server_error"), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if connect_at_start:
            try:
                await link.get()
            except ApiError as e:
                print(f"aotx gateway: {e}", file=sys.stderr)
        yield
        await link.close()

    routes = [
        Route("/health", gw.health, methods=["GET"]),
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/models/{name:path}", gw.model, methods=["GET"]),
        Route("/v1/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: api_error, S.BadRequest: bad_request, HTTPException: http_error,
                                        Exception: internal})
    app.state.gateway = gw
    return app


# ---- the command ------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket. Raises UsageError naming the address when it cannot."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
    except OSError as e:
        s.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port") from None
    s.listen(128)
    s.setblocking(False)
    return s


def uvicorn_server(app: Starlette, max_connections: int = GatewayConfig.max_connections):
    """The uvicorn server of ``app``: past ``max_connections`` concurrent connections
    a new request is answered 503 at once (uvicorn's ``limit_concurrency``)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", server_header=False,
                            timeout_keep_alive=5, timeout_graceful_shutdown=5, limit_concurrency=max_connections)
    return uvicorn.Server(config)


ACCEPT_LOG_INTERVAL_S = 10.0


def quiet_accept_errors(interval_s: float = ACCEPT_LOG_INTERVAL_S) -> Callable[[Any, dict], None]:
    """An asyncio exception handler that turns the traceback asyncio logs for every
    failed accept (out of file descriptors: EMFILE) into one line per ``interval_s``
    with a count; every other error goes to the default handler."""
    state = {"n": 0, "last": -1e9}

    def handler(loop: Any, context: dict) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        state["n"] += 1
        now = time.monotonic()
        if now - state["last"] >= interval_s:
            exc = context.get("exception")
            print(f"aotx gateway: cannot accept connections: {getattr(exc, 'strerror', None) or exc} "
                  f"({state['n']} time(s) since the last report); retrying", file=sys.stderr)
            state["n"], state["last"] = 0, now

    return handler


def run_gateway(args, connect: Callable[[], Awaitable[Any]]) -> int:
    """``aotx gateway``: load or create the keys, connect the engine, serve HTTP.

    ``connect()`` opens an ``EngineClient`` (the CLI's: it finds or starts the engine
    that ``args`` describe) and is called again after the engine goes away."""
    from aotx.engine.ipc import gateway_auth

    host, port = args.host, args.port
    if not is_loopback(host) and not args.api_key_file:
        raise UsageError(f"--host {host} is not a loopback address: pass --api-key-file with the keys that may "
                         f"use it (a key file generated for loopback use is not taken implicitly)")
    keys, path, created = gateway_auth.load_or_create(args.api_key_file)
    if created:
        print(f"aotx gateway: generated an API key in {path} (mode 0600); send it as 'Authorization: Bearer <key>'",
              file=sys.stderr)
    else:
        print(f"aotx gateway: {len(keys)} API key(s) from {path}", file=sys.stderr)
    raise_fd_limit()  # so the connection limit, not the descriptor limit, is what clients meet
    sock = listen_socket(host, port)
    cfg = GatewayConfig(
        limits=S.Limits(max_tokens_ceiling=args.max_tokens_ceiling),
        per_key_concurrency=args.per_key_concurrency, max_queue=args.max_queue)

    async def main() -> int:
        asyncio.get_running_loop().set_exception_handler(quiet_accept_errors())
        link = EngineLink(connect, cfg.retry_after_s)
        await link.get()  # start or find the engine before taking requests
        app = create_app(cfg, KeyRing(keys), link)
        server = uvicorn_server(app, cfg.max_connections)
        shown = f"[{host}]" if ":" in host else host
        print(f"aotx gateway: serving model {link.model} at http://{shown}:{sock.getsockname()[1]}/v1 "
              f"(engine socket {(await link.get()).socket_path})", file=sys.stderr)
        await server.serve(sockets=[sock])
        return 0

    try:
        return asyncio.run(main())
    except ApiError as e:
        raise EngineError(e.body["error"]["message"]) from None
