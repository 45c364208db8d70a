"""One message in the chat: position glyph, text (Markdown), notices, attachments.

Owns: showing a message and its position live, and streaming a reply's text at a
cost proportional to the new text: token deltas are buffered and handed to a
``MarkdownView`` at most ~30 times a second (it re-renders only a bounded tail),
and the whole text is rendered once when the reply ends.
Leaves to others: talking to the engine (the app) and the details view.
"""

from __future__ import annotations

import bisect

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Static

from aotx.engine.present.format import FINISH_WORDS, GLYPHS
from aotx.app.widgets.markdown_view import CodeBlock, MarkdownView
from aotx.engine import protocol as P

FRAME_S = 1 / 30


class MessageWidget(Vertical, can_focus=True):
    """A user or assistant message. ``position`` is one of format.GLYPHS' keys."""

    BINDINGS = [
        Binding("c", "copy", "Copy message"),
        Binding("i", "details", "Details / receipt"),
        Binding("f", "fork", "Fork here"),
        Binding("up,k", "step(-1)", "Previous message", show=False),
        Binding("down,j", "step(1)", "Next message", show=False),
    ]

    class Step(Message):
        """Move focus ``by`` messages from this one (arrow keys)."""

        def __init__(self, widget: "MessageWidget", by: int) -> None:
            self.widget, self.by = widget, by
            super().__init__()

    class DetailsRequested(Message):
        def __init__(self, widget: "MessageWidget") -> None:
            self.widget = widget
            super().__init__()

    class ForkRequested(Message):
        """Fork the conversation at this message."""

        def __init__(self, widget: "MessageWidget") -> None:
            self.widget = widget
            super().__init__()

    def __init__(self, role: str, text: str = "", *, msg_id: str = "", position: str = "accepted",
                 attachments: list[P.Attachment] | None = None) -> None:
        super().__init__(classes=f"message {role}")
        self.role, self.text, self.msg_id, self.position = role, text, msg_id, position
        self.attachments = list(attachments or [])
        self.receipt: P.Receipt | None = None
        self.seq = 0
        self.n_tokens = 0
        self.finish_reason: str | None = None
        self.context: P.ContextCut | None = None  # a reply whose prompt left earlier messages out
        self.timings: dict[str, float] = {}
        self.request_id = 0
        self.token_seqs: list[int] = []  # sequence number of each streamed token
        self.durable_seq = 0  # the last sequence number a Durable receipt covered
        self._pending: list[str] = []
        self._timer = None
        self._early_notices: list[tuple[str, str]] = []  # added before the widget was mounted

    # ---- composition -------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(self._header_text(), classes="msg-header", markup=False)
        if self.attachments:
            yield Static("  ".join(f"[{a.kind}] {a.name}" for a in self.attachments), classes="msg-attachments",
                         markup=False)
        yield Vertical(classes="msg-notices msg-start-notices")  # admission and media notices come before the text
        if self.role == "assistant":
            yield MarkdownView(self.text, code_theme=self._code_theme(), final=self.position != "accepted",
                               classes="msg-body")
        else:
            yield Static(self.text, classes="msg-body", markup=False)
        # refusals come after it: a long message's refusal must be where the view is (its end)
        yield Vertical(classes="msg-notices msg-end-notices")

    def _header_text(self) -> str:
        who = "You" if self.role == "user" else "Assistant" if self.role == "assistant" else self.role
        words = self.position if self.position not in ("accepted", "committed", "durable") else ""
        if self.finish_reason and self.finish_reason not in ("stop", self.position):
            words = (words + " " if words else "") + f"({FINISH_WORDS.get(self.finish_reason, self.finish_reason)})"
        return f"{GLYPHS.get(self.position, '?')} {who} {words}".rstrip()

    # ---- position and notices ----------------------------------------------

    def set_position(self, position: str) -> None:
        self.position = position
        for p in GLYPHS:
            self.remove_class(f"pos-{p}")
        self.add_class(f"pos-{position}")
        headers = self.query(".msg-header") if self.is_mounted else None
        if headers:
            headers.first(Static).update(self._header_text())

    def on_mount(self) -> None:
        self.set_position(self.position)
        early, self._early_notices = self._early_notices, []
        for text, kind in early:
            self.add_notice(text, kind)

    def add_notice(self, text: str, kind: str = "notice") -> None:
        """A line under the header (admission, media), or for an error or refusal under
        the text, where the view is when it comes (never out of view)."""
        if not text:
            return
        line = Static(text, classes=f"msg-notice {kind}", markup=False)
        if self.is_mounted:
            where = ".msg-end-notices" if kind in ("error", "refused") else ".msg-start-notices"
            self.query_one(where, Vertical).mount(line)
        else:
            self._early_notices.append((text, kind))

    def notices(self) -> list[str]:
        return [str(s.render()) for s in self.query(".msg-notice").results(Static)]

    # ---- streaming ---------------------------------------------------------

    def add_delta(self, delta: str) -> None:
        """Buffer a token's text; it reaches the screen on the next frame."""
        self.text += delta
        self.n_tokens += 1
        self._pending.append(delta)
        if self._timer is None and self.is_mounted:
            self._timer = self.set_interval(FRAME_S, self._flush)

    async def _flush(self) -> None:
        if not self._pending or not self.is_mounted:
            return
        chunk = "".join(self._pending)
        self._pending.clear()
        view = self.query_one(MarkdownView)
        if view.final:  # a reply reloaded while streaming (after switching back): stream on from here
            new = MarkdownView(view.text, code_theme=self._code_theme(), final=False, classes="msg-body")
            await view.remove()
            await self.mount(new)
            view = new
        await view.append(chunk)

    def _code_theme(self) -> str:
        return "monokai" if self.app.current_theme.dark else "default"

    async def finish(self, text: str | None = None) -> None:
        """Stop streaming and render the whole text once."""
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self._pending.clear()
        if text is not None:
            self.text = text
        headers = self.query(".msg-header") if self.is_mounted else None
        if headers:  # composed (a widget still mounting shows self.text when it is)
            headers.first(Static).update(self._header_text())
            body = self.query_one(".msg-body")
            if isinstance(body, MarkdownView):
                await body.finalize(self.text)
            else:
                body.update(self.text)

    # ---- actions -----------------------------------------------------------

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.app.notify(f"Copied the message ({len(self.text)} characters).")

    def action_details(self) -> None:
        self.post_message(self.DetailsRequested(self))

    def action_fork(self) -> None:
        self.post_message(self.ForkRequested(self))

    def action_step(self, by: int) -> None:
        self.post_message(self.Step(self, by))

    @property
    def durable_tokens(self) -> int:
        """How many of the streamed tokens a receipt covers (they survive a crash)."""
        return bisect.bisect_right(self.token_seqs, self.durable_seq)

    def on_click(self, event: events.Click) -> None:
        node = event.widget
        while node is not None and node is not self:
            if isinstance(node, CodeBlock):
                self.app.copy_to_clipboard(node.code)
                self.app.notify("Copied the code block.")
                event.stop()
                return
            node = node.parent
