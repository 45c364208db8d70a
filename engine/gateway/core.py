"""The gateway's core: what every API module asks of the engine for one request.

Owns: the ``Gateway`` object the routes are bound to: the key check and the body
(``limits.py``), finding or making a request's conversation (``X-AOTX-Conversation``,
a response continued, or a new one holding the request's earlier turns), routing a
request's ``model`` to an engine model (404 naming the close ones), the engine's model
list (asked at most once a second), ``/health``, storing media parts, and running one
``Spec`` (``begin``, ``collect``, ``generate``: JSON, or a stream with the client
watched) through the renderer of the API that asked. Leaves the shapes of each API to
its module (``openai.py``, ``anthropic.py``, ``responses.py``), one generation's events
to ``generation.py`` and the engine to ``ipc.client``.

A multi-turn request on a fresh conversation stores its earlier turns as the new
conversation's history (``CreateConversation.messages``), so the chat template sees
them as real turns. A request naming a conversation but ending with several ``tool``
messages (a parallel call's results: a turn takes one message) gets a new conversation
holding its whole history, named in ``X-AOTX-Conversation``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aotx.engine import protocol as P
from aotx.engine.errors import AotxError, EngineError, ErrorCode, close_matches
from aotx.engine.gateway import media as M
from aotx.engine.gateway import schema as S
from aotx.engine.gateway import shapes
from aotx.engine.gateway.auth import KeyRing
from aotx.engine.gateway.generation import ChoiceState, Generation, call_id_prefix
from aotx.engine.gateway.limits import ApiError, GatewayConfig, InFlight, authenticate, engine_gone, read_json
from aotx.engine.gateway.link import EngineLink, engine_error
from aotx.engine.gateway.ollama import KeepAlive
from aotx.engine.gateway.streaming import ClientGone, EventStream, race_disconnect
from aotx.engine.ipc.client import ConnectionLost, EngineClient
from aotx.engine.model import tool_calls
from aotx.engine.units import short_title

_CONV_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_ALIAS = "local"  # a request's ``model`` that means the engine's default model (Gateway.route)
MODEL_LIST_TTL_S = 1.0  # the engine's model list is asked at most this often
Spec = S.Spec


def tool_run(turns: list[S.Turn]) -> int:
    """How many ``tool`` messages end ``turns`` (the results of one parallel call)."""
    n = 0
    for t in reversed(turns):
        if t.role != "tool":
            break
        n += 1
    return n


class Gateway:
    """The endpoints. ``keys``: the KeyRing; ``link``: the EngineLink."""

    api_error = ApiError  # for the API modules (responses.py, anthropic.py)

    def engine_error(self, ev: P.Error) -> ApiError:
        return engine_error(ev, None, self.cfg.retry_after_s)

    def __init__(self, cfg: GatewayConfig, keys: KeyRing, link: EngineLink):
        self.cfg = cfg
        self.keys = keys
        self.link = link
        self.inflight = InFlight(cfg)
        self._model_cache: tuple[float, list[P.ModelInfo]] | None = None
        self.metrics: Any = None  # metrics.Metrics, when the app counts (``create_app``)
        self.keep_alive = KeepAlive(self)  # Ollama's keep_alive: models the gateway unloads when idle

    # -- auth and body --

    def _auth(self, request: Request) -> str:
        return authenticate(self.keys, request)

    async def _json(self, request: Request) -> Any:
        return await read_json(request, self.cfg.limits.max_body_bytes)

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
                raise engine_gone(e, self.cfg.retry_after_s) from None
            except EngineError as e:
                code = e.code  # the engine's error code (the client library sets it)
                if code != ErrorCode.NOT_FOUND:
                    raise engine_error(P.Error(id=0, code=code, message=str(e)), None,
                                        self.cfg.retry_after_s) from None
                raise ApiError(404, f"X-AOTX-Conversation: {e}", "not_found_error",
                               param="X-AOTX-Conversation", code="conversation_not_found") from None
            if not conv_id and tool_run(list(history) + ([last] if last is not None else [])) > 1:
                hdr = None  # several new tool results: a new conversation with the request's history
                system = system if system is not None else view.system_prompt
                model = model or view.model
        if hdr:
            if system is not None and system != (view.system_prompt or ""):
                try:
                    await client.update(hdr, system_prompt=system)
                except EngineError as e:
                    raise engine_error(P.Error(id=0, code=e.code, message=str(e)), None,
                                        self.cfg.retry_after_s) from None
            if context and context != view.context:   # the request's context_policy, from this turn on
                try:
                    await client.set_context(hdr, context)
                except EngineError as e:
                    raise engine_error(P.Error(id=0, code=e.code, message=str(e)), None,
                                        self.cfg.retry_after_s) from None
            return hdr, False
        try:
            conv = await client.create_conversation(title=short_title(title), system_prompt=system,
                                                    messages=[(t.role, t.text, t.meta) for t in history],
                                                    model=model, origin="gateway", context=context)
        except ConnectionLost as e:
            raise engine_gone(e, self.cfg.retry_after_s) from None
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
        self.link.remember(models)
        return models

    async def route(self, name: str | None) -> str:
        """The engine model a request's ``model`` names ("" the default): an installed or
        loaded model by name (an id of ``/v1/models``; ``NAME.gguf`` and case aside), or
        ``DEFAULT_ALIAS`` ("local") for the engine's default. Any other name is answered
        as OpenAI and vLLM do: 404 ``model_not_found``, naming the close ones."""
        if name and name.endswith(":latest"):  # Ollama's clients name a model with its tag
            name = name.removesuffix(":latest")
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


    @property
    def device(self) -> str:
        """The engine's device ("cpu" or "cuda"), as its welcome said."""
        c = self.link._client
        return c.welcome.device if c is not None else ""

    async def embeddings(self, texts: list[str], model: str, pooling: str, normalize: bool, truncate: bool,
                         dims: Any = None, dims_field: str = "dimensions") -> P.Embeddings:
        """The engine's ``Embed`` of ``texts`` on ``model`` ("" the default). ``dims``: the
        width a client asked for, refused (400 naming ``dims_field``) unless it is the
        model's own. Raises ApiError for the engine's refusals."""
        client = await self.link.get()
        try:
            e = await client.embed(texts, model=model, pooling=pooling, normalize=normalize, truncate=truncate)
        except ConnectionLost as lost:
            raise engine_gone(lost, self.cfg.retry_after_s) from None
        except EngineError as err:
            raise engine_error(P.Error(id=0, code=err.code, message=str(err)), None, self.cfg.retry_after_s) from None
        if dims is not None:
            width = len(e.vectors[0])
            if isinstance(dims, bool) or not isinstance(dims, int) or dims != width:
                raise ApiError(400, f"'{dims_field}' is {dims!r}: this model's embeddings have {width} dimensions "
                                    "(they cannot be shortened)", "invalid_request_error", param=dims_field,
                               code="unsupported_parameter")
        self._model_cache = None  # it may have loaded a model
        return e

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
        target_kind = "gguf"
        if spec.tools.active and target:
            target_kind = next((m.kind for m in await self._models() if m.name == target), "gguf")
        if spec.tools.forced:
            grammar = tool_calls.call_grammar(spec.tools.tools, family,
                                              name=spec.tools.name if spec.tools.choice == "function" else None,
                                              parallel=spec.tools.parallel)
            constraint = P.Constraint(kind="lark", grammar=grammar, field="tool_choice")
        elif spec.tools.active and constraint is None and not spec.prefill and target_kind == "gguf":
            # "auto": free text until the model opens a call, then only a declared tool and
            # arguments its schema takes (a remote model's server holds its own calls)
            constraint = P.Constraint(kind="lark", grammar=tool_calls.auto_grammar(
                spec.tools.tools, family, parallel=spec.tools.parallel), field="tools")
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
            await race_disconnect(request, gen.start(spec.last.text, spec.sampling, raw=not spec.chat,
                                                      model=target, **after, **fields))
        except ApiError as e:
            if not after or e.status != 409:
                raise
            # another turn came after the message this one continues (a concurrent continuation
            # of the same response): this one branches from it in a fork of its own
            try:
                fork = await client.fork(conv_id, at_msg_id=spec.after)
            except ConnectionLost as lost:
                raise engine_gone(lost, self.cfg.retry_after_s) from None
            gen = Generation(client, fork.conv_id, True, self.cfg, n=spec.n)
            gen.model, gen.family = target, family
            await race_disconnect(request, gen.start(spec.last.text, spec.sampling, raw=not spec.chat,
                                                      model=target, **fields))
        self._model_cache = None  # it may have loaded a model
        return gen

    def states(self, spec: Spec, gen: Generation) -> list[ChoiceState]:
        """One state per choice; tool calls are named after their reply (``call_<reply id>_<i>``),
        so a call id stays meaningful after a restart (the Responses API checks them)."""
        fam = gen.family
        names = frozenset(tool_calls.tool_names(spec.tools.tools)) if fam else None
        return [ChoiceState(i, fam, spec.logprobs >= 0, call_id_prefix(gen.accepted[i].reply_id)
                            if i in gen.accepted else "", on_complete=lambda i=i: gen.stop(i), names=names)
                for i in range(spec.n)]

    async def collect(self, gen: Generation, reply: shapes.Reply, states: list[ChoiceState]) -> None:
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
                raise engine_error(ev, None, self.cfg.retry_after_s)
        if not gen.all_committed:
            raise ApiError(502, "the engine ended the reply without finishing it", "server_error")
        self._finish_reply(gen, reply, states)
        if any(c.finish_reason == "error" for c in gen.committed.values()):
            raise ApiError(500, "the engine failed while generating this reply", "server_error",
                           code="generation_failed", aotx=gen.aotx())

    def _finish_reply(self, gen: Generation, reply: shapes.Reply, states: list[ChoiceState]) -> None:
        reply.choices = [st.choice for st in states]
        for st in states:
            st.choice.aotx = gen.aotx(st.index)
        reply.aotx = gen.aotx(0)
        if len(states) > 1:
            reply.aotx["choices"] = [gen.aotx(st.index) for st in states]
        if self.metrics is not None:
            self.metrics.reply(gen, reply)

    async def generate(self, request: Request, key: str, spec: Spec, api: Any) -> Response:
        """Run ``spec`` and answer in ``api``'s shapes (``CHAT``, ``COMPLETION``, or the
        Responses and Messages renderers): JSON, or server-sent events when streaming."""
        self.inflight.enter(key)
        handed_over = False
        gen: Generation | None = None
        try:
            gen = await self.begin(request, spec)
            reply = shapes.Reply(id=api.new_id(), model=gen.model or self.link.model)
            headers = {"X-AOTX-Conversation": gen.conv_id}
            states = self.states(spec, gen)
            if spec.stream:
                body = api.stream(self, gen, reply, spec, states)

                async def on_close(gone: bool) -> None:
                    if gone:
                        await gen.abandon()
                    self.inflight.leave(key)

                handed_over = True
                return EventStream(body, headers, on_close, getattr(api, "media_type", None))
            try:
                await race_disconnect(request, self.collect(gen, reply, states))
            except ApiError as e:
                return api.error(e)
            headers["X-AOTX-Receipt"] = json.dumps(reply.aotx["receipt"], separators=(",", ":"))
            return JSONResponse(await api.final(self, gen, reply, spec), headers=headers)
        except ClientGone:
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
