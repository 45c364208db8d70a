"""The gateway's engine connection, and the engine's outcomes as HTTP statuses.

Owns: ``EngineLink`` (the one ``EngineClient`` every request multiplexes over,
opened again when it drops) and ``engine_error`` (an engine ``Error`` as the HTTP
status and body a client gets: too_long -> 400 with the prompt's and the context's
token counts, busy -> 409, not_found -> 404, not_ready -> 503 with Retry-After, a
grammar the engine cannot compile -> 400 naming the request's field). Leaves the
socket protocol to ``ipc.client`` and requests to the API modules.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aotx.engine import protocol as P
from aotx.engine.errors import AotxError, ErrorCode
from aotx.engine.gateway.limits import ApiError
from aotx.engine.ipc.client import EngineClient


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


def engine_error(ev: P.Error, refused: P.Notice | None, retry_after_s: int, constraint_field: str = "") -> ApiError:
    """The HTTP error of an engine ``Error`` (``refused``: the Notice that came before it,
    with the numbers of a too-long prompt; ``constraint_field``: the request's name for
    its grammar, which a refusal of the grammar starts with)."""
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
