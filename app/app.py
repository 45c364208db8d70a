"""ChatApp: the aotx-chat screen, its layout and its user-facing behaviour.

Owns: layout (sidebar, chat, attachment chips, input, status bar; at 80x24 the sidebar
narrows and folds its legend), opening and rendering conversations (a reopened
message shows what its attachments became, as it did live), sending, attachments
from pastes, /attach and the file picker (checked at attach time), the search index
beside the sidebar, themes (AOTX's and Textual's built-in ones). The user's actions
live in ``actions.ChatActions``; the engine connection, the send queue, streaming
and keeping the list and index in step live in ``engine_link.EngineLink``.

The client comes from an injected ``client_factory(on_spawn) -> awaitable client``
(``main.py`` passes one that calls ``EngineClient.connect``; tests pass a fake), so
the app never starts an engine on its own: ``main.client_factory`` connects and, when
no engine answers (also after a crash), starts one with the same arguments.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from textual import events, work
from textual.app import App, ComposeResult, SystemCommand
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Input, Static, TextArea

from aotx.app import state as app_state
from aotx.app.actions import ChatActions
from aotx.engine.present.attach import make_attachment
from aotx.app.bindings import ACTIONS, app_bindings
from aotx.app.engine_link import EngineLink, Outgoing
from aotx.engine.present.format import cut_marker, history_media, media_text, position_of
from aotx.app.models_ui import ModelActions
from aotx.engine.present.paste import parse_pasted_paths, split_paste
from aotx.app.search import SearchIndex
from aotx.app.theming import CSS_PATHS, THEMES, textual_themes, theme_for_textual
from aotx.app.widgets.chat_input import ChatInput
from aotx.app.widgets.chips import AttachmentBar
from aotx.app.widgets.message import MessageWidget
from aotx.app.widgets.sidebar import Sidebar
from aotx.app.widgets.status_bar import StatusBar
from aotx.engine import protocol as P

ClientFactory = Callable[[Callable[[str], None]], Awaitable[Any]]
# what an empty chat shows (the first run, a new conversation): how to begin, and where the rest is
EMPTY_HINT = ("Type a message below and press Enter to send it (Ctrl+J: a new line).\n"
              "F1 lists every key · Ctrl+O picks the model · F5 or a dropped file attaches an image or audio · "
              "F3 searches")
STATUS_POLL_S = 2.0
NOTICE_TTL_S = 10.0  # how long a plain piece of news stays above the input
THEME_ORDER = list(THEMES)  # AOTX's own first (dark, light), then Textual's


class ChatApp(ChatActions, ModelActions, EngineLink, App):
    TITLE = "aotx-chat"
    CSS_PATH = CSS_PATHS
    BINDINGS = app_bindings()
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]

    def __init__(self, client_factory: ClientFactory, *, theme: str | None = None,
                 status_poll_s: float = STATUS_POLL_S, default_sampling: P.SamplingParams | None = None,
                 model: str = "") -> None:
        super().__init__()
        self.client_factory = client_factory
        # ``aotx-chat --model``: the app opens on a new conversation on that model (loaded beside
        # the engine's default at its first message), whether it started the engine or not
        self.next_model = model
        self.start_model = model
        self.default_sampling = default_sampling  # sampling of conversations this app creates (None: engine's)
        self.saved_state = app_state.load_state()
        self.theme_name = theme if theme in THEMES else (
            self.saved_state.theme if self.saved_state.theme in THEMES else "dark")
        self.status_poll_s = status_poll_s
        self.client = None
        self.ready = False
        self.recovering = False
        self.conv_id: str | None = None
        self.conv_view: P.ConversationView | None = None
        self.chat_widgets: dict[str, MessageWidget] = {}
        self.outbox: list[Outgoing] = []
        self.active: Outgoing | None = None
        self.editing: MessageWidget | None = None
        self.index = SearchIndex()
        self.notice_kind = ""  # what the line above the input says now ("attach", "refusal", ...)
        self._notice_serial = 0  # which notice shows (an expired one's timer clears only its own)
        self.notice_ttl_s = NOTICE_TTL_S

    # ---- layout ------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield Sidebar(self.index, id="sidebar")
            with Vertical(id="chat-pane"):
                yield VerticalScroll(Static(EMPTY_HINT, id="chat-empty", markup=False), id="chat")
                yield Static("", id="input-notice", classes="empty", markup=False)
                yield AttachmentBar(id="chips")
                yield ChatInput(id="input")
        yield StatusBar(id="status")
        yield Footer()

    @property
    def chat(self) -> VerticalScroll:
        return self.query_one("#chat", VerticalScroll)

    @property
    def sidebar(self) -> Sidebar:
        return self.query_one(Sidebar)

    @property
    def status_bar(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def chat_input(self) -> ChatInput:
        return self.query_one(ChatInput)

    def on_mount(self) -> None:
        for theme in textual_themes():  # AOTX's own themes in the palette's "Change theme" list
            self.register_theme(theme)
        self.apply_theme(self.theme_name, remember=False)
        self.theme_changed_signal.subscribe(self, self._on_textual_theme)
        self.chat.anchor()
        self.chat_input.focus()
        self.start_engine()
        if self.status_poll_s > 0:
            self.set_interval(self.status_poll_s, self.poll_status)

    # ---- themes ------------------------------------------------------------

    def apply_theme(self, name: str, remember: bool = True) -> None:
        t = THEMES[name]
        for other in THEMES.values():
            self.remove_class(other.css_class)
        self.add_class(t.css_class)
        self.theme_name = name
        self.theme = t.registered_name
        if remember:
            self.saved_state = app_state.update_state(theme=name)

    def _on_textual_theme(self, theme) -> None:
        """Textual's own "Change theme" command: take it as an AOTX theme and remember it."""
        name = theme_for_textual(theme.name)
        if name is not None and name != self.theme_name:
            self.apply_theme(name)

    def action_toggle_theme(self) -> None:
        self.apply_theme(THEME_ORDER[(THEME_ORDER.index(self.theme_name) + 1) % len(THEME_ORDER)])
        self.notify(f"Theme: {self.theme_name}")

    # ---- notices -----------------------------------------------------------

    def show_notice(self, text: str, severity: str = "information", kind: str = "") -> None:
        """A line above the input (plus a toast for problems). A plain piece of news (no
        ``kind``, information) goes after ``notice_ttl_s``; one that says how things stand
        (a refusal, attachments, a stopped engine, edit mode: a ``kind``) or a problem stays
        until what it says changes or the next send."""
        line = self.query_one("#input-notice", Static)
        line.update(text)
        line.set_class(not text, "empty")
        self.notice_kind = kind if text else ""
        self._notice_serial += 1
        if text and not kind and severity == "information" and self.notice_ttl_s > 0:
            serial = self._notice_serial
            self.set_timer(self.notice_ttl_s, lambda: self._expire_notice(serial))
        if severity != "information":
            self.notify(text, severity=severity)

    def _expire_notice(self, serial: int) -> None:
        if serial == self._notice_serial and self.is_running:
            self.show_notice("")

    # ---- conversations -----------------------------------------------------

    async def refresh_conversations(self) -> None:
        if self.client is not None:
            self.sidebar.set_conversations(await self.client.list_conversations(), self.conv_id)

    def set_open_conversation(self, conv_id: str | None, view: P.ConversationView | None) -> None:
        self.conv_id, self.conv_view = conv_id, view
        self.sidebar.current = conv_id
        self.status_bar.max_tokens = view.sampling.max_tokens if view is not None and view.sampling else None
        if conv_id != getattr(self, "_status_conv", None):  # the figures were another conversation's
            self._status_conv = conv_id
            self.status_bar.conversation_opened(sum(len(m.token_ids) for m in view.messages) if view else 0)
        self.show_conversation_model(view)
        if conv_id and conv_id != self.saved_state.last_conversation:
            self.saved_state = app_state.update_state(last_conversation=conv_id)

    def _drop_draft_attachments(self) -> None:
        """Another conversation opens: the chips of the message being written belonged
        to this one and must not go with the next one's first message."""
        dropped = self.query_one(AttachmentBar).take()
        if dropped or self.notice_kind == "attach":
            self.show_notice("")

    async def open_conversation(self, conv_id: str | None, focus_msg: str = "") -> None:
        """Show a conversation's history from the engine (None: an empty new one);
        ``focus_msg``: a message to scroll to and focus (a search hit)."""
        view = await self.client.show(conv_id) if conv_id and self.client else None
        if conv_id != self.conv_id:
            self._drop_draft_attachments()
        self.set_open_conversation(conv_id, view)
        if view is not None:
            self.index.put(view)
        self.editing = None
        self.chat_input.remove_class("editing")
        await self.chat.remove_children()
        self.chat_widgets = {}
        widgets = []
        notes: list[list[tuple[str, str]]] = []
        for m in view.messages if view else []:
            text, infos = history_media(m) if m.role == "user" else (m.text, [])
            w = MessageWidget(m.role, text, msg_id=m.msg_id, position=position_of(m), attachments=m.attachments)
            w.receipt, w.seq, w.finish_reason, w.context = m.receipt, m.seq, m.finish_reason, m.context
            w.n_tokens = len(m.token_ids)
            self.chat_widgets[m.msg_id] = w
            widgets.append(w)
            ns = [(media_text(i), "error" if i.error else "media") for i in infos]
            if m.context is not None:   # its prompt left earlier messages out: the marker stays where it happened
                ns.append((cut_marker(m.context), "context"))
            if m.status == "interrupted":
                ns.append(("The engine stopped while writing this reply; the part that reached the disk is kept.",
                           "interrupted"))
            notes.append(ns)
        # replies still on their way to this conversation stay live
        for item in ([self.active] if self.active else []) + self.outbox:
            if item.conv_id == conv_id and not item.accepted and item.widget not in widgets:
                widgets.append(item.widget)
        if widgets:
            await self.chat.mount_all(widgets)
        else:
            await self.chat.mount(Static(EMPTY_HINT, id="chat-empty", markup=False))
        for w, ns in zip(widgets, notes):
            for text, kind in ns:
                w.add_notice(text, kind)
        mine = {self.active.reply_id} if self.active is not None else set()
        writing = [m for m in view.messages if m.role == "assistant" and m.status in ("streaming", "accepted")
                   and m.msg_id not in mine] if view else []
        if writing:  # the engine is still writing it (this app was closed mid-reply): follow it
            self.chat_widgets[writing[-1].msg_id].add_notice(
                "Still being written by the engine (it was asked before this window opened).", "notice")
            self.follow(conv_id, writing[-1].msg_id)
        self.sidebar.mark_current(conv_id)
        target = self.chat_widgets.get(focus_msg) if focus_msg else None
        if target is not None:
            self.call_after_refresh(self._focus_message, target)
        else:
            self.chat.scroll_end(animate=False)

    def _focus_message(self, w: MessageWidget) -> None:
        if w.is_mounted:
            w.focus()
            w.scroll_visible(animate=False, top=True)

    async def add_message_widget(self, w: MessageWidget) -> None:
        for empty in self.chat.query("#chat-empty"):
            await empty.remove()
        if w.msg_id:
            self.chat_widgets[w.msg_id] = w
        await self.chat.mount(w)
        self.chat.scroll_end(animate=False)

    def messages(self) -> list[MessageWidget]:
        return list(self.chat.query(MessageWidget))

    def last_message(self, role: str | None = None) -> MessageWidget | None:
        ms = [m for m in self.messages() if role is None or m.role == role]
        return ms[-1] if ms else None

    async def on_sidebar_opened(self, event: Sidebar.Opened) -> None:
        if self.client is not None:
            await self.open_conversation(event.conv_id, focus_msg=event.msg_id)
            if not event.msg_id:
                self.chat_input.focus()

    # ---- sending -----------------------------------------------------------

    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text.strip()
        if not text:  # Enter in an empty input: starts the engine after a stop, else nothing
            self.restart_stopped_engine()
            return
        if text.startswith("/attach"):
            rest = text[len("/attach"):].strip()
            items = parse_pasted_paths(rest)
            paths = [i.value for i in items if i.kind == "path"] or ([rest] if rest else [])
            if paths:
                self.attach_paths(paths)
            else:
                self.action_attach()
            return
        await self.send(text)

    async def send(self, text: str, truncate_from: MessageWidget | None = None) -> None:
        if self.editing is not None:
            truncate_from, self.editing = self.editing, None
            self.chat_input.remove_class("editing")
        cut = truncate_from.msg_id if truncate_from else None
        atts = self.query_one(AttachmentBar).take()
        if truncate_from is not None:
            await self._remove_from(truncate_from)
        self.show_notice("")
        had_history = bool(self.messages())  # earlier turns (a capsule notice helps only then)
        w = MessageWidget("user", text, position="queued", attachments=atts)
        await self.add_message_widget(w)
        if not self.ready:
            self.show_notice("The engine is still starting; your message is queued and will be sent when it is ready.",
                             kind="queued")
        self.enqueue(Outgoing(text, atts, w, self.conv_id, truncate_from=cut, had_history=had_history))

    async def _remove_from(self, first: MessageWidget) -> None:
        ms = self.messages()
        for w in ms[ms.index(first):] if first in ms else []:
            self.chat_widgets.pop(w.msg_id, None)
            await w.remove()

    def refused_before_accept(self, item: Outgoing, why: str) -> None:
        """A message the engine refused before accepting it (nothing was journaled): the
        reason, once, above the input, where the user looks (the message itself says only
        what kind of refusal it was; no toast), and the words back in an empty input to
        shorten or change."""
        back = not self.chat_input.text.strip() and self.conv_id == item.conv_id
        if back:
            self.chat_input.text = item.text
            self.chat_input.move_cursor(self.chat_input.document.end)
        self.show_notice(why + (" Your message is back in the input." if back else ""), kind="refusal")
        self.chat.scroll_end(animate=False)

    # ---- attachments -------------------------------------------------------

    def attach_paths(self, paths: list[str]) -> None:
        self._attach_worker(paths)

    @work(thread=True, group="attach")
    def _attach_worker(self, paths: list[str]) -> None:
        results = [make_attachment(p) for p in paths]
        self.call_from_thread(self._attach_done, results)

    def _attach_done(self, results) -> None:
        bar = self.query_one(AttachmentBar)
        problems = [r.problem for r in results if r.problem]
        for r in results:
            if r.attachment is not None:
                bar.add(r.attachment)
        if problems:
            self.show_notice("Not attached: " + "; ".join(problems), severity="warning", kind="attach")
        else:
            self._attach_notice()

    def _attach_notice(self) -> None:
        atts = self.query_one(AttachmentBar).attachments
        if atts:
            names = ", ".join(a.name for a in atts)
            self.show_notice(f"Attached to the next message: {names} (Tab to a chip, Delete removes it).",
                             kind="attach")
        elif self.notice_kind == "attach":
            self.show_notice("")

    def on_attachment_bar_changed(self, event: AttachmentBar.Changed) -> None:
        """A chip went away: the notice says what is left."""
        if self.notice_kind == "attach" or not event.bar.attachments:
            self._attach_notice()
        if event.focus_lost:
            self.chat_input.focus()

    def on_chat_input_paths_pasted(self, event: ChatInput.PathsPasted) -> None:
        self.attach_paths(event.paths)

    def on_chat_input_paste_note(self, event: ChatInput.PasteNote) -> None:
        self.show_notice(event.note, kind="attach")

    async def on_paste(self, event: events.Paste) -> None:
        """A paste that no focused text box took (e.g. the sidebar had focus). A paste
        into another text box (TextArea lets it bubble up here) or a dialog is not
        also put into the input."""
        if isinstance(self.focused, (TextArea, Input)) or self.screen is not self.screen_stack[0]:
            return
        split = split_paste(event.text)
        if split.paths:
            self.attach_paths(split.paths)
        if split.text:
            self.chat_input.insert_text(split.text)
        if split.note:
            self.show_notice(split.note, kind="attach")

    # ---- command palette ---------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for a in ACTIONS:
            if a.action != "quit":
                yield SystemCommand(a.title, f"{a.help} ({a.key})", lambda a=a: self.call_later(self.run_action, a.action))
