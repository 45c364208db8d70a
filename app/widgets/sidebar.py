"""The conversation list: search by title, select to open.

Owns: showing conversations (newest first) and filtering them by a title search.
Leaves create/rename/delete to the app, which refreshes the list afterwards.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView, Static

from aotx.app.format import GLYPHS
from aotx.engine.ipc import protocol as P


class ConversationItem(ListItem):
    """A conversation's title, and below it the model it runs on."""

    def __init__(self, conv: P.ConversationView) -> None:
        labels = [Label(conv.title or "(untitled)", markup=False)]
        if conv.model:
            labels.append(Label(conv.model, markup=False, classes="conv-model"))
        super().__init__(*labels)
        self.model = conv.model
        self.conv_id = conv.conv_id
        self.title = conv.title


class Sidebar(Vertical):
    """Search box and list of conversations. Posts ``Opened`` when one is chosen."""

    class Opened(Message):
        def __init__(self, conv_id: str) -> None:
            self.conv_id = conv_id
            super().__init__()

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.conversations: list[P.ConversationView] = []
        self.current: str | None = None

    def compose(self) -> ComposeResult:
        yield Label("Conversations", classes="sidebar-title")
        yield Input(placeholder="Search titles", id="search")
        yield ListView(id="conversations")
        yield Static("\n".join(f"{g} {name}" for name, g in GLYPHS.items()), id="legend", markup=False)

    def set_conversations(self, convs: list[P.ConversationView], current: str | None) -> None:
        self.conversations = sorted(convs, key=lambda c: (c.updated_at, c.created_at), reverse=True)
        self.current = current
        self._fill()

    def visible(self) -> list[str]:
        """Titles shown now (after the search filter)."""
        return [item.title for item in self.query(ConversationItem)]

    def _fill(self) -> None:
        needle = self.query_one("#search", Input).value.strip().lower()
        lv = self.query_one("#conversations", ListView)
        lv.clear()
        shown = [c for c in self.conversations if needle in (c.title or "").lower()]
        lv.extend(ConversationItem(c) for c in shown)
        for i, c in enumerate(shown):
            if c.conv_id == self.current:
                lv.index = i

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "search":
            event.stop()
            self._fill()

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ConversationItem):
            self.post_message(self.Opened(event.item.conv_id))
