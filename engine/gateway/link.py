"""The gateway's engine connection, and the engine's outcomes as HTTP statuses.

Owns: ``EngineLink`` (the one ``EngineClient`` every request multiplexes over,
opened again when it drops, with the models the engine had loaded restored when the
engine is another one) and ``engine_error`` (an engine ``Error`` as the HTTP
status and body a client gets: too_long -> 400 with the prompt's and the context's
token counts, busy -> 409, not_found -> 404, not_ready -> 503 with Retry-After, a
grammar the engine cannot compile -> 400 naming the request's field). Leaves the
socket protocol to ``ipc.client`` and requests to the API modules.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

from aotx.engine import protocol as P
from aotx.engine.errors import AotxError, EngineError, ErrorCode
from aotx.engine.gateway.limits import ApiError
from aotx.engine.ipc.client import EngineClient


class EngineLink:
    """The gateway's one engine connection (requests multiplex over it), opened
    again when it drops. ``connect`` opens a new ``EngineClient``.

    It remembers which models its engine had loaded (``remember``: each one's name and
    file) and, when it connects to another engine (the first one died and a new one was
    started or found), loads those the new one lacks, by name or else by file, before any
    request goes through; a model that no longer loads is one line on stderr."""

    def __init__(self, connect: Callable[[], Awaitable[EngineClient]], retry_after_s: int = 1,
                 log: Callable[[str], None] | None = None):
        self._connect = connect
        self._client: EngineClient | None = None
        self._lock = asyncio.Lock()
        self.retry_after_s = retry_after_s
        self.model = ""
        self.tool_format = "hermes"  # the model's tool-call family (Welcome.tool_format)
        self.loaded: dict[str, str] = {}  # the models the engine had loaded: name -> file ("" a remote one)
        self._pid = 0  # the engine connected last (Welcome.pid)
        self._log = log or (lambda line: print(line, file=sys.stderr))

    def remember(self, models: list[P.ModelInfo]) -> None:
        """The engine's model list as last seen: its loaded models are the ones to restore."""
        self.loaded = {m.name: (m.path if m.kind == "gguf" else "") for m in models if m.loaded and not m.error}

    async def _restore(self, c: EngineClient) -> None:
        """Load into the engine ``c`` the models the previous one had loaded."""
        for name, path in list(self.loaded.items()):
            if name in c.welcome.models or name == c.welcome.model:
                continue
            why = ""
            for ref in (name, path):
                if not ref:
                    continue
                try:
                    await c.load_model(ref, evict_idle=True)
                    why = ""
                    break
                except EngineError as e:
                    why = str(e)
            if why:
                self._log(f"aotx gateway: the new engine could not load {name}, which the previous one had "
                          f"loaded: {why}")

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
            if self._pid and c.welcome.pid != self._pid:
                await self._restore(c)  # another engine than the one whose models were remembered
            self._pid = c.welcome.pid
            try:
                self.remember((await c.list_models()).models)
            except (AotxError, OSError):  # it answers requests anyway; the list is taken again later
                pass
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
        field = ev.message.split(":", 1)[0] if ev.message.startswith("logit_bias:") else None  # (the engine's vocabulary)
        return ApiError(400, ev.message, "invalid_request_error", param=field, code=ev.code)
    return ApiError(500, f"the engine failed: {ev.message}", "server_error", code=ev.code)
