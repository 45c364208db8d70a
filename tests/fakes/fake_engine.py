"""A scripted stand-in for the engine, for UI tests, the typing benchmark and demos.

Owns: ``FakeEngine`` (conversations, sequence numbers and a pretend journal kept in
memory) and ``FakeEngineClient``, which has the methods of ``EngineClient`` that the
app uses and yields the event sequence the protocol documents: Accepted, Durable
(user message), Notice*, Token*, Committed, Durable (reply). It can be told to load
slowly, to send notices, to refuse media (or to turn it into text as the engine's
media profiles do, ``media_text``), to refuse a prompt longer than ``max_prompt_chars``
(too_long, as the engine does: a refused Notice, then an Error, nothing recorded), to
crash mid-reply, to be stopped (``stop``: as ``aotx stop``, its clients told so), and to
send each token only when the test lets it (``token_gate``); it
forks conversations, and refuses with the engine's error codes (``EngineError.code``:
not_found, busy).
Leaves to others: everything a real engine does (no model, no disk).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable

from aotx.engine.errors import EngineError, ErrorCode
from aotx.engine import protocol as P
from aotx.engine.ipc.client import ConnectionLost


def default_reply(text: str) -> str:
    return f"You said: **{text}**\n\n```python\nprint({text!r})\n```\n"


class FakeEngine:
    """The engine's state, shared by every client connected to it (it survives a
    client's reconnect; ``crash()`` ends every connection like a kill -9 would)."""

    def __init__(self, *, reply: Callable[[str], str] = default_reply, token_delay: float = 0.0,
                 chars_per_token: int = 4, load_steps: int = 0, notices: list[P.Notice] | None = None,
                 model: str = "SmolLM2-135M-Instruct Q4_1", device: str = "cpu",
                 media_text: Callable[[P.Attachment], str] | None = None, max_prompt_chars: int = 0,
                 n_ctx: int = 2048, token_gate: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.reply, self.token_delay, self.chars_per_token = reply, token_delay, chars_per_token
        self.load_steps, self.notices, self.model, self.device = load_steps, list(notices or []), model, device
        self.submit_models: list[str] = []      # each submit's ``model`` ("" = the conversation's)
        self.convs: dict[str, P.ConversationView] = {}
        self.seq = itertools.count(1)
        self.ids = itertools.count(1)
        self.offset = 0
        self.clients: list[FakeEngineClient] = []
        self.crash_after_tokens: int | None = None
        self.connects = 0
        self.hold_loading = False  # tests: keep "loading" until set back to False
        self.submitted: list[tuple[str, str, list[P.Attachment]]] = []
        self.cancelled: list[int] = []
        self.truncated: list[str] = []
        self.forked: list[tuple[str, str]] = []
        self.now = 1_700_000_000.0
        self.media_text = media_text
        self.max_prompt_chars = max_prompt_chars
        self.n_ctx = n_ctx
        self.token_gate = token_gate  # tests: awaited before token i is sent (a stream paced by the test)
        self.before_accept: list[P.Notice] = []  # notices sent before Accepted (a model loading for the message)
        self.accept_gate: Callable[[], Awaitable[None]] | None = None  # tests: awaited before Accepted
        self.answer_model = ""  # the model Accepted names ("": the conversation's)
        self.refuse: tuple[str, str, str] | None = None  # (resource, code, message): refuse every message
        self.down = False  # stopped: no engine answers until a client starts one (``connect``)
        self.spawned_with: list[list[str]] = []  # the engine_args of each engine a client started after a stop
        self.engine_args: list[str] = ["--model", "/models/fake.gguf", "--context", "2048"]  # its Welcome's

    async def connect(self, on_spawn: Callable[[str], None] | None = None, *,
                      engine_args: list[str] | None = None, spawn: bool = True) -> "FakeEngineClient":
        """The client factory the app takes: a new connection to this engine (after ``stop()``,
        a new engine is started with ``engine_args``, recorded in ``spawned_with``; with
        ``spawn`` false an EngineError instead, as no engine answers)."""
        if self.down:
            if not spawn:
                raise EngineError("no engine answers on the fake socket")
            self.down = False
            self.spawned_with.append(list(engine_args or []))
        self.connects += 1
        if on_spawn and self.connects > 1:
            on_spawn("started an engine in the background (pid 4242, log engine.log)")
        client = FakeEngineClient(self)
        self.clients.append(client)
        return client

    def stop(self) -> None:
        """``aotx stop``: every connection is told the engine was stopped, then closed; no
        engine answers until a client starts one."""
        for c in self.clients:
            c.stopped = True
        self.crash()
        self.down = True

    def add_conversation(self, title: str, messages: list[tuple[str, str]] = ()) -> P.ConversationView:
        conv = P.ConversationView(conv_id=f"c{next(self.ids)}", title=title, created_at=self._tick(),
                                  updated_at=self.now)
        for role, text in messages:
            conv.messages.append(self._message(role, text, status="complete", durable=True))
        conv.n_messages = len(conv.messages)
        self.convs[conv.conv_id] = conv
        return conv

    def crash(self) -> None:
        """Kill the engine: every open connection breaks; a reply being written is
        left as "interrupted" with the tokens that reached the journal."""
        for c in self.clients:
            c.closed = True
        for conv in self.convs.values():
            for m in conv.messages:
                if m.status == "streaming":
                    m.status = "interrupted"
            conv.busy = False

    def _tick(self) -> float:
        self.now += 1
        return self.now

    def _receipt(self, seq: int) -> P.Receipt:
        self.offset += 512
        return P.Receipt(segment=1, offset=self.offset, last_seq=seq)

    def _message(self, role: str, text: str, status: str, durable: bool) -> P.MessageView:
        seq = next(self.seq)
        return P.MessageView(msg_id=f"m{next(self.ids)}", role=role, text=text, status=status, seq=seq,
                             receipt=self._receipt(seq) if durable else None)


class FakeEngineClient:
    """One connection to a FakeEngine, with EngineClient's methods."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.closed = False
        self.stopped = False  # as EngineClient.stopped: the engine said it was stopped before closing
        self.welcome = P.Welcome(protocol=P.PROTOCOL_VERSION, engine="fake", model=engine.model,
                                 device=engine.device, ready=engine.load_steps == 0, pid=4242,
                                 engine_args=list(engine.engine_args))
        self._rids = itertools.count(1)
        self._cancel: set[int] = set()

    def _check(self) -> None:
        if self.closed or self.engine.down:
            raise ConnectionLost("the engine closed the connection")

    def _conv(self, conv_id: str) -> P.ConversationView:
        self._check()
        if conv_id not in self.engine.convs:
            raise refused(ErrorCode.NOT_FOUND, f"no conversation {conv_id!r}")
        return self.engine.convs[conv_id]

    async def close(self) -> None:
        self.closed = True

    async def status(self) -> P.StatusReply:
        self._check()
        e = self.engine
        progress = ""
        if e.load_steps > 0:
            e.load_steps -= 0 if e.hold_loading else 1
            progress = f"weights {100 - 25 * e.load_steps}%"
        budget = [P.BudgetLine("weights", 120 << 20), P.BudgetLine("kv", 96 << 20)]
        return P.StatusReply(id=0, model=e.model, device=e.device, ready=e.load_steps == 0, budget_bytes=1 << 30,
                             used_bytes=sum(b.bytes for b in budget), budget=budget, slots=[], n_ctx=e.n_ctx,
                             load_progress=progress, context_policy="rolling")

    async def list_conversations(self) -> list[P.ConversationView]:
        self._check()
        return [P.ConversationView(conv_id=c.conv_id, title=c.title, created_at=c.created_at,
                                   updated_at=c.updated_at, n_messages=len(c.messages), model=c.model,
                                   origin=c.origin)
                for c in self.engine.convs.values()]

    async def create_conversation(self, title: str = "", system_prompt: str | None = None,
                                  sampling: P.SamplingParams | None = None,
                                  messages: list | None = None, model: str = "", origin: str = "",
                                  context: str = "") -> P.ConversationView:
        self._check()
        conv = self.engine.add_conversation(title or "New conversation")
        conv.origin = origin
        conv.system_prompt, conv.sampling, conv.context = system_prompt, sampling, context
        conv.model = model or self.engine.model
        return conv

    async def list_models(self) -> P.ModelList:
        """The fake's models: its own (loaded, the default) and ``engine.extra_models``."""
        self._check()
        e = self.engine
        own = P.ModelInfo(name=e.model, size_bytes=98 << 20, arch="llama", quant="Q4_1", n_ctx_train=8192,
                          loaded=True, default=True, needs_bytes=216 << 20)
        return P.ModelList(id=0, models=[own, *getattr(e, "extra_models", [])], budget_bytes=1 << 30)

    async def switch_model(self, conv_id: str, model: str) -> P.ConversationView:
        conv = self._conv(conv_id)
        names = {m.name for m in (await self.list_models()).models}
        if model not in names:
            raise refused(ErrorCode.NOT_FOUND, f"no model named {model!r}")
        conv.model = model
        return conv

    async def set_context(self, conv_id: str, policy: str) -> P.ConversationView:
        conv = self._conv(conv_id)
        if policy not in ("", *P.CONTEXT_POLICIES):
            raise refused(ErrorCode.BAD_REQUEST, f"context policy {policy!r} is not one of rolling, middle, stop")
        conv.context = policy
        return conv

    async def show(self, conv_id: str) -> P.ConversationView:
        return self._conv(conv_id)

    async def delete(self, conv_id: str) -> None:
        self._conv(conv_id)
        del self.engine.convs[conv_id]

    async def rename(self, conv_id: str, title: str) -> None:
        self._conv(conv_id).title = title

    async def update(self, conv_id: str, system_prompt: str | None = None,
                     sampling: P.SamplingParams | None = None) -> None:
        conv = self._conv(conv_id)
        conv.system_prompt, conv.sampling = system_prompt, sampling

    async def truncate(self, conv_id: str, msg_id: str) -> None:
        conv = self._conv(conv_id)
        ids = [m.msg_id for m in conv.messages]
        if msg_id not in ids:
            raise refused(ErrorCode.NOT_FOUND, f"no message {msg_id!r} in {conv_id}")
        if conv.busy:
            raise refused(ErrorCode.BUSY, f"conversation {conv_id} is generating; cancel it first")
        self.engine.truncated.append(msg_id)
        del conv.messages[ids.index(msg_id):]

    async def fork(self, conv_id: str, at_msg_id: str = "") -> P.ConversationView:
        """A new conversation with ``conv_id``'s messages up to and including ``at_msg_id``."""
        conv = self._conv(conv_id)
        msgs = list(conv.messages)
        if at_msg_id:
            ids = [m.msg_id for m in msgs]
            if at_msg_id not in ids:
                raise refused(ErrorCode.NOT_FOUND, f"conversation {conv_id} has no message {at_msg_id!r}")
            msgs = msgs[:ids.index(at_msg_id) + 1]
        self.engine.forked.append((conv_id, at_msg_id))
        new = self.engine.add_conversation(f"{conv.title} (fork)")
        new.system_prompt, new.sampling = conv.system_prompt, conv.sampling
        new.messages = [self.engine._message(m.role, m.text, status=m.status if m.status != "streaming" else
                                             "interrupted", durable=True) for m in msgs]
        for old, m in zip(msgs, new.messages):
            m.finish_reason = old.finish_reason
        new.n_messages = len(new.messages)
        return new

    async def cancel(self, target: int = 0, conv_id: str = "") -> None:
        self._check()
        self.engine.cancelled.append(target)
        self._cancel.add(target)

    async def submit(self, conv_id: str, text: str, *, attachments: list[P.Attachment] | None = None,
                     sampling: P.SamplingParams | None = None, raw: bool = False,
                     wait_durable: bool = True, model: str = "") -> AsyncIterator[P.Message]:
        e, rid = self.engine, next(self._rids)
        conv = self._conv(conv_id)
        e.submit_models.append(model)
        e.submitted.append((conv_id, text, list(attachments or [])))
        if e.refuse is not None:  # (resource, code, message): refused before acceptance, as admission does
            resource, code, message = e.refuse
            yield P.Notice(id=rid, kind="refused", resource=resource, message=message)
            yield P.Error(id=rid, code=code, message=message)
            return
        if not self.welcome.ready and e.load_steps > 0:
            yield P.Error(id=rid, code=ErrorCode.NOT_READY, message="the model is still loading")
            return
        if attachments and e.media_text is None:
            yield P.Error(id=rid, code=ErrorCode.UNSUPPORTED_MEDIA,
                          message=f"this model has no media profile: {attachments[0].kind} input is not supported yet")
            return
        if e.max_prompt_chars and len(text) > e.max_prompt_chars:
            asked = len(text) // e.chars_per_token
            yield P.Notice(id=rid, kind="refused", resource="context", asked=asked, free=e.n_ctx,
                           message=f"the prompt of {asked} tokens does not fit the context of {e.n_ctx}")
            yield P.Error(id=rid, code=ErrorCode.TOO_LONG,
                          message=f"prompt of {asked} tokens does not fit the context of {e.n_ctx} tokens")
            return
        for n in e.before_accept:
            yield msgspec_replace(n, id=rid)
        if e.accept_gate is not None:
            await e.accept_gate()
        journaled = text
        if attachments:  # as the engine's media profiles do: the text the model receives
            from aotx.media.profile import MediaResult, render_for_prompt

            results = [MediaResult(a.kind, "specialist", e.media_text(a), 0.1, "fake-specialist", a.name)
                       for a in attachments]
            for r in results:
                yield P.MediaInfo(id=rid, kind=r.kind, route=r.route, name=r.source, text=r.text, via=r.model)
            journaled = render_for_prompt(results, text)
        user = e._message("user", journaled, status="complete", durable=False)
        user.attachments = list(attachments or [])
        conv.messages.append(user)
        reply = e._message("assistant", "", status="streaming", durable=False)
        conv.messages.append(reply)
        conv.busy, conv.updated_at = True, e._tick()
        prompt_ids = list(range(sum(len(m.text) for m in conv.messages) // e.chars_per_token + 8))
        yield P.Accepted(id=rid, conv_id=conv_id, msg_id=user.msg_id, reply_id=reply.msg_id, seq=user.seq, tick=1,
                         prompt_ids=prompt_ids, model=e.answer_model or conv.model or e.model)
        user.receipt = e._receipt(user.seq)
        yield P.Durable(id=rid, receipt=user.receipt, msg_id=user.msg_id)
        for n in e.notices:
            yield msgspec_replace(n, id=rid)
        full, step, reason = e.reply(text), e.chars_per_token, "stop"
        for i, k in enumerate(range(0, len(full), step)):
            if e.crash_after_tokens is not None and i >= e.crash_after_tokens:
                e.crash()
            if self.closed:
                raise ConnectionLost("the engine closed the connection in the middle of a reply")
            if e.token_gate is not None:
                await e.token_gate(i)
            if rid in self._cancel:
                reason = "cancelled"
                break
            reply.text += full[k:k + step]
            yield P.Token(id=rid, token_id=i, text=full[k:k + step], pos=i, tick=i + 2, seq=next(e.seq))
            await asyncio.sleep(e.token_delay)
        reply.status, reply.finish_reason, reply.seq = ("cancelled" if reason == "cancelled" else "complete",
                                                        reason, next(e.seq))
        conv.busy = False
        n = len(reply.text) // step
        yield P.Committed(id=rid, msg_id=reply.msg_id, finish_reason=reason, n_prompt=len(text) // step,
                          n_completion=n, tick=n + 2, seq=reply.seq, text=reply.text,
                          timings={"ttft_ms": 12.0, "tokens_per_s": 250.0})
        reply.receipt = e._receipt(reply.seq)
        yield P.Durable(id=rid, receipt=reply.receipt, msg_id=reply.msg_id)


def refused(code: ErrorCode, message: str) -> EngineError:
    """An EngineError as EngineClient raises it for an engine's Error reply."""
    return EngineError(message, code)


def msgspec_replace(notice: P.Notice, **changes) -> P.Notice:
    import msgspec

    return msgspec.structs.replace(notice, **changes)


