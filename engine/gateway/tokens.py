"""Embeddings and the tokenizer over HTTP: ``/v1/embeddings``, ``/tokenize``, ``/detokenize``.

Owns: OpenAI's ``POST /v1/embeddings`` (``input`` a string or an array of strings;
``encoding_format`` float or base64, the little-endian float32 bytes the ``openai``
client asks for by default; ``dimensions`` only at the model's own width; AOTX's
``pooling``: mean (the default), last or cls, as llama.cpp's ``--pooling``; vectors
L2-normalized, as OpenAI's and llama-server's are), and llama-server's ``POST
/tokenize`` (``content``, ``add_special``, ``parse_special``, ``with_pieces``) and ``POST
/detokenize`` (``tokens``), which also take vLLM's field names (``prompt``; the answer
carries ``count`` and ``max_model_len``, and ``prompt`` beside ``content``). Token-id
inputs to ``/v1/embeddings`` are refused (send text). Leaves the work to the engine
(``Embed``, ``Tokenize``, ``Detokenize``) and routing to ``core.py``.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aotx.engine import protocol as P
from aotx.engine.errors import EngineError
from aotx.engine.gateway import schema as S
from aotx.engine.gateway.limits import engine_gone
from aotx.engine.ipc.client import ConnectionLost

MAX_INPUTS = 256  # protocol's MAX_EMBED_TEXTS


def _body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise S.BadRequest(f"the request body must be a JSON object, got {S._type_name(body)}")
    return body


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise S.BadRequest(f"'{name}' must be a boolean, got {S._type_name(v)}", name)
    return v


async def embeddings(gw, request: Request) -> Response:
    """``POST /v1/embeddings``."""
    gw._auth(request)
    body = _body(await gw._json(request))
    inp = body.get("input")
    if inp is None:
        raise S.BadRequest("'input' is required", "input")
    texts = [inp] if isinstance(inp, str) else inp
    if not isinstance(texts, list) or not texts:
        raise S.BadRequest("'input' must be a string or a non-empty array of strings", "input")
    for i, t in enumerate(texts):
        if isinstance(t, (int, list)) and not isinstance(t, bool):
            raise S.BadRequest("'input' holds token ids: this server embeds text (send the strings)", "input",
                               "unsupported_parameter")
        if not isinstance(t, str) or not t:
            raise S.BadRequest(f"'input[{i}]' must be a non-empty string", "input")
    if len(texts) > MAX_INPUTS:
        raise S.BadRequest(f"'input' has {len(texts)} strings; at most {MAX_INPUTS} per request", "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise S.BadRequest(f"'encoding_format' must be float or base64, got {fmt!r}"[:120], "encoding_format")
    pooling = body.get("pooling") or "mean"
    if pooling not in P.POOLINGS:
        raise S.BadRequest(f"'pooling' must be one of {', '.join(P.POOLINGS)}, got {pooling!r}"[:120], "pooling")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise S.BadRequest(f"'model' must be a string, got {S._type_name(model)}", "model")
    target = await gw.route(model)
    e = await gw.embeddings(texts, target, pooling, True, _bool(body, "truncate", False), body.get("dimensions"))
    data = []
    for i, v in enumerate(e.vectors):
        emb: Any = v if fmt == "float" else base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(e.n_tokens)
    return JSONResponse({"object": "list", "data": data, "model": e.model or target or gw.link.model,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


async def _client_call(gw, fn):
    client = await gw.link.get()
    try:
        return await fn(client)
    except ConnectionLost as e:
        raise engine_gone(e, gw.cfg.retry_after_s) from None
    except EngineError as e:
        raise gw.engine_error(P.Error(id=0, code=e.code, message=str(e))) from None


async def tokenize(gw, request: Request) -> Response:
    """``POST /tokenize``: ``{"tokens": [...]}`` (with ``with_pieces``: ``[{"id", "piece"}]``,
    a piece that is not UTF-8 as its bytes)."""
    gw._auth(request)
    body = _body(await gw._json(request))
    text = body.get("content", body.get("prompt"))
    if not isinstance(text, str):
        raise S.BadRequest("'content' must be the text to tokenize (a string)", "content")
    target = await gw.route(body.get("model") if isinstance(body.get("model"), str) else None)
    add = _bool(body, "add_special", False)
    parse = _bool(body, "parse_special", False)
    pieces = _bool(body, "with_pieces", False)
    tl = await _client_call(gw, lambda c: c.tokenize(text, model=target, add_special=add, parse_special=parse))
    if pieces:
        out: list[Any] = []
        for i, b in zip(tl.ids, tl.pieces):
            try:
                piece: Any = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)
            out.append({"id": i, "piece": piece})
    else:
        out = list(tl.ids)
    ctx = next((m.n_ctx for m in await gw._models() if m.name == tl.model and m.loaded), 0)
    return JSONResponse({"tokens": out, "count": len(tl.ids), "max_model_len": ctx})


async def detokenize(gw, request: Request) -> Response:
    """``POST /detokenize``: ``{"content": text}``."""
    gw._auth(request)
    body = _body(await gw._json(request))
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise S.BadRequest("'tokens' must be an array of token ids (integers of at least 0)", "tokens")
    if len(ids) > 1 << 20:
        raise S.BadRequest(f"'tokens' has {len(ids):,} ids; at most {1 << 20:,}", "tokens")
    target = await gw.route(body.get("model") if isinstance(body.get("model"), str) else None)
    d = await _client_call(gw, lambda c: c.detokenize(ids, model=target))
    return JSONResponse({"content": d.text, "prompt": d.text})
