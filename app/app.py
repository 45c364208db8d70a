"""ChatApp: the aotx-chat screen, its actions and its user-facing behaviour.

Owns: layout (sidebar, chat, attachment chips, input, status bar), every user
action (bindings.ACTIONS), opening and rendering conversations, attachments from
pastes, /attach and the file picker, themes. The engine connection, the send
queue and streaming live in ``engine_link.EngineLink``.

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
from textual.widgets import Footer, Static

from aotx.app import state as app_state
from aotx.app.attach import make_attachment
from aotx.app.bindings import ACTIONS, app_bindings
from aotx.app.engine_link import DEFAULT_TITLE, EngineLink, Outgoing
from aotx.app.format import position_of, refusal_text, shown_text
from aotx.app.paste import parse_pasted_paths
from aotx.app.screens.details import DetailsScreen
from aotx.app.screens.file_picker import FilePicker
from aotx.app.screens.help import HelpScreen
from aotx.app.screens.model_picker import ModelPicker
from aotx.app.screens.prompts import Confirm, TextPrompt
from aotx.app.screens.settings import SettingsScreen
from aotx.app.theming import CSS_PATHS, THEMES
from aotx.app.widgets.chat_input import ChatInput
from aotx.app.widgets.chips import AttachmentBar
from aotx.app.widgets.message import MessageWidget
from aotx.app.widgets.sidebar import Sidebar
from aotx.app.widgets.status_bar import StatusBar
from aotx.engine.errors import AotxError, EngineError, ErrorCode
from aotx.engine.ipc import protocol as P
from aotx.engine.ipc.client import ConnectionLost

ClientFactory = Callable[[Callable[[str], None]], Awaitable[Any]]
STATUS_POLL_S = 2.0


class ChatApp(EngineLink, App):
    TITLE = "aotx-chat"
    CSS_PATH = CSS_PATHS
    BINDINGS = app_bindings()

    def __init__(self, client_factory: ClientFactory, *, theme: str | None = None,
                 status_poll_s: float = STATUS_POLL_S, default_sampling: P.SamplingParams | None = None) -> None:
        super().__init__()
        self.client_factory = client_factory
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
        self.next_model = ""  # the model of the next conversation this app creates ("": the engine's default)

    # ---- layout ------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield Sidebar(id="sidebar")
            with Vertical(id="chat-pane"):
                yield VerticalScroll(id="chat")
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
        self.apply_theme(self.theme_name, remember=False)
        self.chat.anchor()
        self.chat_input.focus()
        self.start_engine()
        if self.status_poll_s > 0:
            self.set_interval(self.status_poll_s, self.poll_status)

    # ---- themes ------------------------------------------------------------

    def apply_theme(self, name: str, remember: bool = True) -> None:
        for other in THEMES:
            self.remove_class(f"theme-{other}")
        self.add_class(f"theme-{name}")
        self.theme = THEMES[name].textual_theme
        self.theme_name = name
        if remember:
            self.saved_state = app_state.update_state(theme=name)

    def action_toggle_theme(self) -> None:
        names = list(THEMES)
        self.apply_theme(names[(names.index(self.theme_name) + 1) % len(names)])
        self.notify(f"Theme: {self.theme_name}")

    # ---- notices -----------------------------------------------------------

    def show_notice(self, text: str, severity: str = "information") -> None:
        """A line above the input that stays until the next send (plus a toast for problems)."""
        line = self.query_one("#input-notice", Static)
        line.update(text)
        line.set_class(not text, "empty")
        if severity != "information":
            self.notify(text, severity=severity)

    # ---- conversations -----------------------------------------------------

    async def refresh_conversations(self) -> None:
        if self.client is not None:
            self.sidebar.set_conversations(await self.client.list_conversations(), self.conv_id)

    def set_open_conversation(self, conv_id: str | None, view: P.ConversationView | None) -> None:
        self.conv_id, self.conv_view = conv_id, view
        self.sidebar.current = conv_id
        model = view.model if view is not None and view.model else self.next_model
        self.status_bar.set_conversation_model(model)
        self.sub_title = model
        if conv_id and conv_id != self.saved_state.last_conversation:
            self.saved_state = app_state.update_state(last_conversation=conv_id)

    async def open_conversation(self, conv_id: str | None) -> None:
        """Show a conversation's history from the engine (None: an empty new one)."""
        view = await self.client.show(conv_id) if conv_id and self.client else None
        self.set_open_conversation(conv_id, view)
        self.editing = None
        self.chat_input.remove_class("editing")
        await self.chat.remove_children()
        self.chat_widgets = {}
        widgets = []
        for m in view.messages if view else []:
            w = MessageWidget(m.role, shown_text(m.text), msg_id=m.msg_id, position=position_of(m),
                              attachments=m.attachments)
            w.receipt, w.seq, w.finish_reason = m.receipt, m.seq, m.finish_reason
            w.n_tokens = len(m.token_ids)
            self.chat_widgets[m.msg_id] = w
            widgets.append(w)
        # replies still on their way to this conversation stay live
        for item in ([self.active] if self.active else []) + self.outbox:
            if item.conv_id == conv_id and not item.accepted and item.widget not in widgets:
                widgets.append(item.widget)
        if widgets:
            await self.chat.mount_all(widgets)
        else:
            await self.chat.mount(Static("Type a message below. F1 lists every key.", id="chat-empty"))
        for w, m in zip(widgets, view.messages if view else []):
            if m.status == "interrupted":
                w.add_notice("The engine stopped while writing this reply; the part that reached the disk is kept.",
                             "interrupted")
        self.sidebar._fill()
        self.chat.scroll_end(animate=False)

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
            await self.open_conversation(event.conv_id)
            self.chat_input.focus()

    # ---- sending -----------------------------------------------------------

    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text.strip()
        if text.startswith("/attach"):
            self.chat_input.clear()
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
        self.chat_input.clear()
        self.show_notice("")
        w = MessageWidget("user", text, position="queued", attachments=atts)
        await self.add_message_widget(w)
        if not self.ready:
            self.show_notice("The engine is still starting; your message is queued and will be sent when it is ready.")
        self.enqueue(Outgoing(text, atts, w, self.conv_id, truncate_from=cut))

    async def _remove_from(self, first: MessageWidget) -> None:
        ms = self.messages()
        for w in ms[ms.index(first):] if first in ms else []:
            self.chat_widgets.pop(w.msg_id, None)
            await w.remove()

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
            self.show_notice("Not attached: " + "; ".join(problems), severity="warning")
        else:
            self.show_notice(f"Attached {len(results)} file(s) to the next message.")

    def on_chat_input_paths_pasted(self, event: ChatInput.PathsPasted) -> None:
        self.attach_paths(event.paths)

    async def on_paste(self, event: events.Paste) -> None:
        """A paste that no focused text box took (e.g. the sidebar had focus)."""
        items = parse_pasted_paths(event.text)
        if items and all(i.kind == "path" for i in items):
            self.attach_paths([i.value for i in items])
        elif items:
            self.chat_input.insert(event.text)
            self.chat_input.focus()

    # ---- actions -----------------------------------------------------------

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_focus_input(self) -> None:
        self.chat_input.focus()

    def action_toggle_sidebar(self) -> None:
        self.sidebar.display = not self.sidebar.display

    def action_search(self) -> None:
        self.sidebar.display = True
        self.sidebar.query_one("#search").focus()

    @work(group="ui")
    async def action_new_conversation(self) -> None:
        if self.client is None:
            await self.open_conversation(None)
            return
        conv = await self._call(self.client.create_conversation(title=DEFAULT_TITLE, sampling=self.default_sampling,
                                                                model=self.next_model))
        if conv is not None:
            await self.refresh_conversations()
            await self.open_conversation(conv.conv_id)
        self.chat_input.focus()

    @work(group="ui")
    async def action_cancel(self) -> None:
        if self.editing is not None:
            self.editing = None
            self.chat_input.remove_class("editing")
            self.chat_input.clear()
            self.show_notice("Left edit mode.")
            return
        item = self.active
        if item is None or not item.accepted or self.client is None:
            return
        self.show_notice("Cancelling the reply…")
        await self._call(self.client.cancel(target=item.request_id, conv_id=item.conv_id or ""))

    async def action_retry(self) -> None:
        if self.active is not None:
            self.show_notice("A reply is still being written: Esc cancels it first.", "warning")
            return
        user = self.last_message("user")
        if user is None or not user.msg_id:
            self.show_notice("Nothing to retry yet.")
            return
        self.query_one(AttachmentBar).take()
        for a in user.attachments:
            self.query_one(AttachmentBar).add(a)
        await self.send(user.text, truncate_from=user)

    def action_edit_last(self) -> None:
        user = self.last_message("user")
        if user is None or not user.msg_id or self.active is not None:
            self.show_notice("No sent message to edit (or a reply is still running).")
            return
        self.editing = user
        self.chat_input.text = user.text
        self.chat_input.add_class("editing")
        self.chat_input.focus()
        self.show_notice("Editing your last message: Enter resends it (later messages are dropped), Esc leaves.")

    def action_copy_last(self) -> None:
        w = self.last_message("assistant")
        if w is not None:
            w.action_copy()

    def action_details_last(self) -> None:
        w = self.last_message()
        if w is not None:
            self.push_screen(DetailsScreen(w))

    def on_message_widget_details_requested(self, event: MessageWidget.DetailsRequested) -> None:
        self.push_screen(DetailsScreen(event.widget))

    def on_message_widget_fork_requested(self, event: MessageWidget.ForkRequested) -> None:
        self.fork_at(event.widget)

    def action_fork(self) -> None:
        """Fork at the focused message, or at the last one."""
        focused = self.focused
        self.fork_at(focused if isinstance(focused, MessageWidget) else self.last_message())

    @work(group="ui")
    async def fork_at(self, w: MessageWidget | None) -> None:
        """A new conversation with this one's messages up to and including ``w``
        (the engine copies them and reuses this conversation's state), opened at once."""
        if self.conv_id is None or self.client is None or w is None:
            self.show_notice("Nothing to fork yet: send a message first.")
            return
        if not w.msg_id:
            self.show_notice("That message has not reached the engine yet; fork once it is accepted.")
            return
        if self.active is not None and self.active.reply_id and self.active.reply_id == w.msg_id:
            self.show_notice("That reply is still being written: fork once it is finished (Esc cancels it).")
            return
        parent = self.conv_view.title if self.conv_view else self.conv_id
        ms = self.messages()
        n = ms.index(w) + 1 if w in ms else 0
        view = await self._call(self.client.fork(self.conv_id, w.msg_id))
        if view is None:
            return
        await self.refresh_conversations()
        await self.open_conversation(view.conv_id)
        self.show_notice(f"Forked “{parent}” after message {n} of {len(ms)} into “{view.title}”; "
                         "the original is unchanged (it is in the sidebar).")
        self.chat_input.focus()

    @work(group="ui")
    async def action_rename(self) -> None:
        if self.conv_id is None or self.client is None:
            return
        title = await self.push_screen_wait(TextPrompt("Rename conversation", self.conv_view.title if self.conv_view else ""))
        if title and await self._call(self.client.rename(self.conv_id, title), ok=True):
            if self.conv_view:
                self.conv_view.title = title
            await self.refresh_conversations()

    @work(group="ui")
    async def action_delete(self) -> None:
        if self.conv_id is None or self.client is None:
            return
        title = self.conv_view.title if self.conv_view else self.conv_id
        if not await self.push_screen_wait(Confirm(f"Delete the conversation “{title}”?")):
            return
        if await self._call(self.client.delete(self.conv_id), ok=True):
            await self.refresh_conversations()
            rest = self.sidebar.conversations
            await self.open_conversation(rest[0].conv_id if rest else None)

    @work(group="ui")
    async def action_pick_model(self) -> None:
        """Ctrl+O: the model picker; the choice is the open conversation's model from its
        next message on (the history is kept), or the next new conversation's."""
        if self.client is None:
            self.show_notice("the engine is not connected yet", "warning")
            return
        listed = await self._call(self.client.list_models())
        if listed is None:
            return
        current = (self.conv_view.model if self.conv_view is not None else "") or self.next_model or \
            next((m.name for m in listed.models if m.default), "")

        async def chosen(name: str | None) -> None:
            if not name or name == current:
                return
            if self.conv_id is None:
                self.next_model = name
                self.status_bar.set_conversation_model(name)
                self.show_notice(f"new conversations run on {name}")
                return
            view = await self._call(self.client.switch_model(self.conv_id, name))
            if view is not None:
                self.conv_view = view
                self.status_bar.set_conversation_model(name)
                self.sub_title = name
                self.show_notice(f"this conversation runs on {name} from the next message: {name} reads its history "
                                 f"again; {current}'s saved state stays valid for {current}")
                await self.refresh_conversations()

        self.push_screen(ModelPicker(listed.models, current), chosen)

    @work(group="ui")
    async def action_settings(self) -> None:
        if self.conv_id is None or self.client is None:
            self.show_notice("Send a message or create a conversation first.")
            return
        view = await self._call(self.client.show(self.conv_id))
        if view is None:
            return
        result = await self.push_screen_wait(SettingsScreen(view.system_prompt, view.sampling))
        if result is not None:
            prompt, sampling = result
            if await self._call(self.client.update(self.conv_id, system_prompt=prompt, sampling=sampling), ok=True):
                self.show_notice("Saved the system prompt and sampling of this conversation.")

    @work(group="ui")
    async def action_attach(self) -> None:
        path = await self.push_screen_wait(FilePicker())
        if path:
            self.attach_paths([path])

    async def _call(self, aw: Awaitable, ok: bool = False):
        """Await an engine request; show its failure instead of raising."""
        try:
            result = await aw
            return True if ok else result
        except ConnectionLost:
            self.connection_lost()
        except AotxError as e:
            code = e.code if isinstance(e, EngineError) else ""  # the engine's code, when it answered
            self.show_notice(refusal_text(code, str(e)), "error")
            if code == ErrorCode.NOT_FOUND:  # deleted by another client: show what is left
                await self.refresh_conversations()
        return None

    # ---- command palette ---------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for a in ACTIONS:
            if a.action != "quit":
                yield SystemCommand(a.title, f"{a.help} ({a.key})", lambda a=a: self.call_later(self.run_action, a.action))
