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

import json
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from aotx.engine.gateway import media as M
from aotx.engine.gateway import schema as S
from aotx.engine.gateway import shapes
from aotx.engine.gateway.auth import KeyRing


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


async def read_json(request: Request, limit: int) -> Any:
    """The request's body as JSON, read up to ``limit`` bytes. Raises ApiError: 413 past
    the limit, 400 for an empty body or one that is not JSON."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise ApiError(400, f"Content-Length {cl!r} is not a number", "invalid_request_error") from None
        if n > limit:
            head = bytearray()
            async for chunk in request.stream():  # read up to the limit only, to name the field
                head += chunk
                if len(head) > limit:
                    break
            raise too_large(bytes(head[:limit]), f"the request body is {n:,} bytes; the limit is {limit:,}")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise too_large(bytes(buf[:limit]), f"the request body exceeds the limit of {limit:,} bytes")
    if not buf:
        raise ApiError(400, "the request body is empty; send a JSON object", "invalid_request_error")
    try:
        body = json.loads(bytes(buf))
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_request_error",
                       code="invalid_json") from None
    return body
