"""The user's actions on conversations: new, cancel, retry, edit, copy, details, fork,
rename, delete, settings, attach, export, and moving between messages.

Owns: what each key of ``bindings.ACTIONS`` does once the app has an engine (the app
keeps layout, rendering and sending: ``app.py``; the connection: ``engine_link.py``).
A mixin of ``ChatApp``: it uses the app's ``client``, ``conv_id``, ``conv_view``,
``chat_input``, ``sidebar``, ``show_notice``, ``open_conversation`` and ``send``.
"""

from __future__ import annotations

from collections.abc import Awaitable

from textual import work

from aotx.engine.units import plural
from aotx.app.engine_link import DEFAULT_TITLE
from aotx.engine.present.export import default_path, format_of, write_export
from aotx.engine.present.format import fork_title, refusal_text
from aotx.app.screens.details import DetailsScreen
from aotx.app.screens.file_picker import FilePicker
from aotx.app.screens.help import HelpScreen
from aotx.app.screens.prompts import Confirm, TextPrompt
from aotx.app.screens.settings import SettingsScreen
from aotx.app.widgets.chips import AttachmentBar
from aotx.app.widgets.message import MessageWidget
from aotx.engine.errors import AotxError, EngineError, ErrorCode
from aotx.engine.ipc.client import ConnectionLost


class ChatActions:
    # ---- moving around -----------------------------------------------------

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_focus_input(self) -> None:
        self.chat_input.focus()

    def action_toggle_sidebar(self) -> None:
        self.sidebar.display = not self.sidebar.display

    def action_search(self) -> None:
        self.sidebar.display = True
        self.sidebar.query_one("#search").focus()

    def on_message_widget_step(self, event: MessageWidget.Step) -> None:
        """Up/Down on a message: the previous/next message; past the last, the input."""
        ms = self.messages()
        if event.widget not in ms:
            return
        i = ms.index(event.widget) + event.by
        if i >= len(ms):
            self.chat_input.focus()
        elif i >= 0:
            ms[i].focus()
            ms[i].scroll_visible(animate=False)

    def on_chat_input_leave_up(self, _event) -> None:
        """Up in an empty input: the last message."""
        ms = self.messages()
        if ms:
            ms[-1].focus()
            ms[-1].scroll_visible(animate=False)

    # ---- conversations -----------------------------------------------------

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
        bar = self.query_one(AttachmentBar)
        bar.take()
        for a in user.attachments:
            bar.add(a)
        await self.send(user.text, truncate_from=user)

    def action_edit_last(self) -> None:
        user = self.last_message("user")
        if user is None or not user.msg_id or self.active is not None:
            self.show_notice("No sent message to edit (or a reply is still running).")
            return
        self.editing = user
        self.chat_input.text = user.text
        self.chat_input.move_cursor(self.chat_input.document.end)  # where one goes on typing
        self.chat_input.add_class("editing")
        self.chat_input.focus()
        self.show_notice("Editing your last message: Enter resends it (later messages are dropped), Esc leaves.",
                         kind="editing")

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
        (the engine copies them and reuses this conversation's state), opened at once,
        titled so that it is told from its original (``Trip (fork 1)``)."""
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
        title = fork_title(parent, [c.title for c in self.sidebar.conversations])
        if await self._call(self.client.rename(view.conv_id, title), ok=True):
            view.title = title
        await self.refresh_conversations()
        await self.open_conversation(view.conv_id)
        self.show_notice(f"Forked “{parent}” after message {n} of {len(ms)} into “{view.title}”; "
                         "the original is unchanged (it is in the sidebar).")
        self.chat_input.focus()

    @work(group="ui")
    async def action_rename(self) -> None:
        if self.conv_id is None or self.client is None:
            return
        current = self.conv_view.title if self.conv_view else ""
        title = await self.push_screen_wait(TextPrompt("Rename conversation", current))
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
            rest = [c for c in self.sidebar.conversations if not c.origin] or self.sidebar.conversations
            await self.open_conversation(rest[0].conv_id if rest else None)

    @work(group="ui")
    async def action_settings(self) -> None:
        if self.conv_id is None or self.client is None:
            self.show_notice("Send a message or create a conversation first.")
            return
        view = await self._call(self.client.show(self.conv_id))
        if view is None:
            return
        result = await self.push_screen_wait(SettingsScreen(view.system_prompt, view.sampling, view.context))
        if result is not None:
            prompt, sampling, policy = result
            if policy != view.context and not await self._call(self.client.set_context(self.conv_id, policy), ok=True):
                return
            if await self._call(self.client.update(self.conv_id, system_prompt=prompt, sampling=sampling), ok=True):
                if self.conv_view is not None and self.conv_view.conv_id == self.conv_id:
                    self.conv_view.sampling, self.conv_view.system_prompt = sampling, prompt
                self.status_bar.max_tokens = sampling.max_tokens
                self.status_bar.set_state(self.status_bar.state, self.status_bar.detail)
                self.show_notice("Saved the system prompt and sampling of this conversation.")

    @work(group="ui")
    async def action_export(self) -> None:
        """Ask where to (``.md`` Markdown, ``.json`` JSON), then write the open conversation."""
        if self.conv_id is None or self.client is None:
            self.show_notice("Nothing to export yet: send a message first.")
            return
        view = await self._call(self.client.show(self.conv_id))
        if view is None:
            return
        target = await self.push_screen_wait(TextPrompt("Export to (.md for Markdown, .json for JSON)",
                                                        str(default_path(view, "md"))))
        if not target:
            return
        from pathlib import Path

        path = Path(target).expanduser()
        if path.exists() and not await self.push_screen_wait(Confirm(f"{path} exists. Replace it?")):
            return
        try:
            written = write_export(view, path)
        except AotxError as e:
            self.show_notice(str(e), "error")
            return
        kind = "JSON" if format_of(written) == "json" else "Markdown"
        self.show_notice(f"Exported “{view.title}” ({plural(len(view.messages), 'message')}) to {written} as {kind}.")

    # ---- attachments -------------------------------------------------------

    @work(group="ui")
    async def action_attach(self) -> None:
        path = await self.push_screen_wait(FilePicker())
        if path:
            self.attach_paths([path])

    def action_clear_attachments(self) -> None:
        dropped = self.query_one(AttachmentBar).clear()
        if not dropped:
            self.show_notice("No attachments to remove.")

    # ---- engine calls ------------------------------------------------------

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
