"""Streaming a reply over HTTP, and noticing a client that leaves.

Owns: the server-sent-events framing every API's stream uses (``sse``: one ``data:``
event, optionally named; ``sse_comment``: a ``: name {json}`` comment line),
``ndjson`` (a line of newline-delimited JSON), ``EventStream`` (a streaming response that watches the connection while it streams
and, when the client leaves or the server stops, cancels the body and tells its owner),
and ``race_disconnect`` (await work unless the client leaves first: ``ClientGone``).
Leaves what is streamed to the API modules (``openai.py``, ``anthropic.py``,
``responses.py``) and the generation to ``generation.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return once the ASGI ``receive`` channel says the client disconnected."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, coro: Awaitable) -> Any:
    """Await ``coro``; raise ClientGone (after cancelling it) if the client leaves first."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(until_disconnect(request.receive))
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
    raise ClientGone()


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event: ``data: {json}`` (after ``event: NAME`` when named)."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + b"data: " + data.encode() + b"\n\n"


def sse_comment(name: str, obj: Any) -> bytes:
    """An SSE comment line ``: NAME {json}`` (one line: JSON has no raw newlines)."""
    return f": {name} ".encode() + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def ndjson(obj: Any) -> bytes:
    """One line of newline-delimited JSON (Ollama's streaming)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class EventStream(Response):
    """A streaming response that watches for the client leaving while it streams,
    and then cancels the body and calls ``on_close(gone=True)``. Server-sent events,
    or ``media_type`` (Ollama's ``application/x-ndjson``)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str],
                 on_close: Callable[[bool], Awaitable[None]], media_type: str | None = None):
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        if media_type:
            self.media_type = media_type
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        work = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(until_disconnect(receive))
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
