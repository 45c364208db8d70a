"""``aotx gateway``: an OpenAI-compatible HTTP API in front of the engine.

Owns: the HTTP side (Starlette on uvicorn), bearer-key authentication, limits
against abuse, and the mapping between OpenAI requests and engine
conversations: a request continues the conversation named by its
``X-AOTX-Conversation`` header or creates one (the system message becomes its
system prompt), submits the last user message, and answers in OpenAI's shapes
(``gateway_schema.py``) with the durable receipt of the reply: the
``X-AOTX-Receipt`` header (JSON) and an ``aotx`` body field when not streaming,
an SSE comment line ``: aotx.receipt {json}`` just before ``data: [DONE]`` when
streaming (and the ``aotx`` field of the usage chunk when one is asked for). Every response names its conversation in ``X-AOTX-Conversation``.
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
them as real turns. A request naming a conversation but ending with several ``tool``
messages (a parallel call's results: a turn takes one message) gets a new conversation
holding its whole history, named in ``X-AOTX-Conversation``. Frequency/presence penalties are accepted but not applied.
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

import msgspec
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aotx.engine.errors import AotxError, EngineError, ErrorCode, UsageError, close_matches
from aotx.engine.gateway import media as M
from aotx.engine.gateway import schema as S
from aotx.engine import protocol as P
from aotx.engine.ipc.client import ConnectionLost, EngineClient
from aotx.engine.gateway.auth import KeyRing
from aotx.engine.model import tool_calls
from aotx.engine.ipc.server import raise_fd_limit
from aotx.engine.units import short_title

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


def _tool_run(turns: list[S.Turn]) -> int:
    """How many ``tool`` messages end ``turns`` (the results of one parallel call)."""
    n = 0
    for t in reversed(turns):
        if t.role != "tool":
            break
        n += 1
    return n


def call_id_prefix(reply_id: str) -> str:
    return f"call_{reply_id}_"


def _too_large(head: bytes, what: str) -> ApiError:
    """413 for a body over the limit, naming the field that was still open at the cut
    (a data URL, mostly) when the first bytes show one."""
    where = M.open_field(head)
    if where:
        what = f"{where}: {what} (a media part may hold at most {M.MAX_PART_BYTES:,} bytes)"
    return ApiError(413, what, "invalid_request_error", param=where.split("[")[0].split(".")[0] if where else None,
                    code="body_too_large")

DEFAULT_ALIAS = "local"  # a request's ``model`` that means the engine's default model (Gateway.route)
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
        self.tool_format = "hermes"  # the model's tool-call family (Welcome.tool_format)

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
            self.tool_format = c.welcome.tool_format or "hermes"
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

Spec = S.Spec

class Generation:
    """One message submitted to the engine and the events of its ``n`` choices.

    ``start`` reads events up to every choice's ``Accepted`` (so refusals become HTTP
    statuses before a response starts); ``events`` yields the rest and stops once every
    choice has its final receipt, or ``durable_timeout_s`` after the last ``Committed``."""

    def __init__(self, client: EngineClient, conv_id: str, created: bool, cfg: GatewayConfig, n: int = 1):
        self.client = client
        self.conv_id = conv_id
        self.created = created
        self.cfg = cfg
        self.n = n
        self.accepted: dict[int, P.Accepted] = {}
        self.committed: dict[int, P.Committed] = {}
        self.receipts: dict[int, P.Receipt] = {}
        self.user_receipt: P.Receipt | None = None
        self._agen: AsyncIterator[P.Message] | None = None
        self._done = False
        self.constraint_field = ""
        self.model = ""  # the engine model it runs on ("" the default)
        self.cuts: list[P.ContextCut] = []  # where the prompt left earlier messages out (context notices)
        self.family: str | None = None  # its model's tool-call format (None: no tools)

    # one-choice views (the first choice)
    @property
    def receipt(self) -> P.Receipt | None:
        return self.receipts.get(0)

    @property
    def all_committed(self) -> bool:
        return len(self.committed) >= self.n

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

    async def start(self, text: str, sampling: P.SamplingParams, raw: bool, model: str = "", **fields) -> None:
        """Submit (on ``model``; "" the conversation's); return once every choice is
        accepted. Raises ApiError for a refusal."""
        c = fields.get("constraint")
        self.constraint_field = c.field if c is not None else ""
        self._agen = self.client.submit(self.conv_id, text, sampling=sampling, raw=raw, model=model, **fields)
        refused: P.Notice | None = None
        while True:
            ev = await self._next()
            if ev is None:
                raise ApiError(502, "the engine ended the request without accepting it", "server_error")
            if isinstance(ev, P.Notice):
                if ev.kind == "refused":
                    refused = ev
                elif ev.cut is not None and ev.choice == 0:
                    self.cuts.append(ev.cut)
            elif isinstance(ev, P.Error):
                self._done = True
                if self.created:
                    await self._forget()
                raise _engine_error(ev, refused, self.cfg.retry_after_s, self.constraint_field)
            elif isinstance(ev, P.Accepted):
                self.accepted[ev.choice] = ev
                if len(self.accepted) >= self.n:
                    return
            elif isinstance(ev, P.Durable) and ev.msg_id and ev.choice == 0:
                self.user_receipt = ev.receipt

    async def events(self) -> AsyncIterator[P.Message]:
        while not self._done:
            if self.all_committed:
                try:
                    ev = await asyncio.wait_for(self._next(), self.cfg.durable_timeout_s)
                except asyncio.TimeoutError:
                    self._done = True
                    return
            else:
                ev = await self._next()
            if ev is None:
                return
            if isinstance(ev, P.Accepted):
                self.accepted[ev.choice] = ev
            elif isinstance(ev, P.Notice) and ev.cut is not None and ev.choice == 0:
                self.cuts.append(ev.cut)
            elif isinstance(ev, P.Committed):
                self.committed[ev.choice] = ev
            elif isinstance(ev, P.Durable):
                a = self.accepted.get(0)
                if a is not None and ev.msg_id == a.msg_id:
                    self.user_receipt = ev.receipt
                for ch, cm in self.committed.items():
                    if ev.receipt.last_seq >= cm.seq and (ev.choice == ch or ev.choice == 0):
                        self.receipts.setdefault(ch, ev.receipt)
            elif isinstance(ev, P.Error):
                self._done = True
            yield ev

    def aotx(self, choice: int = 0) -> dict[str, Any]:
        """The ``aotx`` object of a reply's choice: conversation, message ids, receipts, and
        ``context``: where its prompt left earlier messages out (the engine's cuts), if it did."""
        a = self.accepted.get(choice)
        return {"conversation": a.conv_id if a else self.conv_id, "msg_id": a.msg_id if a else None,
                "reply_id": a.reply_id if a else None, "receipt": S.receipt_dict(self.receipts.get(choice)),
                "user_receipt": S.receipt_dict(self.user_receipt),
                **({"context": [msgspec.to_builtins(c) for c in self.cuts]} if self.cuts and choice == 0 else {})}

    async def abandon(self) -> None:
        """The client went away: cancel the generation unless it finished. The
        cancel is sent without waiting for the engine's answer (it comes after
        the current tick), so the HTTP side is released at once."""
        if not self.all_committed:
            a = self.accepted.get(0)
            if a is not None:
                op = self.client.cancel(target=a.id)
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

    def stop(self, choice: int) -> None:
        """End a choice's generation early (its tool calls are complete): a cancel sent
        without waiting; the engine commits what it has. Only for one choice per request
        (a cancel stops every choice of its request)."""
        a = self.accepted.get(choice)
        if a is None or self.n != 1 or choice in self.committed:
            return
        task = asyncio.ensure_future(self.client.cancel(target=a.id))
        _background.add(task)
        task.add_done_callback(_settle)

    async def _forget(self) -> None:
        try:
            await self.client.delete(self.conv_id)
        except (AotxError, OSError):
            pass


@dataclass
class Out:
    """One piece of a choice's stream, as every API renders it: ``kind`` "content"
    (``text``), "call" (a tool-call delta: ``call`` = (index, id or None, name or None,
    arguments text)), "logprob" (``entry``: a chat logprobs entry) or "finish"."""

    kind: str
    choice: int
    text: str = ""
    call: tuple | None = None
    entry: dict[str, Any] | None = None


class ChoiceState:
    """One choice's text, tool calls and logprobs as its events arrive; ``token`` and
    ``committed`` return the ``Out`` pieces to send (the tool-call parser of the model's
    family splits content from calls as the text streams)."""

    def __init__(self, index: int, family: str | None, logprobs: bool, call_prefix: str = "",
                 on_complete: Callable[[], None] | None = None):
        self.index = index
        # called once when the parser finds the reply's calls complete and the model
        # repeating them (``StreamParser.complete``): the generation may be stopped
        self.on_complete = on_complete
        self._stopped = False
        self.parser = tool_calls.StreamParser(family, call_prefix) if family else None
        self.sent = ""
        self.logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self.choice = S.Choice(index=index, logprobs=self.logprobs)
        self._calls: dict[int, dict[str, Any]] = {}
        self.content = ""

    def _text(self, t: str) -> list[Out]:
        if not t:
            return []
        if self.parser is None:
            self.content += t
            return [Out("content", self.index, text=t)]
        out = self._delta(self.parser.feed(t))
        if self.parser.complete and not self._stopped:
            self._stopped = True
            if self.on_complete is not None:
                self.on_complete()
        return out

    def _delta(self, d) -> list[Out]:
        out = []
        if d.content:
            self.content += d.content
            out.append(Out("content", self.index, text=d.content))
        for call in d.calls:
            i, cid, name, args = call
            c = self._calls.get(i)
            if c is None:
                c = self._calls[i] = {"index": i, "id": cid, "type": "function", "function": {"name": name,
                                                                                            "arguments": ""}}
            c["function"]["arguments"] += args
            out.append(Out("call", self.index, call=call))
        return out

    def token(self, ev: P.Token) -> list[Out]:
        out = []
        # the end-of-generation token is no token of the content: OpenAI's logprobs list only
        # the returned text's tokens
        if self.logprobs is not None and ev.logprob is not None and not ev.end:
            e = S.logprob_entry(ev.piece, ev.logprob, ev.top)
            self.logprobs.append(e)
            out.append(Out("logprob", self.index, entry=e))
        self.sent += ev.text
        return out + self._text(ev.text)

    def committed(self, ev: P.Committed) -> list[Out]:
        rest = ev.text[len(self.sent):] if ev.text.startswith(self.sent) else ""
        self.sent = ev.text
        out = self._text(rest)
        if self.parser is not None:
            out += self._delta(self.parser.finish())
        ch = self.choice
        ch.text = self.content if self.parser is not None else ev.text
        ch.tool_calls = [{k: v for k, v in c.items() if k != "index"} for _, c in sorted(self._calls.items())]
        # calls complete and then repeated: the reply ended at its calls, whether the
        # stop came first (cancelled) or max_tokens did
        ch.finish_reason = "tool_calls" if self.parser is not None and self.parser.complete and ch.tool_calls \
            else ev.finish_reason
        ch.n_completion = ev.n_completion
        ch.stop_sequence = ev.stop
        out.append(Out("finish", self.index, text=ch.finish))
        return out


_background: set[asyncio.Future] = set()


def _settle(task: asyncio.Future) -> None:
    _background.discard(task)
    if not task.cancelled():
        task.exception()  # a lost engine or a finished request: nothing to do


def _engine_error(ev: P.Error, refused: P.Notice | None, retry_after_s: int, constraint_field: str = "") -> ApiError:
    retry = {"Retry-After": str(retry_after_s)}
    if ev.code == ErrorCode.BAD_REQUEST and constraint_field and ev.message.startswith(constraint_field + ":"):
        return ApiError(400, ev.message, "invalid_request_error", param=constraint_field.split(".")[0],
                        code="invalid_grammar")
    if ev.code == ErrorCode.UNSUPPORTED_MEDIA:
        return ApiError(400, ev.message, "invalid_request_error", param="messages", code="invalid_media")
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


def _sse_comment(name: str, obj: Any) -> bytes:
    """An SSE comment line ``: NAME {json}`` (one line: JSON has no raw newlines)."""
    return f": {name} ".encode() + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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

    api_error = ApiError  # for the API modules (gateway_responses, gateway_anthropic)

    def engine_error(self, ev: P.Error) -> ApiError:
        return _engine_error(ev, None, self.cfg.retry_after_s)

    def __init__(self, cfg: GatewayConfig, keys: KeyRing, link: EngineLink):
        self.cfg = cfg
        self.keys = keys
        self.link = link
        self.inflight = InFlight(cfg)
        self._model_cache: tuple[float, list[P.ModelInfo]] | None = None

    # -- auth and body --

    def _auth(self, request: Request) -> str:
        auth = request.headers.get("authorization")
        if auth is None and request.headers.get("x-api-key"):  # Anthropic's clients send the key so
            auth = "Bearer " + request.headers["x-api-key"]
        fp = self.keys.check(auth)
        if fp is None:
            given = "authorization" in request.headers or "x-api-key" in request.headers
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
                head = bytearray()
                async for chunk in request.stream():  # read up to the limit only, to name the field
                    head += chunk
                    if len(head) > lim:
                        break
                raise _too_large(bytes(head[:lim]), f"the request body is {n:,} bytes; the limit is {lim:,}")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > lim:
                raise _too_large(bytes(buf[:lim]), f"the request body exceeds the limit of {lim:,} bytes")
        if not buf:
            raise ApiError(400, "the request body is empty; send a JSON object", "invalid_request_error")
        try:
            return json.loads(bytes(buf))
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_request_error",
                           code="invalid_json") from None

    async def _conversation(self, client: EngineClient, request: Request, system: str | None,
                            title: str, history: list[S.Turn] = (), conv_id: str | None = None,
                            model: str = "", last: S.Turn | None = None, context: str = "") -> tuple[str, bool]:
        """(conversation id, created) for a request: ``conv_id`` (a response continued),
        the header's, or a new one on ``model`` holding ``history`` (the request's earlier
        turns) as finished messages. A request naming a conversation whose messages end
        with several tool results (the answers to a parallel call, ``last`` the final one)
        gets a new conversation too: a turn takes one message, and the others would be lost."""
        hdr = conv_id or request.headers.get("x-aotx-conversation")
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
            if not conv_id and _tool_run(list(history) + ([last] if last is not None else [])) > 1:
                hdr = None  # several new tool results: a new conversation with the request's history
                system = system if system is not None else view.system_prompt
                model = model or view.model
        if hdr:
            if system is not None and system != (view.system_prompt or ""):
                try:
                    await client.update(hdr, system_prompt=system)
                except EngineError as e:
                    raise _engine_error(P.Error(id=0, code=e.code, message=str(e)), None,
                                        self.cfg.retry_after_s) from None
            if context and context != view.context:   # the request's context_policy, from this turn on
                try:
                    await client.set_context(hdr, context)
                except EngineError as e:
                    raise _engine_error(P.Error(id=0, code=e.code, message=str(e)), None,
                                        self.cfg.retry_after_s) from None
            return hdr, False
        try:
            conv = await client.create_conversation(title=short_title(title), system_prompt=system,
                                                    messages=[(t.role, t.text, t.meta) for t in history],
                                                    model=model, context=context)
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
        loaded model by name (an id of ``/v1/models``; ``NAME.gguf`` and case aside), or
        ``DEFAULT_ALIAS`` ("local") for the engine's default. Any other name is answered
        as OpenAI and vLLM do: 404 ``model_not_found``, naming the close ones."""
        if not name or name.lower() == DEFAULT_ALIAS:
            return ""
        models = await self._models()
        names = [m.name for m in models if not m.error]
        if name in names:
            return name
        low = {n.lower(): n for n in names}
        hit = low.get(name.lower().removesuffix(".gguf"))
        if hit:
            return hit
        near = close_matches(name[:200], names)
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        shown = name if len(name) <= 80 else f"{name[:80]}... ({len(name):,} characters)"
        raise ApiError(404, f"the model {shown!r} does not exist{hint}; this server has "
                            f"{', '.join(names) or 'none'} (GET /v1/models lists them; {DEFAULT_ALIAS!r} is "
                            f"the default one)", "invalid_request_error", param="model", code="model_not_found")

    def _model_obj(self, m: P.ModelInfo) -> dict[str, Any]:
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

    async def models(self, request: Request) -> Response:
        """Every installed model (files, remote endpoints) and every loaded one, default first."""
        self._auth(request)
        models = sorted((m for m in await self._models() if not m.error), key=lambda m: not m.default)
        return JSONResponse({"object": "list", "data": [self._model_obj(m) for m in models]})

    async def model(self, request: Request) -> Response:
        self._auth(request)
        # the names a request's ``model`` takes (route: case, ``.gguf``, "local"), 404 for others
        found = await self.route(request.path_params["name"])
        models = [m for m in await self._models() if not m.error]
        for m in models:
            if (m.name == found) if found else m.default:
                return JSONResponse(self._model_obj(m))
        raise ApiError(404, f"the model {request.path_params['name'][:80]!r} is not available", "invalid_request_error",
                       param="model", code="model_not_found")

    async def chat(self, request: Request) -> Response:
        key = self._auth(request)
        req = S.parse_chat(await self._json(request), self.cfg.limits, self.keys.file_roots(key))
        spec = Spec(chat=True, system=req.system, history=req.messages[:-1], last=req.messages[-1],
                    sampling=req.sampling, stream=req.stream, include_usage=req.include_usage, tools=req.tools,
                    constraint=req.constraint, logprobs=req.logprobs, n=req.n, title=req.messages[-1].text,
                    model=req.model, context=req.context)
        return await self.generate(request, key, spec, CHAT)

    async def completions(self, request: Request) -> Response:
        key = self._auth(request)
        req = S.parse_completion(await self._json(request), self.cfg.limits)
        spec = Spec(chat=False, system=None, history=[], last=S.Turn("user", req.prompt), sampling=req.sampling,
                    stream=req.stream, include_usage=req.include_usage, constraint=req.constraint,
                    logprobs=req.logprobs, n=req.n, title=req.prompt, model=req.model)
        return await self.generate(request, key, spec, COMPLETION)

    # -- the generation every endpoint runs --

    async def tool_format(self, client: EngineClient, model: str) -> str:
        """The tool-call family of ``model`` ("" the engine's default): its chat template's,
        as the engine lists it once the model is loaded (it is loaded here when it is not:
        the grammar of a forced call is made before the message goes in)."""
        if not model:
            return self.link.tool_format or "hermes"
        for attempt in (0, 1):
            info = next((m for m in await self._models() if m.name == model), None)
            if info is not None and info.loaded:
                return info.tool_format or "hermes"
            if attempt or info is None or info.kind != "gguf":
                break
            try:
                await client.load_model(model)
            except AotxError:  # the submit meets (and reports) the same refusal
                break
            self._model_cache = None
        return "hermes"

    async def _attachments(self, parts: tuple[M.MediaPart, ...]) -> list[P.Attachment]:
        out = []
        for part in parts:
            try:
                out.append(await asyncio.to_thread(M.attach, part))
            except M.MediaRefusal as e:
                raise ApiError(e.status, e.message, "invalid_request_error", param="messages",
                               code="invalid_media" if e.status == 400 else "media_too_large") from None
            except OSError as e:
                raise ApiError(500, f"{part.where}: could not store the part ({e.strerror})", "server_error") from None
        return out

    async def begin(self, request: Request, spec: Spec) -> Generation:
        """Find or make the conversation, store the media parts, submit; returns once
        every choice is accepted (raises ApiError for a refusal)."""
        client = await self.link.get()
        target = await self.route(spec.model)
        conv_id, created = await self._conversation(client, request, spec.system, spec.title or spec.last.text,
                                                    history=spec.history if spec.chat else [],
                                                    conv_id=spec.conversation, model=target,
                                                    last=spec.last if spec.chat else None, context=spec.context)
        atts = await self._attachments(spec.last.parts)
        constraint = spec.constraint
        family = await self.tool_format(client, target) if spec.tools.active else None
        if spec.tools.forced:
            grammar = tool_calls.call_grammar(spec.tools.tools, family,
                                              name=spec.tools.name if spec.tools.choice == "function" else None,
                                              parallel=spec.tools.parallel)
            constraint = P.Constraint(kind="lark", grammar=grammar, field="tool_choice")
        fields: dict[str, Any] = {"n": spec.n, "logprobs": spec.logprobs}
        if spec.chat:
            fields.update(role=spec.last.role, meta=spec.last.meta, tools=spec.tools.tools if spec.tools.active else [])
            if spec.prefill:
                fields["prefill"] = spec.prefill
        if constraint is not None:
            fields["constraint"] = constraint
        if atts:
            fields["attachments"] = atts
        gen = Generation(client, conv_id, created, self.cfg, n=spec.n)
        gen.model, gen.family = target, family
        after = {"after": spec.after} if spec.after and not created else {}
        try:
            await _race_disconnect(request, gen.start(spec.last.text, spec.sampling, raw=not spec.chat,
                                                      model=target, **after, **fields))
        except ApiError as e:
            if not after or e.status != 409:
                raise
            # another turn came after the message this one continues (a concurrent continuation
            # of the same response): this one branches from it in a fork of its own
            try:
                fork = await client.fork(conv_id, at_msg_id=spec.after)
            except ConnectionLost as lost:
                raise ApiError(503, f"the engine went away: {lost}", "server_error", code="engine_unavailable",
                               headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
            gen = Generation(client, fork.conv_id, True, self.cfg, n=spec.n)
            gen.model, gen.family = target, family
            await _race_disconnect(request, gen.start(spec.last.text, spec.sampling, raw=not spec.chat,
                                                      model=target, **fields))
        self._model_cache = None  # it may have loaded a model
        return gen

    def states(self, spec: Spec, gen: Generation) -> list[ChoiceState]:
        """One state per choice; tool calls are named after their reply (``call_<reply id>_<i>``),
        so a call id stays meaningful after a restart (the Responses API checks them)."""
        fam = gen.family
        return [ChoiceState(i, fam, spec.logprobs >= 0, call_id_prefix(gen.accepted[i].reply_id)
                            if i in gen.accepted else "", on_complete=lambda i=i: gen.stop(i))
                for i in range(spec.n)]

    async def collect(self, gen: Generation, reply: S.Reply, states: list[ChoiceState]) -> None:
        """Read the whole generation into ``reply`` (every choice). Raises ApiError."""
        async for ev in gen.events():
            if isinstance(ev, P.Token):
                states[ev.choice].token(ev)
            elif isinstance(ev, P.Committed):
                states[ev.choice].committed(ev)
                if ev.choice == 0:
                    reply.n_prompt = ev.n_prompt
                    reply.n_cached = int(ev.timings.get("prompt_tokens_reused", 0))
            elif isinstance(ev, P.Error):
                raise _engine_error(ev, None, self.cfg.retry_after_s)
        if not gen.all_committed:
            raise ApiError(502, "the engine ended the reply without finishing it", "server_error")
        self._finish_reply(gen, reply, states)
        if any(c.finish_reason == "error" for c in gen.committed.values()):
            raise ApiError(500, "the engine failed while generating this reply", "server_error",
                           code="generation_failed", aotx=gen.aotx())

    @staticmethod
    def _finish_reply(gen: Generation, reply: S.Reply, states: list[ChoiceState]) -> None:
        reply.choices = [st.choice for st in states]
        for st in states:
            st.choice.aotx = gen.aotx(st.index)
        reply.aotx = gen.aotx(0)
        if len(states) > 1:
            reply.aotx["choices"] = [gen.aotx(st.index) for st in states]

    async def generate(self, request: Request, key: str, spec: Spec, api: Any) -> Response:
        """Run ``spec`` and answer in ``api``'s shapes (``CHAT``, ``COMPLETION``, or the
        Responses and Messages renderers): JSON, or server-sent events when streaming."""
        self.inflight.enter(key)
        handed_over = False
        gen: Generation | None = None
        try:
            gen = await self.begin(request, spec)
            reply = S.Reply(id=api.new_id(), model=gen.model or self.link.model)
            headers = {"X-AOTX-Conversation": gen.conv_id}
            states = self.states(spec, gen)
            if spec.stream:
                body = api.stream(self, gen, reply, spec, states)

                async def on_close(gone: bool) -> None:
                    if gone:
                        await gen.abandon()
                    self.inflight.leave(key)

                handed_over = True
                return EventStream(body, headers, on_close)
            try:
                await _race_disconnect(request, self.collect(gen, reply, states))
            except ApiError as e:
                return api.error(e)
            headers["X-AOTX-Receipt"] = json.dumps(reply.aotx["receipt"], separators=(",", ":"))
            return JSONResponse(await api.final(self, gen, reply, spec), headers=headers)
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


class _OpenAI:
    """Chat completions and (legacy) completions in OpenAI's shapes."""

    def __init__(self, chat: bool):
        self.chat = chat

    def new_id(self) -> str:
        return S.new_id("chatcmpl" if self.chat else "cmpl")

    @staticmethod
    def error(e: ApiError) -> Response:
        return e.response()

    async def final(self, gw: Gateway, gen: Generation, reply: S.Reply, spec: Spec) -> dict[str, Any]:
        return S.chat_completion(reply) if self.chat else S.text_completion(reply)

    async def stream(self, gw: Gateway, gen: Generation, reply: S.Reply, spec: Spec,
                     states: list[ChoiceState]) -> AsyncIterator[bytes]:
        chat = self.chat
        if chat:
            for st in states:
                yield _sse(S.chat_chunk(reply, {"role": "assistant", "content": ""}, index=st.index))
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
                return _sse(S.chat_chunk(reply, {"content": o.text}, index=i, logprobs=lp) if chat
                            else S.text_chunk(reply, o.text, index=i, logprobs=lp, offset0=at))
            if o.kind == "call":
                idx, cid, name, args = o.call
                call: dict[str, Any] = {"index": idx, "function": {"arguments": args}}
                if cid is not None:
                    call.update(id=cid, type="function")
                    call["function"]["name"] = name
                return _sse(S.chat_chunk(reply, {"tool_calls": [call]}, index=i, logprobs=lp))
            # finish: any logprobs still pending ride on an empty delta first
            pre = (_sse(S.chat_chunk(reply, {}, index=i, logprobs=lp) if chat
                        else S.text_chunk(reply, "", index=i, logprobs=lp, offset0=at)) if lp else b"")
            return pre + _sse(S.chat_chunk(reply, {}, o.text, index=i) if chat
                              else S.text_chunk(reply, "", states[i].choice.finish_reason, index=i))

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
                        yield _sse(S.error_body("the engine failed while generating this reply", "server_error",
                                                code="generation_failed"))
                        yield b"data: [DONE]\n\n"
                        return
                    outs = states[ev.choice].committed(ev)
                elif isinstance(ev, P.Error):
                    e = _engine_error(ev, None, gw.cfg.retry_after_s)
                    yield _sse(e.body)
                    yield b"data: [DONE]\n\n"
                    return
                for o in outs:
                    b = chunk(o)
                    if b:
                        yield b
        except ApiError as e:
            yield _sse(e.body)
            yield b"data: [DONE]\n\n"
            return
        gw._finish_reply(gen, reply, states)
        if spec.include_usage:               # the last chunk, as OpenAI sends it: no choices, the usage
            yield _sse({**S.usage_chunk(reply, chat), "aotx": reply.aotx})
        # the receipt as an SSE comment: clients skip comments, and the openai client hands a
        # named event's data to the caller as one more chunk (with no choices, the quickstart's
        # chunk.choices[0] raised IndexError)
        yield _sse_comment("aotx.receipt", reply.aotx)
        yield b"data: [DONE]\n\n"


CHAT, COMPLETION = _OpenAI(True), _OpenAI(False)


def _bound(endpoint, gw: "Gateway"):
    """An async endpoint ``endpoint(gw, request)`` as Starlette's ``endpoint(request)``."""
    async def handle(request: Request) -> Response:
        return await endpoint(gw, request)
    return handle


def create_app(cfg: GatewayConfig, keys: KeyRing, link: EngineLink, *, connect_at_start: bool = True) -> Starlette:
    """The ASGI application. With ``connect_at_start`` its lifespan opens the engine
    connection (a failure there is logged; requests answer 503 until it works)."""
    from aotx.engine.gateway import anthropic as gateway_anthropic
    from aotx.engine.gateway import responses as gateway_responses

    gw = Gateway(cfg, keys, link)

    async def api_error(request: Request, exc: ApiError) -> Response:
        if request.url.path.startswith("/v1/messages"):
            from aotx.engine.gateway import anthropic as gateway_anthropic

            return gateway_anthropic.error_response(exc.status, exc.body["error"]["message"], exc.headers)
        return exc.response()

    async def bad_request(request: Request, exc: S.BadRequest) -> Response:
        if request.url.path.startswith("/v1/messages"):
            from aotx.engine.gateway import anthropic as gateway_anthropic

            return gateway_anthropic.error_response(exc.status, exc.message)
        return JSONResponse(S.error_body(exc.message, "invalid_request_error", exc.param, exc.code),
                            status_code=exc.status)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(S.error_body(f"{request.method} {request.url.path}: {exc.detail}", type_),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def internal(request: Request, exc: Exception) -> Response:
        print(f"aotx gateway: internal error on {request.method} {request.url.path}: {exc!r}", file=sys.stderr)
        if request.url.path.startswith("/v1/messages"):
            from aotx.engine.gateway import anthropic as gateway_anthropic

            return gateway_anthropic.error_response(500, "internal error in the gateway")
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
        Route("/v1/responses", _bound(gateway_responses.create, gw), methods=["POST"]),
        Route("/v1/responses/{response_id}", _bound(gateway_responses.retrieve, gw), methods=["GET"]),
        Route("/v1/messages", _bound(gateway_anthropic.create, gw), methods=["POST"]),
        Route("/v1/messages/count_tokens", _bound(gateway_anthropic.count_tokens, gw), methods=["POST"]),
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
    from aotx.engine.gateway import auth as gateway_auth

    host, port = args.host, args.port
    if not is_loopback(host) and not args.api_key_file:
        raise UsageError(f"--host {host} is not a loopback address: pass --api-key-file with the keys that may "
                         f"use it (a key file generated for loopback use is not taken implicitly)")
    # An existing key file is read first (a bad one fails before anything starts); a first
    # start's key is written only once an engine answers, so a refused start (no engine,
    # --device cuda without a GPU, a busy port) leaves no key file behind.
    have_file = args.api_key_file is not None or gateway_auth.default_key_path().exists()
    loaded = gateway_auth.load_or_create(args.api_key_file) if have_file else None
    raise_fd_limit()  # so the connection limit, not the descriptor limit, is what clients meet
    sock = listen_socket(host, port)
    cfg = GatewayConfig(
        limits=S.Limits(max_tokens_ceiling=args.max_tokens_ceiling),
        per_key_concurrency=args.per_key_concurrency, max_queue=args.max_queue)

    async def main() -> int:
        asyncio.get_running_loop().set_exception_handler(quiet_accept_errors())
        link = EngineLink(connect, cfg.retry_after_s)
        await link.get()  # start or find the engine before taking requests
        keys, path, created = loaded or gateway_auth.load_or_create(args.api_key_file)
        if created:
            print(f"aotx gateway: generated an API key in {path} (mode 0600); send it as 'Authorization: Bearer "
                  f"<key>'", file=sys.stderr)
        else:
            print(f"aotx gateway: {len(keys)} API key(s) from {path}", file=sys.stderr)
        app = create_app(cfg, KeyRing(keys, gateway_auth.key_options(path.read_text(encoding="utf-8"), path)), link)
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
