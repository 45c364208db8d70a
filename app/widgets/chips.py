"""Attachment chips of the message being written; click a chip to drop it."""

from __future__ import annotations

from textual import events
from textual.containers import Horizontal
from textual.widgets import Static

from aotx.engine.ipc import protocol as P


class Chip(Static):
    def __init__(self, att: P.Attachment) -> None:
        icon = "🖼" if att.kind == "image" else "♪"
        super().__init__(f"{icon} {att.name} ✕", classes="chip", markup=False)
        self.attachment = att

    def on_click(self, event: events.Click) -> None:
        event.stop()
        bar = self.parent
        self.remove()
        if isinstance(bar, AttachmentBar):
            bar.attachments.remove(self.attachment)
            bar.set_class(not bar.attachments, "empty")


class AttachmentBar(Horizontal):
    """The pending message's attachments."""

    def __init__(self, **kwargs) -> None:
        super().__init__(classes="empty", **kwargs)
        self.attachments: list[P.Attachment] = []

    def add(self, att: P.Attachment) -> None:
        if any(a.sha256 == att.sha256 for a in self.attachments):
            return
        self.attachments.append(att)
        self.mount(Chip(att))
        self.remove_class("empty")

    def take(self) -> list[P.Attachment]:
        """Hand the attachments to a send and clear the bar."""
        atts, self.attachments = self.attachments, []
        self.remove_children()
        self.add_class("empty")
        return atts
