"""A file picker for attachments: a directory tree and a path box."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Static


class FilePicker(ModalScreen[str | None]):
    """Returns the chosen file's path, or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, root: str | Path | None = None) -> None:
        super().__init__()
        self.root = Path(root or Path.home())

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-box", classes="dialog"):
            yield Static("Attach an image or audio file", classes="dialog-title")
            yield DirectoryTree(self.root, id="picker-tree")
            yield Input(placeholder="or type a path and press Enter", id="picker-path")
            yield Static("Enter on a file attaches it. Esc cancels.", classes="dialog-note")

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        self.dismiss(str(event.path))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)
