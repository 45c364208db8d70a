"""Ollama's API on the gateway, for the clients written for Ollama (oterm, Open WebUI,
Continue, the ``ollama`` Python and JS libraries).

Owns the routes under ``/api``: ``version``, ``tags`` (the installed and loaded models),
``show`` (a model's details, parameters and capabilities), ``ps`` (the loaded models,
their size and context, when ``keep_alive`` unloads them), ``chat`` and ``generate``
(``ollama_chat.py``: journaled conversations like every other request), ``embed`` and
the older ``embeddings``; errors as Ollama's ``{"error": "..."}``. Every route takes the
same bearer keys as the rest of the gateway (Ollama's clients send ``OLLAMA_API_KEY`` as
one). Model names are the gateway's (``/v1/models``); a ``:latest`` tag is taken off.

``keep_alive`` (a duration: ``"5m"``, ``"1h30m"``, seconds as a number; 0 unloads at
once, a negative one keeps the model loaded): the gateway unloads a model it was given
for, once it has been idle that long (``KeepAlive``); a chat or generate without
messages or prompt loads the model (or, with 0, unloads it), as in Ollama. The engine's
default model is never unloaded (the engine keeps it). Leaves the engine to ``core.py``
and embeddings to the engine (``Embed``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aotx.engine import protocol as P
from aotx.engine.errors import AotxError, EngineError
from aotx.engine.gateway import ollama_chat as OC
from aotx.engine.gateway import schema as S
from aotx.engine.gateway.limits import engine_gone
from aotx.engine.ipc.client import ConnectionLost

#: the Ollama version the API follows (clients check it for features such as tools)
OLLAMA_VERSION = "0.12.6"
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?$")


def keep_alive_s(v: Any) -> float | None:
    """``keep_alive`` in seconds (None: not given; a negative value: forever). Raises
    BadRequest for one that is not a duration."""
    if v is None or v == "":
        return None
    if isinstance(v, bool):
        raise S.BadRequest(f"'keep_alive' must be a duration such as \"5m\" or a number of seconds, got {v!r}",
                           "keep_alive")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        s = v.strip()
        if re.fullmatch(r"-?\d+(?:\.\d+)?", s):
            return float(s)
        neg = s.startswith("-")
        m = _DURATION.match(s.lstrip("-"))
        if m and any(m.groups()):
            h, mi, se, ms = (float(x) if x else 0.0 for x in m.groups())
            total = h * 3600 + mi * 60 + se + ms / 1000
            return -total if neg else total
    raise S.BadRequest(f"'keep_alive' must be a duration such as \"5m\", \"1h30m\" or a number of seconds, got "
                       f"{str(v)[:40]!r}", "keep_alive")


class KeepAlive:
    """When each model a request named with ``keep_alive`` is unloaded: ``deadline``
    (monotonic seconds) after its last request ended. A sweep every second unloads the
    ones past it that are idle (never the engine's default model)."""

    SWEEP_S = 1.0

    def __init__(self, gw: Any):
        self.gw = gw
        self.after: dict[str, float] = {}  # model -> seconds of idleness before it is unloaded
        self.deadline: dict[str, float] = {}
        self._task: asyncio.Task | None = None

    def set(self, model: str, seconds: float | None) -> None:
        if seconds is None or not model:
            return
        if seconds < 0:
            self.after.pop(model, None)
            self.deadline.pop(model, None)
            return
        self.after[model] = seconds
        self.touch(model)

    def touch(self, model: str) -> None:
        """A request on ``model`` ended: its idle time starts now."""
        if model in self.after:
            self.deadline[model] = time.monotonic() + self.after[model]
            if self._task is None or self._task.done():
                self._task = asyncio.ensure_future(self._sweep())

    def expires_at(self, model: str) -> float | None:
        """The wall-clock time ``model`` is unloaded at (None: not planned)."""
        d = self.deadline.get(model)
        return None if d is None else time.time() + (d - time.monotonic())

    async def _sweep(self) -> None:
        while self.deadline:
            await asyncio.sleep(min(self.SWEEP_S, max(0.0, min(self.deadline.values()) - time.monotonic())))
            now = time.monotonic()
            for model in [m for m, d in self.deadline.items() if d <= now]:
                await self._unload(model)

    async def _unload(self, model: str) -> None:
        try:
            info = next((m for m in await self.gw._models() if m.name == model), None)
            if info is not None and info.busy:
                self.deadline[model] = time.monotonic() + self.SWEEP_S  # it is generating: later
                return
            self.deadline.pop(model, None)
            self.after.pop(model, None)
            if info is None or not info.loaded or info.default:
                return
            await (await self.gw.link.get()).unload_model(model)
            self.gw._model_cache = None
        except (AotxError, OSError, Exception) as e:  # noqa: BLE001 - the next request loads it again
            self.deadline.pop(model, None)
            print(f"aotx gateway: keep_alive: could not unload {model}: {e}", file=__import__("sys").stderr)


def _digest(m: P.ModelInfo) -> str:
    return hashlib.sha256(f"{m.name}\0{m.path or m.url}\0{m.size_bytes}".encode()).hexdigest()


def _details(m: P.ModelInfo) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf" if m.kind == "gguf" else m.kind, "family": m.arch,
            "families": [m.arch] if m.arch else None, "parameter_size": "", "quantization_level": m.quant}


def _modified(m: P.ModelInfo) -> str:
    try:
        return OC.created_at(os.stat(m.path).st_mtime) if m.path else OC.created_at(0)
    except OSError:
        return OC.created_at(0)


def _tag(m: P.ModelInfo) -> dict[str, Any]:
    return {"name": m.name, "model": m.name, "modified_at": _modified(m), "size": m.size_bytes,
            "digest": _digest(m), "details": _details(m)}


async def _find(gw, name: Any) -> P.ModelInfo:
    """The model an Ollama request names (404 in Ollama's words for another)."""
    if not isinstance(name, str) or not name:
        raise S.BadRequest("'model' is required", "model")
    target = await gw.route(name)
    for m in await gw._models():
        if not m.error and ((m.name == target) if target else m.default):
            return m
    raise gw.api_error(404, f"model '{name[:80]}' not found", "not_found_error", param="model",
                       code="model_not_found")


async def version(gw, request: Request) -> Response:
    """``GET /api/version``."""
    gw._auth(request)
    return JSONResponse({"version": OLLAMA_VERSION})


async def tags(gw, request: Request) -> Response:
    """``GET /api/tags``: every installed and loaded model, default first."""
    gw._auth(request)
    ms = sorted((m for m in await gw._models() if not m.error), key=lambda m: not m.default)
    return JSONResponse({"models": [_tag(m) for m in ms]})


async def ps(gw, request: Request) -> Response:
    """``GET /api/ps``: the loaded models."""
    gw._auth(request)
    out = []
    for m in await gw._models():
        if m.error or not m.loaded:
            continue
        exp = gw.keep_alive.expires_at(m.name)
        d = _tag(m)
        d.pop("modified_at")
        d.update(size=m.needs_bytes or m.size_bytes, expires_at=OC.created_at(exp) if exp else "2318-01-01T00:00:00Z",
                 size_vram=(m.needs_bytes or m.size_bytes) if gw.device == "cuda" else 0, context_length=m.n_ctx)
        out.append(d)
    return JSONResponse({"models": out})


async def show(gw, request: Request) -> Response:
    """``POST /api/show``: details, parameters (the engine's sampling defaults) and capabilities."""
    gw._auth(request)
    body = await gw._json(request)
    if not isinstance(body, dict):
        raise S.BadRequest("the request body must be a JSON object")
    m = await _find(gw, body.get("model") or body.get("name"))
    sp = P.SamplingParams()
    params = "\n".join(f"{k:<15} {v}" for k, v in (("temperature", sp.temperature), ("top_k", sp.top_k),
                                                   ("top_p", sp.top_p), ("min_p", sp.min_p),
                                                   ("repeat_penalty", sp.repeat_penalty),
                                                   ("repeat_last_n", sp.repeat_last_n)))
    info: dict[str, Any] = {"general.architecture": m.arch, "general.name": m.name}
    if m.arch and m.n_ctx_train:
        info[f"{m.arch}.context_length"] = m.n_ctx_train
    caps = ["completion", "tools"] + (["embedding"] if m.kind == "gguf" else [])
    return JSONResponse({"modelfile": f"# served by AOTX\nFROM {m.path or m.url}\n", "parameters": params,
                         "template": "", "details": _details(m), "model_info": info, "capabilities": caps,
                         "modified_at": _modified(m)})


async def _load_or_unload(gw, body: dict, chat: bool) -> Response:
    """A chat or generate without messages or prompt: load the model (or unload it with
    ``keep_alive`` 0), as Ollama does."""
    m = await _find(gw, body.get("model"))
    ka = keep_alive_s(body.get("keep_alive"))
    client = await gw.link.get()
    reason = "load"
    try:
        if ka == 0:
            reason = "unload"
            if m.loaded and not m.default:
                await client.unload_model(m.name)
        elif not m.loaded:
            await client.load_model(m.name)
    except ConnectionLost as e:
        raise engine_gone(e, gw.cfg.retry_after_s) from None
    except EngineError as e:
        raise gw.engine_error(P.Error(id=0, code=e.code, message=str(e))) from None
    gw._model_cache = None
    gw.keep_alive.set(m.name, ka if ka != 0 else None)
    obj: dict[str, Any] = {"model": m.name, "created_at": OC.created_at(), "done": True, "done_reason": reason}
    if chat:
        obj["message"] = {"role": "assistant", "content": ""}
    else:
        obj["response"] = ""
    return JSONResponse(obj)


async def _run(gw, request: Request, chat: bool) -> Response:
    key = gw._auth(request)
    body = await gw._json(request)
    if not isinstance(body, dict):
        raise S.BadRequest("the request body must be a JSON object")
    m = await _find(gw, body.get("model"))
    ka = keep_alive_s(body.get("keep_alive"))
    if chat:
        req, parts = OC.parse_chat(body, gw.cfg.limits, m.n_ctx if m.loaded else 0)
        raw = False
    else:
        req, parts, raw = OC.parse_generate(body, gw.cfg.limits, m.n_ctx if m.loaded else 0)
    if req is None:
        return await _load_or_unload(gw, body, chat)
    if ka is not None and not m.default:
        gw.keep_alive.set(m.name, ka)
    spec = OC.spec_of(req, parts, raw)
    if chat:
        spec.prefill = getattr(req, "prefill", "")
    return await gw.generate(request, key, spec, OC.OllamaAPI(chat, on_done=gw.keep_alive.touch))


async def chat(gw, request: Request) -> Response:
    """``POST /api/chat``."""
    return await _run(gw, request, True)


async def generate(gw, request: Request) -> Response:
    """``POST /api/generate``."""
    return await _run(gw, request, False)


async def embed(gw, request: Request) -> Response:
    """``POST /api/embed``: ``{"embeddings": [[...], ...]}``, L2-normalized, mean-pooled
    (``truncate`` true by default: a text past the context is cut, as Ollama does)."""
    gw._auth(request)
    body = await gw._json(request)
    if not isinstance(body, dict):
        raise S.BadRequest("the request body must be a JSON object")
    m = await _find(gw, body.get("model"))
    inp = body.get("input")
    texts = [inp] if isinstance(inp, str) else inp
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise S.BadRequest("'input' must be a non-empty string or an array of non-empty strings", "input")
    dims = body.get("dimensions")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise S.BadRequest(f"'truncate' must be a boolean, got {S._type_name(truncate)}", "truncate")
    t0 = time.monotonic()
    e = await gw.embeddings(texts, m.name, "mean", True, truncate, dims, "dimensions")
    gw.keep_alive.set(m.name, keep_alive_s(body.get("keep_alive")))
    gw.keep_alive.touch(m.name)
    return JSONResponse({"model": m.name, "embeddings": e.vectors, "total_duration": int((time.monotonic() - t0) * 1e9),
                         "load_duration": 0, "prompt_eval_count": sum(e.n_tokens)})


async def embeddings(gw, request: Request) -> Response:
    """``POST /api/embeddings`` (Ollama's older route): ``{"embedding": [...]}`` of
    ``prompt``, not normalized (as Ollama's)."""
    gw._auth(request)
    body = await gw._json(request)
    if not isinstance(body, dict):
        raise S.BadRequest("the request body must be a JSON object")
    m = await _find(gw, body.get("model"))
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise S.BadRequest("'prompt' must be a non-empty string", "prompt")
    e = await gw.embeddings([prompt], m.name, "mean", False, True, None, "")
    return JSONResponse({"embedding": e.vectors[0]})
