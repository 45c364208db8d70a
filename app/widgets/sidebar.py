"""The conversation list: search titles and messages, select to open.

Owns: showing conversations (newest first, the open one marked ``▸`` and highlighted,
forks marked ``⑂``; one-shot ones, made by ``aotx run "..."`` or an API request, folded
into one line at the end that Enter opens and closes, unless open or found by a search),
and the search box: typing filters the list to the conversations
whose title or messages match (``search.SearchIndex``; a matching message's words
shown under the title), Enter opens the first hit at its message. Leaves
create/rename/delete and keeping the index in step to the app, which refreshes the
list afterwards.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView, Static

from aotx.engine.present.format import LEGEND_ITEMS
from aotx.app.search import Hit, SearchIndex
from aotx.engine import protocol as P


def is_fork(title: str) -> bool:
    return "(fork" in title


class ConversationItem(ListItem):
    def __init__(self, conv: P.ConversationView, current: bool, hit: Hit | None = None,
                 default_model: str = "") -> None:
        title = conv.title or "(untitled)"
        mark = "▸ " if current else "⑂ " if is_fork(title) else "  "
        children = [Label(mark + title, markup=False, classes="conv-title")]
        if conv.model and conv.model != default_model:  # the default model's conversations say nothing
            children.append(Label("  " + conv.model, markup=False, classes="conv-model"))
        if hit is not None and hit.snippet:
            children.append(Label("  " + hit.snippet, markup=False, classes="conv-snippet"))
        super().__init__(*children, classes="-current" if current else "")
        self.conv_id = conv.conv_id
        self.title = conv.title
        self.model = conv.model
        self.hit = hit


class OneShotsItem(ListItem):
    """The line that stands for the one-shot conversations: Enter shows or hides them."""

    def __init__(self, n: int, shown: bool) -> None:
        what = f"{n} one-shot run{'' if n == 1 else 's'}"
        super().__init__(Label(f"{'▾' if shown else '▹'} {what}" + (" (hide)" if shown else ""), markup=False,
                               classes="conv-group"))
        self.n, self.shown = n, shown


class NoHitsItem(ListItem):
    """What a search that matches nothing shows (not an empty list, which looks broken)."""

    def __init__(self, needle: str) -> None:
        super().__init__(Label(f"No conversation has “{needle}” in its title or messages.", markup=False,
                               classes="conv-group"), disabled=True)


class Sidebar(Vertical):
    """Search box and list of conversations. Posts ``Opened`` when one is chosen."""

    class Opened(Message):
        def __init__(self, conv_id: str, msg_id: str = "") -> None:
            self.conv_id, self.msg_id = conv_id, msg_id
            super().__init__()

    def __init__(self, index: SearchIndex | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.conversations: list[P.ConversationView] = []
        self.current: str | None = None
        self.index = index or SearchIndex()
        self.hits: list[Hit] = []
        self.default_model = ""  # the engine's default model (set by the app)
        self.show_one_shots = False  # the one-shot conversations are listed, not folded

    def compose(self) -> ComposeResult:
        yield Label("Conversations", classes="sidebar-title")
        yield Input(placeholder="Search", id="search")
        yield ListView(id="conversations")
        yield Static("\n".join(LEGEND_ITEMS), id="legend", markup=False)

    def set_conversations(self, convs: list[P.ConversationView], current: str | None) -> None:
        self.conversations = sorted(convs, key=lambda c: (c.updated_at, c.created_at), reverse=True)
        self.current = current
        self._fill()

    def visible(self) -> list[str]:
        """Titles shown now (after the search filter)."""
        return [item.title for item in self.query(ConversationItem)]

    @property
    def query_text(self) -> str:
        return self.query_one("#search", Input).value.strip()

    def _fill(self) -> None:
        needle = self.query_text
        lv = self.query_one("#conversations", ListView)
        by_id = {c.conv_id: c for c in self.conversations}
        if needle:
            self.hits = [h for h in self.index.search(needle) if h.conv_id in by_id]
            # a conversation not indexed yet still matches by its title
            seen = {h.conv_id for h in self.hits}
            low = needle.lower()
            self.hits += [Hit(c.conv_id, c.title) for c in self.conversations
                          if c.conv_id not in seen and low in (c.title or "").lower()]
            shown = [(by_id[h.conv_id], h) for h in self.hits]
        else:
            self.hits = []
            shown = [(c, None) for c in self.conversations if not c.origin or c.conv_id == self.current]
        folded = [c for c in self.conversations if c.origin and c.conv_id != self.current] if not needle else []
        old = lv.index
        lv.clear()
        lv.extend(ConversationItem(c, c.conv_id == self.current, h, self.default_model) for c, h in shown)
        if needle and not shown:
            lv.append(NoHitsItem(needle))
        if folded:
            lv.append(OneShotsItem(len(folded), self.show_one_shots))
            if self.show_one_shots:
                lv.extend(ConversationItem(c, False, None, self.default_model) for c in folded)
        ids = [c.conv_id for c, _ in shown]
        if self.current in ids:
            lv.index = ids.index(self.current)
        elif shown and old is not None:
            lv.index = min(old, len(shown) - 1)

    def mark_current(self, conv_id: str | None) -> None:
        """Highlight the open conversation (without a new search)."""
        self.current = conv_id
        self._fill()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "search":
            event.stop()
            self._fill()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in the search box: open the first hit (at its matching message)."""
        if event.input.id != "search":
            return
        event.stop()
        items = list(self.query(ConversationItem))
        if items:
            first = items[0]
            self.post_message(self.Opened(first.conv_id, first.hit.msg_id if first.hit else ""))

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, OneShotsItem):
            self.show_one_shots = not self.show_one_shots
            at = self.query_one("#conversations", ListView).index
            self._fill()
            self.query_one("#conversations", ListView).index = at
            return
        if isinstance(event.item, ConversationItem):
            hit = event.item.hit
            self.post_message(self.Opened(event.item.conv_id, hit.msg_id if hit else ""))
