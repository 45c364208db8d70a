"""The gateway's limits against abuse, and its HTTP errors.

Owns: ``GatewayConfig`` (per-key concurrency, the queue, timeouts, connections),
``ApiError`` (an HTTP error answered with OpenAI's error body; the Messages API turns
it into Anthropic's), ``InFlight`` (generations in flight, in all and per key: 429
with Retry-After past either limit), reading a request body within
``Limits.max_body_bytes`` (413 naming the field that was open at the cut) and checking
the bearer key (401). Leaves the keys themselves to ``auth.py`` and what a body means
to the API modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from aotx.engine.gateway import media as M
from aotx.engine.gateway import schema as S
from aotx.engine.gateway import shapes
from aotx.engine.gateway.auth import KeyRing
from aotx.engine.gateway.streaming import ClientGone


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
    # the browser origins (``https://chat.example``; "*" any) whose pages may call the API
    # (CORS); none by default: a browser page of another origin cannot read the answers
    cors_origins: tuple[str, ...] = ()


class ApiError(Exception):
    """An HTTP error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.body = shapes.error_body(message, type_, param, code, **extra)
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def engine_gone(e: Exception, retry_after_s: int) -> ApiError:
    """503 for an engine connection that broke under a request."""
    return ApiError(503, f"the engine went away: {e}", "server_error", code="engine_unavailable",
                    headers={"Retry-After": str(retry_after_s)})


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


def too_large(head: bytes, what: str) -> ApiError:
    """413 for a body over the limit, naming the field that was still open at the cut
    (a data URL, mostly) when the first bytes show one."""
    where = M.open_field(head)
    if where:
        what = f"{where}: {what} (a media part may hold at most {M.MAX_PART_BYTES:,} bytes)"
    return ApiError(413, what, "invalid_request_error", param=where.split("[")[0].split(".")[0] if where else None,
                    code="body_too_large")


def authenticate(keys: KeyRing, request: Request) -> str:
    """The fingerprint of the request's key (``Authorization: Bearer``, or Anthropic's
    ``x-api-key``). Raises ApiError 401."""
    auth = request.headers.get("authorization")
    if auth is None and request.headers.get("x-api-key"):  # Anthropic's clients send the key so
        auth = "Bearer " + request.headers["x-api-key"]
    fp = keys.check(auth)
    if fp is None:
        given = "authorization" in request.headers or "x-api-key" in request.headers
        raise ApiError(401, "incorrect API key provided" if given else
                       "no API key provided: send 'Authorization: Bearer <key>' (the key file's path is printed "
                       "when `aotx gateway` starts)", "invalid_request_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return fp


#: with a declared Content-Length over the limit, the 413 names the field open at the cut
#: from what arrives within this many bytes and seconds: never waiting for the body itself
HEAD_BYTES = 64 << 10
HEAD_WAIT_S = 0.5


async def _head(request: Request, limit: int, wait_s: float) -> bytes:
    """Up to ``limit`` bytes of the body, as many as arrive within ``wait_s`` seconds."""
    head = bytearray()
    chunks = request.stream()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    try:
        while len(head) < limit:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                head += await asyncio.wait_for(chunks.__anext__(), left)
            except (StopAsyncIteration, asyncio.TimeoutError, ClientDisconnect):
                break
    finally:
        with contextlib.suppress(BaseException):
            await chunks.aclose()
    return bytes(head[:limit])


async def read_json(request: Request, limit: int) -> Any:
    """The request's body as JSON, read up to ``limit`` bytes. Raises ApiError: 413 past
    the limit (at once for a declared Content-Length over it), 400 for an empty body, one
    that is not JSON or a string that is not Unicode; ClientGone when the client leaves."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise ApiError(400, f"Content-Length {cl!r} is not a number", "invalid_request_error") from None
        if n > limit:
            head = await _head(request, min(limit, HEAD_BYTES), HEAD_WAIT_S)
            raise too_large(head, f"the request body is {n:,} bytes; the limit is {limit:,}")
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise too_large(bytes(buf[:limit]), f"the request body exceeds the limit of {limit:,} bytes")
    except ClientDisconnect:
        raise ClientGone() from None
    if not buf:
        raise ApiError(400, "the request body is empty; send a JSON object", "invalid_request_error")
    try:
        body = json.loads(bytes(buf))
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_request_error",
                       code="invalid_json") from None
    where = not_unicode(body)
    if where is not None:
        raise ApiError(400, f"'{where[0]}' is not valid Unicode: it holds a lone surrogate ({where[1]}); send UTF-8 "
                            "text (a surrogate pair's halves together)", "invalid_request_error",
                       param=where[0].split("[")[0].split(".")[0], code="invalid_unicode")
    return body


def not_unicode(body: Any) -> tuple[str, str] | None:
    """(the field, the escape) of the first string in ``body`` that holds a lone UTF-16
    surrogate (JSON's ``"\\ud800"`` escape decodes to one; no UTF-8 text has it, and the
    engine's protocol refuses it), or None. One C-speed pass when there is none."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    except (ValueError, RecursionError):  # (json.loads made it: neither happens)
        return None

    def bad(s: str) -> str | None:
        for ch in s:
            if 0xD800 <= ord(ch) <= 0xDFFF:
                return f"\\u{ord(ch):04x}"
        return None

    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if (esc := bad(v)) is not None:
                return path or "body", esc
        elif isinstance(v, dict):
            items = []
            for k, x in v.items():
                sub = f"{path}.{k}" if path else k
                if (esc := bad(k)) is not None:
                    return sub.encode("utf-8", "backslashreplace").decode(), esc
                items.append((sub, x))
            stack.extend(reversed(items))
        elif isinstance(v, list):
            stack.extend(reversed([(f"{path}[{i}]", x) for i, x in enumerate(v)]))
    return None


class OneLineErrors:
    """ASGI middleware around the routes: an exception no handler took is answered 500
    (``answer(path)`` gives the body, in the shape of the API that was called) and
    logged as one line, never as a traceback (Starlette's own error middleware logs one
    and raises it again); a client that left while its body was read is not logged."""

    def __init__(self, app: Any, log: Callable[[str], None], answer: Callable[[str], Any]):
        self.app = app
        self.log = log
        self.answer = answer

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: dict) -> None:
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except (ClientDisconnect, ClientGone):
            pass
        except Exception as e:  # noqa: BLE001 - the one place every unexpected error ends
            self.log(f"aotx gateway: internal error on {scope.get('method')} {scope.get('path')}: {e!r}")
            if not started:
                await self.answer(scope.get("path", ""))(scope, receive, send)
