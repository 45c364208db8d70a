"""Attachment chips of the message being written: click a chip, or focus it (Tab) and
press Delete or Backspace, to drop it."""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Static

from aotx.engine import protocol as P


class Chip(Static, can_focus=True):
    BINDINGS = [Binding("delete,backspace,enter", "remove_chip", "Remove attachment")]

    def __init__(self, att: P.Attachment) -> None:
        icon = "🖼" if att.kind == "image" else "♪"
        super().__init__(f"{icon} {att.name} ✕", classes="chip", markup=False)
        self.attachment = att
        self.tooltip = "click, or Delete, to remove"

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.action_remove_chip()

    def action_remove_chip(self) -> None:
        bar = self.parent
        if isinstance(bar, AttachmentBar):
            bar.discard(self)


class AttachmentBar(Horizontal):
    """The pending message's attachments. Posts ``Changed`` when one is added or removed."""

    class Changed(Message):
        def __init__(self, bar: "AttachmentBar", removed: list[P.Attachment], focus_lost: bool = False) -> None:
            self.bar, self.removed, self.focus_lost = bar, removed, focus_lost
            super().__init__()

    def __init__(self, **kwargs) -> None:
        super().__init__(classes="empty", **kwargs)
        self.attachments: list[P.Attachment] = []

    def add(self, att: P.Attachment) -> None:
        if any(a.sha256 == att.sha256 for a in self.attachments):
            return
        self.attachments.append(att)
        self.mount(Chip(att))
        self.remove_class("empty")

    def discard(self, chip: Chip) -> None:
        """Drop one chip (focus moves to the next chip; the app moves it to the input
        when none is left)."""
        chips = list(self.query(Chip))
        i = chips.index(chip) if chip in chips else -1
        if chip.attachment in self.attachments:
            self.attachments.remove(chip.attachment)
        chip.remove()
        self.set_class(not self.attachments, "empty")
        rest = [c for c in chips if c is not chip]
        had_focus = chip.has_focus
        if had_focus and rest:
            rest[min(i, len(rest) - 1)].focus()
        self.post_message(self.Changed(self, [chip.attachment], focus_lost=had_focus and not rest))

    def take(self) -> list[P.Attachment]:
        """Hand the attachments to a send and clear the bar."""
        atts, self.attachments = self.attachments, []
        self.remove_children()
        self.add_class("empty")
        return atts

    def clear(self) -> list[P.Attachment]:
        """Drop every attachment (a new conversation starts without them); returns them."""
        atts = self.take()
        if atts:
            self.post_message(self.Changed(self, atts))
        return atts
