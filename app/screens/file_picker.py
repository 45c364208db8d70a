"""A file picker for attachments (F5): a directory tree and a path box.

Owns: choosing one file. The tree starts where aotx-chat was started (the current
directory, where a user's files usually are; not $HOME), shows folders and the image and
audio files AOTX can attach, and hides dotfiles and dot-folders (``.cache``, ``.git``...),
as file dialogs do. A path typed in the box is taken as it is (a dotfile too).
Leaves checking the file to the app (``attach.make_attachment``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Static

from aotx.engine.present.attach import AUDIO_EXT, IMAGE_EXT

MEDIA_EXT = IMAGE_EXT | AUDIO_EXT


class MediaTree(DirectoryTree):
    """Folders and attachable files, without hidden ones."""

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        out = []
        for p in paths:
            if p.name.startswith("."):
                continue
            try:
                if p.is_dir() or p.suffix.lower() in MEDIA_EXT:
                    out.append(p)
            except OSError:  # a broken link, a folder we may not read
                continue
        return out


class FilePicker(ModalScreen[str | None]):
    """Returns the chosen file's path, or None. ``root``: where the tree starts (default:
    the current directory)."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, root: str | Path | None = None) -> None:
        super().__init__()
        self.root = Path(root) if root else Path.cwd()

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-box", classes="dialog"):
            yield Static(f"Attach an image or audio file ({self.root})", classes="dialog-title", markup=False)
            yield MediaTree(self.root, id="picker-tree")
            yield Input(placeholder="or type a path and press Enter", id="picker-path")
            yield Static("Enter on a file attaches it. Esc cancels. Hidden files: type their path.",
                         classes="dialog-note")

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        self.dismiss(str(event.path))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)
