"""The message input: multi-line, Enter sends, Ctrl+J inserts a newline.

Owns: key handling of the input and catching pastes that are dropped files (they
become attachments instead of text; text typed after the dropped paths stays text);
a path that names no image or audio file here (``/api/v1/users``) stays text.
Leaves what a send means to the app.
"""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from aotx.engine.present.paste import split_paste

NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")


class ChatInput(TextArea):
    """A TextArea where Enter sends and Ctrl+J (or Shift/Alt+Enter) breaks the line."""

    # TextArea takes f6 (select line) and f7 (select all); hand them to the app's actions.
    BINDINGS = [
        Binding("f6", "app.toggle_theme", "Next theme", show=False),
        Binding("f7", "app.details_last", "Details of last message", show=False),
    ]

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            self.text = text
            super().__init__()

    class LeaveUp(Message):
        """Up in the empty input: the app moves to the last message."""

    class PathsPasted(Message):
        def __init__(self, paths: list[str]) -> None:
            self.paths = paths
            super().__init__()

    class PasteNote(Message):
        """A paste that looked like a dropped file but went in as text: why."""

        def __init__(self, note: str) -> None:
            self.note = note
            super().__init__()

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                # emptied here, not when the app gets the message: keys typed meanwhile (the next
                # message, begun within a fraction of a second) land in the empty input and stay
                self.clear()
            # an empty input's Enter goes to the app too: it starts a stopped engine
            self.post_message(self.Submitted(text))
            return
        if event.key == "up" and not self.text:
            event.stop()
            event.prevent_default()
            self.post_message(self.LeaveUp())
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        """A paste of dropped files becomes attachments (the text typed after them goes
        into the input); any other paste is inserted once, as TextArea does.

        Textual calls ``_on_paste`` of every class in the MRO unless the default is
        prevented: calling TextArea's handler here without ``prevent_default()`` made
        it run twice and every paste appear twice."""
        event.stop()
        event.prevent_default()
        split = split_paste(event.text)
        if split.paths:
            self.post_message(self.PathsPasted(split.paths))
        if split.text:
            self.insert_text(split.text)
        if split.note:
            self.post_message(self.PasteNote(split.note))

    def insert_text(self, text: str) -> None:
        """Insert ``text`` at the cursor (replacing a selection), as a paste does."""
        if self.read_only:
            return
        if result := self._replace_via_keyboard(text, *self.selection):
            self.move_cursor(result.end_location)
        self.focus()
