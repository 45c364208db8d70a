"""``aotx gateway``: the HTTP application in front of the engine, and the command.

Owns: the ASGI application (``create_app``: the routes of every API, the OpenAI ones
also without ``/v1`` as llama-server serves them; CORS for the origins named with
``--cors-origin``, none by default; the error handlers that answer in each API's error
shape, one log line for an unexpected error; the lifespan that opens the engine
connection) and the command (``run_gateway``: keys, the listening socket, uvicorn with
its connection limit and, with ``--tls-cert`` / ``--tls-key``, HTTPS; one line per
burst of failed accepts). Every response names its
conversation in ``X-AOTX-Conversation``; a reply carries its durable receipt
(``X-AOTX-Receipt`` and an ``aotx`` body field, or an SSE comment line
``: aotx.receipt {json}`` just before ``data: [DONE]`` when streaming).

HTTP status of engine outcomes (``link.engine_error``): too_long -> 400 (with the
prompt's and the context's token counts), busy (the conversation is generating) -> 409,
not_found -> 404, not_ready or no engine -> 503 with Retry-After; the gateway's own
limits (``limits.py``): more generations in flight than ``max_queue`` or than
``per_key_concurrency`` for one key -> 429 with Retry-After, a body over
``max_body_bytes`` -> 413. A client that disconnects cancels its generation.

Leaves to others: the routes' work (``openai.py``, ``responses.py``, ``anthropic.py``
over ``core.Gateway``), generation, conversations and the journal (the engine, over its
local socket through ``ipc.client.EngineClient``), keys on disk (``auth.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Mount, Route

from aotx.engine.errors import EngineError, UsageError
from aotx.engine.gateway import schema as S
from aotx.engine.gateway import shapes
from aotx.engine.gateway.auth import KeyRing
from aotx.engine.gateway.core import Gateway
from aotx.engine.gateway.limits import ApiError, GatewayConfig, OneLineErrors
from aotx.engine.gateway.link import EngineLink
from aotx.engine.gateway.streaming import ClientGone
from aotx.engine.ipc.server import raise_fd_limit

__all__ = ["ApiError", "EngineLink", "Gateway", "GatewayConfig", "create_app", "is_loopback", "listen_socket",
           "quiet_accept_errors", "run_gateway", "uvicorn_server"]


def _bound(endpoint, gw: "Gateway"):
    """An async endpoint ``endpoint(gw, request)`` as Starlette's ``endpoint(request)``."""
    async def handle(request: Request) -> Response:
        return await endpoint(gw, request)
    return handle


def create_app(cfg: GatewayConfig, keys: KeyRing, link: EngineLink, *, connect_at_start: bool = True) -> Starlette:
    """The ASGI application. With ``connect_at_start`` its lifespan opens the engine
    connection (a failure there is logged; requests answer 503 until it works)."""
    from aotx.engine.gateway import anthropic as gateway_anthropic
    from aotx.engine.gateway import ollama as gateway_ollama
    from aotx.engine.gateway import openai as gateway_openai
    from aotx.engine.gateway import responses as gateway_responses
    from aotx.engine.gateway import tokens as gateway_tokens
    from aotx.engine.gateway.metrics import Metrics

    gw = Gateway(cfg, keys, link)
    gw.metrics = metrics = Metrics()

    def shaped(path: str, status: int, message: str, headers: dict[str, str] | None = None,
               body: dict | None = None) -> Response:
        """An error in the shape of the API that was called (OpenAI's unless said)."""
        if path.startswith("/v1/messages"):
            return gateway_anthropic.error_response(status, message, headers)
        if path.startswith("/api/"):
            return JSONResponse({"error": message}, status_code=status, headers=headers)  # Ollama's
        return JSONResponse(body or shapes.error_body(message, "server_error"), status_code=status, headers=headers)

    async def api_error(request: Request, exc: ApiError) -> Response:
        return shaped(request.url.path, exc.status, exc.body["error"]["message"], exc.headers, exc.body)

    async def bad_request(request: Request, exc: S.BadRequest) -> Response:
        return shaped(request.url.path, exc.status, exc.message, None,
                      shapes.error_body(exc.message, "invalid_request_error", exc.param, exc.code))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return shaped(request.url.path, exc.status_code, message, getattr(exc, "headers", None),
                      shapes.error_body(message, type_))

    def internal(path: str) -> Response:
        return shaped(path, 500, "internal error in the gateway")

    async def gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left while its body was read

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if connect_at_start:
            try:
                await link.get()
            except ApiError as e:
                print(f"aotx gateway: {e}", file=sys.stderr)
        yield
        await link.close()

    def post(path: str, endpoint) -> Route:
        return Route(path, _bound(endpoint, gw), methods=["POST"])

    def get(path: str, endpoint) -> Route:
        return Route(path, _bound(endpoint, gw), methods=["GET"])

    openai_routes = [
        get("/models", gateway_openai.models),
        get("/models/{name:path}", gateway_openai.model),
        post("/chat/completions", gateway_openai.chat),
        post("/completions", gateway_openai.completions),
        post("/embeddings", gateway_tokens.embeddings),
        post("/responses", gateway_responses.create),
        get("/responses/{response_id}", gateway_responses.retrieve),
    ]
    routes = [
        Route("/health", gw.health, methods=["GET"]),
        get("/metrics", metrics.endpoint),
        post("/tokenize", gateway_tokens.tokenize),
        post("/detokenize", gateway_tokens.detokenize),
        Mount("/v1", routes=[
            *openai_routes,
            post("/messages", gateway_anthropic.create),
            post("/messages/count_tokens", gateway_anthropic.count_tokens),
        ]),
        # the OpenAI routes without /v1 too: a client whose base URL lacks it (llama-server serves both)
        *openai_routes,
        Mount("/api", routes=[
            get("/version", gateway_ollama.version),
            get("/tags", gateway_ollama.tags),
            get("/ps", gateway_ollama.ps),
            post("/show", gateway_ollama.show),
            post("/chat", gateway_ollama.chat),
            post("/generate", gateway_ollama.generate),
            post("/embed", gateway_ollama.embed),
            post("/embeddings", gateway_ollama.embeddings),
        ]),
    ]
    middleware = [Middleware(metrics.middleware),
                  Middleware(OneLineErrors, log=lambda line: print(line, file=sys.stderr), answer=internal)]
    if cfg.cors_origins:  # outermost: a browser's preflight is answered before the key is asked
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins), allow_methods=["*"],
                                        allow_headers=["*"], max_age=600,
                                        expose_headers=["X-AOTX-Conversation", "X-AOTX-Receipt", "Retry-After"]))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={ApiError: api_error, S.BadRequest: bad_request, HTTPException: http_error,
                                        ClientGone: gone, ClientDisconnect: gone})
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


def uvicorn_server(app: Starlette, max_connections: int = GatewayConfig.max_connections,
                   tls: tuple[str, str] | None = None):
    """The uvicorn server of ``app``: past ``max_connections`` concurrent connections
    a new request is answered 503 at once (uvicorn's ``limit_concurrency``). ``tls``:
    (certificate file, key file) in PEM: HTTPS (uvicorn's ``ssl_certfile`` / ``ssl_keyfile``)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", server_header=False,
                            timeout_keep_alive=5, timeout_graceful_shutdown=5, limit_concurrency=max_connections,
                            ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
    return uvicorn.Server(config)


def tls_files(cert: str | None, key: str | None) -> tuple[str, str] | None:
    """(certificate, key) for HTTPS, checked by loading them as uvicorn will; None for
    plain HTTP. Raises UsageError naming the flag and the problem."""
    if not cert and not key:
        return None
    if not cert or not key:
        raise UsageError("--tls-cert and --tls-key go together: the certificate and its private key (PEM files)")
    import os
    import ssl

    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not os.path.isfile(path):
            raise UsageError(f"{flag} {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise UsageError(f"--tls-cert {cert} / --tls-key {key}: not a certificate and its key in PEM "
                         f"({getattr(e, 'reason', None) or e})") from None
    return cert, key


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
    tls = tls_files(getattr(args, "tls_cert", None), getattr(args, "tls_key", None))
    # An existing key file is read first (a bad one fails before anything starts); a first
    # start's key is written only once an engine answers, so a refused start (no engine,
    # --device cuda without a GPU, a busy port) leaves no key file behind.
    have_file = args.api_key_file is not None or gateway_auth.default_key_path().exists()
    loaded = gateway_auth.load_or_create(args.api_key_file) if have_file else None
    raise_fd_limit()  # so the connection limit, not the descriptor limit, is what clients meet
    sock = listen_socket(host, port)
    cfg = GatewayConfig(
        limits=S.Limits(max_tokens_ceiling=args.max_tokens_ceiling),
        per_key_concurrency=args.per_key_concurrency, max_queue=args.max_queue,
        cors_origins=tuple(getattr(args, "cors_origin", None) or ()))

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
        server = uvicorn_server(app, cfg.max_connections, tls)
        shown = f"[{host}]" if ":" in host else host
        print(f"aotx gateway: serving model {link.model} at http{'s' if tls else ''}://{shown}:"
              f"{sock.getsockname()[1]}/v1 "
              f"(engine socket {(await link.get()).socket_path})", file=sys.stderr)
        await server.serve(sockets=[sock])
        return 0

    try:
        return asyncio.run(main())
    except ApiError as e:
        raise EngineError(e.body["error"]["message"]) from None
