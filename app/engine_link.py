"""The app's side of the engine connection: connect, poll, send, stream, recover.

Owns: the connection worker (connect or start an engine, wait for the model to
load, show progress), the status poll (budget, and the conversation list: a
conversation another client added or changed shows up, and the search index is kept
in step), the outgoing queue (messages typed before the engine is ready or while a
reply runs wait here), streaming one submitted message's events into its widgets
and the status line (tokens/s, context), and recovery when the connection is lost
(say so, reconnect, which restarts the engine, and reload the open conversation
from the engine, where an interrupted reply shows as such).
Leaves to others: widgets and user actions (``app.py``, ``actions.py``).

A mixin of ``ChatApp``; it uses the app's ``client_factory``, ``chat``, ``status_bar``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from textual.css.query import NoMatches

from aotx.engine.present.format import error_text, media_text, notice_text, refusal_head, refusal_text
from aotx.app.widgets.message import MessageWidget
from aotx.engine.errors import AotxError, EngineError, ErrorCode
from aotx.engine.units import short_title
from aotx.engine import protocol as P
from aotx.engine.ipc.client import ConnectionLost, model_label

DEFAULT_TITLE = "New conversation"
FOLLOW_S = 0.5  # how often a reply the engine writes for nobody here is looked at again


@dataclass
class Outgoing:
    """A message on its way: shown at once, sent when the engine can take it."""

    text: str
    attachments: list[P.Attachment]
    widget: MessageWidget
    conv_id: str | None
    truncate_from: str | None = None
    accepted: bool = False
    request_id: int = 0
    reply: MessageWidget | None = None
    reply_id: str = ""
    events: list[str] = field(default_factory=list)
    had_history: bool = False  # the conversation had messages before this one
    refusal: P.Notice | None = None  # the engine's ``refused`` notice, said once with the Error after it


class EngineLink:
    start_model: str = ""  # ``aotx-chat --model``: the first connection opens a new conversation on it

    # ---- connection --------------------------------------------------------

    engine_stopped: bool = False  # the engine said it was stopped: start one only when the user asks
    stopped_args: list[str] | None = None  # the flags of the engine that was stopped (its Welcome's)

    def start_engine(self, engine_args: list[str] | None = None) -> None:
        """Connect (starting an engine when none answers; with ``engine_args``, the flags of
        an engine that was stopped, instead of this app's own)."""
        self.ready = False
        self.run_worker(self._connect(engine_args), group="connect", exclusive=True, name="connect")

    def restart_stopped_engine(self) -> None:
        """The user sent a message, or pressed the key the screen names, after a stop: start
        an engine with the stopped one's flags."""
        if not self.engine_stopped:
            return
        self.engine_stopped = False
        self.recovering = True  # a restart: the open conversation is reloaded, not replaced
        self.show_notice("Starting the engine again…", kind="starting")
        self.start_engine(self.stopped_args)

    def _on_spawn(self, line: str) -> None:
        """What a starting engine says (the spawn line, then its progress: reading the weights,
        compiling kernels N of M on a first start): the status line, and the line above the
        input, which has the room for the progress bar at 80 columns."""
        self.status_bar.set_state("starting engine", line)
        if self.recovering and not self.outbox and self.notice_kind == "connecting":  # after a crash: say both
            self.show_notice(f"The engine stopped (connection lost). Restarting it: {line}", kind="connecting")
        else:
            self.show_notice(f"Starting the engine: {line}", kind="starting")

    async def _connect(self, engine_args: list[str] | None = None) -> None:
        delay = 0.5
        while True:
            self.status_bar.set_state("connecting")
            try:
                if engine_args is None:
                    client = await self.client_factory(self._on_spawn)
                else:
                    client = await self.client_factory(self._on_spawn, engine_args=engine_args)
                break
            except (AotxError, OSError) as e:
                if getattr(e, "engine_exit", None) == 2 and not self.recovering:
                    # at the first start (a restart after a crash is `recovering`), the engine this
                    # app started refused its arguments (a model name that names nothing, an
                    # architecture it cannot run): retrying cannot help; one line, exit 2
                    self.exit(return_code=2, message=f"aotx-chat: {e.engine_message}")
                    return
                self.status_bar.set_state("engine unavailable", f"{e}; retrying")
                self.show_notice(f"Cannot reach the engine: {e}. Retrying in {delay:.0f} s.", kind="connecting")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.client = client
        self.status_bar.set_welcome(client.welcome)
        self.sidebar.default_model = client.welcome.model
        try:
            while True:
                s = await client.status()
                self.status_bar.set_status(s)
                if s.ready:
                    break
                await asyncio.sleep(0.25)
            self.ready = True
            if self.notice_kind in ("starting", "connecting"):
                self.show_notice("")
            recovering, self.recovering = self.recovering, False
            if recovering and engine_args is not None:
                self.show_notice("The engine is running again." + (" Your message is on its way." if self.outbox
                                                                     else ""))
            elif recovering:
                self.show_notice("The engine is back. Everything it had made durable is here.")
            for line in s.notices:  # e.g. journal damage the engine salvaged at its start
                self.show_notice(line, "warning")
            await self.refresh_conversations()
            await self.sync_conversations(client)
            target = self.conv_id or self.saved_state.last_conversation
            known = {c.conv_id for c in self.sidebar.conversations}
            if target not in known:  # the newest chat (a one-shot `aotx run` is not where one goes on)
                chats = [c for c in self.sidebar.conversations if not c.origin] or self.sidebar.conversations
                target = chats[0].conv_id if chats else None
            start_model, self.start_model = self.start_model, ""
            if start_model and self.conv_id is None and not recovering:
                # --model: a new conversation on it, not the last one on whatever model it had
                target = None
                name = model_label(start_model)
                self.status_bar.set_conversation_model(name)
                self.show_notice(f"New conversation on {name}: it loads beside the engine's default "
                                 f"({client.welcome.model}) at your first message.", kind="model")
            if target is not None and (recovering or target != self.conv_id or not self.chat_widgets):
                await self.open_conversation(target)
        except ConnectionLost:
            self.connection_lost()
            return
        self.pump()

    async def _wait_ready(self) -> None:
        client = self.client
        try:
            while True:
                s = await client.status()
                self.status_bar.set_status(s)
                if s.ready:
                    break
                await asyncio.sleep(0.25)
        except ConnectionLost:
            self.connection_lost()
            return
        self.ready = True
        self.pump()

    def connection_lost(self) -> None:
        """The engine went away. Stopped (``aotx stop``: it said so before closing): say so and
        wait for the user's next message (or F10) to start one with the stopped engine's flags.
        Crashed: say so, mark what was streaming, start it again at once and reload."""
        if self.recovering or self.engine_stopped:
            return
        client = self.client  # the connection that was lost (callers check it is still the app's)
        for w in self.chat_widgets.values():
            if w.position in ("accepted", "committed") and w.role == "assistant" and not w.finish_reason:
                w.set_position("interrupted")
        self.ready, self.client = False, None
        if getattr(client, "stopped", False):
            self.engine_stopped = True
            self.stopped_args = list(getattr(client.welcome, "engine_args", None) or [])
            self.status_bar.set_state("engine stopped", "Enter starts it")
            self.show_notice(f"The engine was stopped. Your next message starts it again on "
                             f"{self.status_bar.model or 'the same model'} (or press Enter now).", kind="stopped")
            return
        self.recovering = True
        self.status_bar.set_state("engine stopped", "restarting")
        self.show_notice("The engine stopped (connection lost). Restarting it and reloading this conversation…",
                         kind="connecting")
        self.notify("The engine stopped; restarting it.", severity="warning")
        self.start_engine()

    def poll_status(self) -> None:
        if self.client is not None and self.ready and not self.recovering:
            self.run_worker(self._status_once(), group="status", exclusive=True, name="status")

    async def _status_once(self) -> None:
        client = self.client
        try:
            self.status_bar.set_status(await client.status())
            await self.sync_conversations(client)
        except ConnectionLost:
            if client is self.client:
                self.connection_lost()
        except AotxError:
            pass
        except NoMatches:
            pass        # the reply came back while the app was closing: its widgets are gone

    async def sync_conversations(self, client=None) -> None:
        """Bring the sidebar and the search index in step with the engine's table: a
        conversation another client added, renamed, continued or deleted shows up here
        without a restart."""
        client = client or self.client
        if client is None:
            return
        convs = await client.list_conversations()
        key = sorted((c.conv_id, c.title, c.updated_at) for c in convs)
        if key != sorted((c.conv_id, c.title, c.updated_at) for c in self.sidebar.conversations):
            self.sidebar.set_conversations(convs, self.conv_id)
        changed, gone = self.index.stale(convs)
        for cid in gone:
            self.index.drop(cid)
        if changed:
            self.run_worker(self._index_conversations(client, changed), group="index", name="index")

    async def _index_conversations(self, client, conv_ids: list[str]) -> None:
        for i, cid in enumerate(conv_ids):
            try:
                self.index.put(await client.show(cid))
            except (ConnectionLost, AotxError):
                return
            if i % 8 == 7:  # many at start: leave the engine's other clients room between them
                await asyncio.sleep(0.01)
        if self.sidebar.query_text:
            self.sidebar._fill()

    # ---- a reply the engine is still writing --------------------------------

    def follow(self, conv_id: str, msg_id: str) -> None:
        """Show a reply the engine is still writing that this app did not ask for (an
        earlier aotx-chat that was closed or killed mid-reply, or another client): the
        engine finishes it, and the widget follows it until it is done (never "cancelled")."""
        self.run_worker(self._follow_reply(conv_id, msg_id), group="follow", exclusive=True, name="follow")

    async def _follow_reply(self, conv_id: str, msg_id: str) -> None:
        from aotx.engine.present.format import position_of

        while True:
            await asyncio.sleep(FOLLOW_S)
            w = self.chat_widgets.get(msg_id)
            if self.conv_id != conv_id or self.client is None or w is None:
                return
            try:
                view = await self.client.show(conv_id)
            except (ConnectionLost, AotxError):
                return
            m = next((m for m in view.messages if m.msg_id == msg_id), None)
            if m is None:
                return
            w.n_tokens = len(m.token_ids)
            done = m.status not in ("streaming", "accepted")
            if done:
                w.finish_reason, w.receipt, w.seq = m.finish_reason, m.receipt, m.seq
            if m.text != w.text or done:
                await w.finish(m.text)
            if done:
                w.set_position(position_of(m))
                self.index.put(view)
                return

    # ---- sending -----------------------------------------------------------

    def enqueue(self, item: Outgoing) -> None:
        self.outbox.append(item)
        if self.engine_stopped:
            self.restart_stopped_engine()
        self.pump()

    def pump(self) -> None:
        """Send the next queued message when the engine is ready and idle for us."""
        if not self.ready or self.client is None or self.active is not None or not self.outbox:
            return
        self.active = self.outbox.pop(0)
        self.run_worker(self._stream(self.active), group="stream", name="stream")

    async def _stream(self, item: Outgoing) -> None:
        client = self.client
        # until the engine accepts it the status line says what happens: its attachments are
        # read (OCR, speech) or it is sent; a model loading for it says so (a "model" notice)
        self.status_bar.set_state("reading attachments" if item.attachments else "sending",
                                  ", ".join(a.name for a in item.attachments))
        try:
            await self._ensure_conversation(client, item)
            if item.truncate_from:
                await client.truncate(item.conv_id, item.truncate_from)
                item.truncate_from = None
            async for ev in client.submit(item.conv_id, item.text, attachments=item.attachments):
                item.events.append(type(ev).__name__)
                if await self._on_event(item, ev) == "retry":
                    self.outbox.insert(0, item)
                    self.active = None
                    self.ready = False
                    self.run_worker(self._wait_ready(), group="connect", exclusive=True, name="wait-ready")
                    return
        except ConnectionLost:
            if not item.accepted:
                self.outbox.insert(0, item)  # never reached the engine: send it again later
            self.active = None
            if client is self.client:
                self.connection_lost()
            return
        except AotxError as e:
            target = item.reply or item.widget
            target.set_position("failed")
            code = e.code if isinstance(e, EngineError) else ""
            why = refusal_text(code, str(e), "this message")
            if item.accepted:
                target.add_notice(why, "error")
            else:
                target.add_notice(f"Not sent: {refusal_head(code)}. The reason is above the input.", "error")
                self.refused_before_accept(item, why)
            self.status_bar.reply_finished()
        finally:
            if self.active is item:
                self.active = None
        self.pump()

    async def _ensure_conversation(self, client, item: Outgoing) -> None:
        # a title from the first line, cut at a word (as `aotx run` makes one)
        first_line = short_title(item.text.strip().splitlines()[0], 48) if item.text.strip() else DEFAULT_TITLE
        if item.conv_id is None:
            conv = await client.create_conversation(title=first_line, sampling=self.default_sampling,
                                                    model=getattr(self, "next_model", ""))
            item.conv_id = conv.conv_id
            for other in self.outbox:
                if other.conv_id is None:
                    other.conv_id = conv.conv_id
            if self.conv_id is None:
                self.set_open_conversation(conv.conv_id, conv)
            await self.refresh_conversations()
        elif self.conv_view is not None and self.conv_view.conv_id == item.conv_id \
                and self.conv_view.title == DEFAULT_TITLE and not self.conv_view.messages:
            await client.rename(item.conv_id, first_line)
            self.conv_view.title = first_line
            await self.refresh_conversations()

    def _live(self, msg_id: str, fallback: MessageWidget | None) -> MessageWidget | None:
        """The widget showing ``msg_id`` now (the conversation may have been reopened)."""
        return self.chat_widgets.get(msg_id, fallback)

    async def _on_event(self, item: Outgoing, ev: P.Message) -> str | None:
        user = self._live(item.widget.msg_id, item.widget) if item.widget.msg_id else item.widget
        reply = self._live(item.reply_id, item.reply) if item.reply_id else None
        if isinstance(ev, P.Accepted):
            if item.widget.position == "queued" and not self.outbox:
                self.show_notice("")  # "still starting; queued" no longer holds
            item.accepted, item.request_id, item.reply_id = True, ev.id, ev.reply_id
            user.msg_id, user.seq = ev.msg_id, ev.seq
            user.set_position("accepted")
            item.reply = MessageWidget("assistant", msg_id=ev.reply_id, position="accepted")
            item.reply.request_id = ev.id
            if ev.model and self.conv_id == item.conv_id:
                self.status_bar.set_conversation_model(ev.model)  # the model that answers, whatever was asked
            self.status_bar.reply_started(len(ev.prompt_ids))
            if self.conv_id == item.conv_id:
                self.chat_widgets[ev.msg_id] = user
                await self.add_message_widget(item.reply)
        elif isinstance(ev, P.Token):
            if reply.position == "accepted":
                reply.set_position("committed")
            reply.token_seqs.append(ev.seq)
            reply.add_delta(ev.text)
            self.status_bar.reply_token()
        elif isinstance(ev, P.Notice) and ev.kind == "refused":
            item.refusal = ev  # the Error that follows says it, once
        elif isinstance(ev, P.Notice):
            if ev.kind == "model" and ev.message.startswith("loading model") and not item.accepted:
                self.status_bar.set_state("loading model", ev.message[len("loading model"):].strip())
            (reply or user).add_notice(notice_text(ev, item.had_history), ev.kind)
            if ev.cut is not None and reply is not None:   # the details view shows the reply's cut
                reply.context = ev.cut
        elif isinstance(ev, P.MediaInfo):
            user.add_notice(media_text(ev), "media" if not ev.error else "error")
        elif isinstance(ev, P.Committed):
            reply.finish_reason, reply.seq, reply.timings = ev.finish_reason, ev.seq, dict(ev.timings)
            reply.n_tokens = ev.n_completion or reply.n_tokens
            await reply.finish(ev.text or reply.text)
            reply.set_position("cancelled" if ev.finish_reason == "cancelled" else "committed")
            t = ev.timings
            self.status_bar.reply_finished(ev.n_prompt, ev.n_completion,
                                           t.get("decode_tokens_per_s", t.get("tokens_per_s", 0.0)))
            self.run_worker(self._index_conversations(self.client, [item.conv_id]), group="index", name="index")
        elif isinstance(ev, P.Durable):
            r = ev.receipt
            if reply is not None:
                reply.durable_seq = max(reply.durable_seq, r.last_seq)  # its tokens up to here are on disk
            if user.receipt is None and (ev.msg_id == user.msg_id or (user.seq and r.last_seq >= user.seq)):
                user.receipt = r
                user.set_position("durable")
            if reply is not None and reply.finish_reason and (ev.msg_id == reply.msg_id or r.last_seq >= reply.seq):
                reply.receipt = r
                if reply.position == "committed":
                    reply.set_position("durable")
        elif isinstance(ev, P.Error):
            if ev.code == ErrorCode.NOT_READY and not item.accepted:
                return "retry"
            target = reply or user
            target.set_position("failed")
            why = error_text(ev, item.refusal)
            if item.accepted:
                target.add_notice(why, "error")
            else:  # the reason once, above the input (refused_before_accept); the message says what kind
                target.add_notice(f"Not sent: {refusal_head(ev.code, getattr(item.refusal, 'resource', ''))}. "
                                  f"The reason is above the input.", "error")
            if reply is not None:
                await reply.finish()
            if not item.accepted:
                self.refused_before_accept(item, why)
            self.status_bar.reply_finished()
        return None
