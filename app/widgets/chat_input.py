"""The message input: multi-line, Enter sends, Ctrl+J inserts a newline.

Owns: key handling of the input and catching pastes that are file paths (they
become attachments instead of text). Leaves what a send means to the app.
"""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from aotx.app.paste import parse_pasted_paths

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

    class PathsPasted(Message):
        def __init__(self, paths: list[str]) -> None:
            self.paths = paths
            super().__init__()

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        items = parse_pasted_paths(event.text)
        if items and all(i.kind == "path" for i in items):
            event.stop()
            event.prevent_default()
            self.post_message(self.PathsPasted([i.value for i in items]))
            return
        await super()._on_paste(event)
        event.stop()
