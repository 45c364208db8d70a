"""One generation: a message submitted to the engine, and its choices as they stream.

Owns: ``Generation`` (submit, read events up to every choice's ``Accepted`` so refusals
become HTTP statuses before a response starts, then the rest until every choice has
its final receipt; cancel when the client leaves; stop a choice whose tool calls are
complete), ``ChoiceState`` (one choice's text, tool calls and logprobs as its events
arrive, split into ``Out`` pieces by the tool-call parser of the model's family) and
the background tasks of cancels sent without waiting. Leaves the HTTP shapes to the
API modules and the conversation to ``core.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from aotx.engine import protocol as P
from aotx.engine.errors import AotxError
from aotx.engine.gateway import shapes
from aotx.engine.gateway.limits import ApiError, GatewayConfig, engine_gone
from aotx.engine.gateway.link import engine_error
from aotx.engine.ipc.client import ConnectionLost, EngineClient
from aotx.engine.model import tool_calls


def call_id_prefix(reply_id: str) -> str:
    """Tool calls are named after their reply (``call_<reply id>_<i>``), so a call id
    stays meaningful after a restart (the Responses API checks them)."""
    return f"call_{reply_id}_"


class Generation:
    """One message submitted to the engine and the events of its ``n`` choices.

    ``start`` reads events up to every choice's ``Accepted`` (so refusals become HTTP
    statuses before a response starts); ``events`` yields the rest and stops once every
    choice has its final receipt, or ``durable_timeout_s`` after the last ``Committed``."""

    def __init__(self, client: EngineClient, conv_id: str, created: bool, cfg: GatewayConfig, n: int = 1):
        self.client = client
        self.conv_id = conv_id
        self.created = created
        self.cfg = cfg
        self.n = n
        self.accepted: dict[int, P.Accepted] = {}
        self.committed: dict[int, P.Committed] = {}
        self.receipts: dict[int, P.Receipt] = {}
        self.user_receipt: P.Receipt | None = None
        self._agen: AsyncIterator[P.Message] | None = None
        self._done = False
        self.constraint_field = ""
        self.model = ""  # the engine model it runs on ("" the default)
        self.cuts: list[P.ContextCut] = []  # where the prompt left earlier messages out (context notices)
        self.family: str | None = None  # its model's tool-call format (None: no tools)

    # one-choice views (the first choice)
    @property
    def receipt(self) -> P.Receipt | None:
        return self.receipts.get(0)

    @property
    def all_committed(self) -> bool:
        return len(self.committed) >= self.n

    async def _next(self) -> P.Message | None:
        try:
            return await self._agen.__anext__()
        except StopAsyncIteration:
            self._done = True
            return None
        except ConnectionLost as e:
            self._done = True
            raise engine_gone(e, self.cfg.retry_after_s) from None

    async def start(self, text: str, sampling: P.SamplingParams, raw: bool, model: str = "", **fields) -> None:
        """Submit (on ``model``; "" the conversation's); return once every choice is
        accepted. Raises ApiError for a refusal."""
        c = fields.get("constraint")
        self.constraint_field = c.field if c is not None else ""
        self._agen = self.client.submit(self.conv_id, text, sampling=sampling, raw=raw, model=model, **fields)
        refused: P.Notice | None = None
        while True:
            ev = await self._next()
            if ev is None:
                raise ApiError(502, "the engine ended the request without accepting it", "server_error")
            if isinstance(ev, P.Notice):
                if ev.kind == "refused":
                    refused = ev
                elif ev.cut is not None and ev.choice == 0:
                    self.cuts.append(ev.cut)
            elif isinstance(ev, P.Error):
                self._done = True
                if self.created:
                    await self._forget()
                raise engine_error(ev, refused, self.cfg.retry_after_s, self.constraint_field)
            elif isinstance(ev, P.Accepted):
                self.accepted[ev.choice] = ev
                if len(self.accepted) >= self.n:
                    return
            elif isinstance(ev, P.Durable) and ev.msg_id and ev.choice == 0:
                self.user_receipt = ev.receipt

    async def events(self) -> AsyncIterator[P.Message]:
        while not self._done:
            if self.all_committed:
                try:
                    ev = await asyncio.wait_for(self._next(), self.cfg.durable_timeout_s)
                except asyncio.TimeoutError:
                    self._done = True
                    return
            else:
                ev = await self._next()
            if ev is None:
                return
            if isinstance(ev, P.Accepted):
                self.accepted[ev.choice] = ev
            elif isinstance(ev, P.Notice) and ev.cut is not None and ev.choice == 0:
                self.cuts.append(ev.cut)
            elif isinstance(ev, P.Committed):
                self.committed[ev.choice] = ev
            elif isinstance(ev, P.Durable):
                a = self.accepted.get(0)
                if a is not None and ev.msg_id == a.msg_id:
                    self.user_receipt = ev.receipt
                for ch, cm in self.committed.items():
                    if ev.receipt.last_seq >= cm.seq and (ev.choice == ch or ev.choice == 0):
                        self.receipts.setdefault(ch, ev.receipt)
            elif isinstance(ev, P.Error):
                self._done = True
            yield ev

    def aotx(self, choice: int = 0) -> dict[str, Any]:
        """The ``aotx`` object of a reply's choice: conversation, message ids, receipts, and
        ``context``: where its prompt left earlier messages out (the engine's cuts), if it did."""
        a = self.accepted.get(choice)
        return {"conversation": a.conv_id if a else self.conv_id, "msg_id": a.msg_id if a else None,
                "reply_id": a.reply_id if a else None, "receipt": shapes.receipt_dict(self.receipts.get(choice)),
                "user_receipt": shapes.receipt_dict(self.user_receipt),
                **({"context": [msgspec.to_builtins(c) for c in self.cuts]} if self.cuts and choice == 0 else {})}

    async def abandon(self) -> None:
        """The client went away: cancel the generation unless it finished. The
        cancel is sent without waiting for the engine's answer (it comes after
        the current tick), so the HTTP side is released at once."""
        if not self.all_committed:
            a = self.accepted.get(0)
            if a is not None:
                op = self.client.cancel(target=a.id)
            else:
                op = self.client.cancel(conv_id=self.conv_id)
            task = asyncio.ensure_future(op)
            background.add(task)
            task.add_done_callback(settle)
        if self._agen is not None:
            try:
                await self._agen.aclose()
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - closing a half-read stream
                pass

    def stop(self, choice: int) -> None:
        """End a choice's generation early (its tool calls are complete): a cancel sent
        without waiting; the engine commits what it has. Only for one choice per request
        (a cancel stops every choice of its request)."""
        a = self.accepted.get(choice)
        if a is None or self.n != 1 or choice in self.committed:
            return
        task = asyncio.ensure_future(self.client.cancel(target=a.id))
        background.add(task)
        task.add_done_callback(settle)

    async def _forget(self) -> None:
        try:
            await self.client.delete(self.conv_id)
        except (AotxError, OSError):
            pass


@dataclass
class Out:
    """One piece of a choice's stream, as every API renders it: ``kind`` "content"
    (``text``), "call" (a tool-call delta: ``call`` = (index, id or None, name or None,
    arguments text)), "logprob" (``entry``: a chat logprobs entry) or "finish"."""

    kind: str
    choice: int
    text: str = ""
    call: tuple | None = None
    entry: dict[str, Any] | None = None


class ChoiceState:
    """One choice's text, tool calls and logprobs as its events arrive; ``token`` and
    ``committed`` return the ``Out`` pieces to send (the tool-call parser of the model's
    family splits content from calls as the text streams)."""

    def __init__(self, index: int, family: str | None, logprobs: bool, call_prefix: str = "",
                 on_complete: Callable[[], None] | None = None, names: frozenset[str] | None = None):
        self.index = index
        # called once when the parser finds the reply's calls complete and the model
        # repeating them (``StreamParser.complete``): the generation may be stopped
        self.on_complete = on_complete
        self._stopped = False
        # ``names``: the declared tools; a call to another stays text (tool_calls.StreamParser)
        self.parser = tool_calls.StreamParser(family, call_prefix, names=names) if family else None
        self.sent = ""
        self.logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self.choice = shapes.Choice(index=index, logprobs=self.logprobs)
        self._calls: dict[int, dict[str, Any]] = {}
        self.content = ""

    def _text(self, t: str) -> list[Out]:
        if not t:
            return []
        if self.parser is None:
            self.content += t
            return [Out("content", self.index, text=t)]
        out = self._delta(self.parser.feed(t))
        if self.parser.complete and not self._stopped:
            self._stopped = True
            if self.on_complete is not None:
                self.on_complete()
        return out

    def _delta(self, d) -> list[Out]:
        out = []
        if d.content:
            self.content += d.content
            out.append(Out("content", self.index, text=d.content))
        for call in d.calls:
            i, cid, name, args = call
            c = self._calls.get(i)
            if c is None:
                c = self._calls[i] = {"index": i, "id": cid, "type": "function", "function": {"name": name,
                                                                                            "arguments": ""}}
            c["function"]["arguments"] += args
            out.append(Out("call", self.index, call=call))
        return out

    def token(self, ev: P.Token) -> list[Out]:
        out = []
        # the end-of-generation token is no token of the content: OpenAI's logprobs list only
        # the returned text's tokens
        if self.logprobs is not None and ev.logprob is not None and not ev.end:
            e = shapes.logprob_entry(ev.piece, ev.logprob, ev.top)
            self.logprobs.append(e)
            out.append(Out("logprob", self.index, entry=e))
        self.sent += ev.text
        return out + self._text(ev.text)

    def committed(self, ev: P.Committed) -> list[Out]:
        rest = ev.text[len(self.sent):] if ev.text.startswith(self.sent) else ""
        self.sent = ev.text
        out = self._text(rest)
        if self.parser is not None:
            out += self._delta(self.parser.finish())
        ch = self.choice
        ch.text = self.content if self.parser is not None else ev.text
        ch.tool_calls = [{k: v for k, v in c.items() if k != "index"} for _, c in sorted(self._calls.items())]
        # calls complete and then repeated: the reply ended at its calls, whether the
        # stop came first (cancelled) or max_tokens did
        ch.finish_reason = "tool_calls" if self.parser is not None and self.parser.complete and ch.tool_calls \
            else ev.finish_reason
        ch.n_completion = ev.n_completion
        ch.stop_sequence = ev.stop
        out.append(Out("finish", self.index, text=ch.finish))
        return out


background: set[asyncio.Future] = set()


def settle(task: asyncio.Future) -> None:
    background.discard(task)
    if not task.cancelled():
        task.exception()  # a lost engine or a finished request: nothing to do
