"""Every action of the app, once: key, action name, description.

The app's BINDINGS, the help screen and the command palette are all built from
``ACTIONS``, so a new action shows up in all three.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class Action:
    key: str
    action: str
    title: str
    help: str
    show: bool = False
    priority: bool = False


ACTIONS: tuple[Action, ...] = (
    Action("f1", "help", "Help", "Show every key", show=True),
    Action("ctrl+n", "new_conversation", "New conversation", "Start a new conversation", show=True),
    Action("escape", "cancel", "Cancel reply", "Cancel the reply (or leave edit mode)"),
    Action("ctrl+r", "retry", "Retry", "Drop the last reply, ask again", show=True),
    Action("ctrl+t", "edit_last", "Edit last message", "Edit and resend your last message"),
    Action("ctrl+o", "pick_model", "Pick model", "The conversation's model (or the next one's)"),
    Action("ctrl+b", "copy_last", "Copy last reply", "Copy the last reply"),
    Action("f2", "rename", "Rename conversation", "Rename the conversation"),
    Action("f3", "search", "Search conversations", "Search titles and messages"),
    Action("f4", "settings", "System prompt & sampling", "System prompt and sampling"),
    Action("f5", "attach", "Attach file", "Attach an image or audio file"),
    Action("shift+delete", "clear_attachments", "Remove attachments", "Remove the attachments"),
    Action("f6", "toggle_theme", "Next theme", "Next theme (remembered)", show=True),
    Action("f7", "details_last", "Details of last message", "Details and receipt of the last message"),
    Action("ctrl+s", "export", "Export conversation", "Save it as Markdown or JSON"),
    Action("f8", "delete", "Delete conversation", "Delete the conversation"),
    Action("ctrl+g", "fork", "Fork conversation", "Fork at the focused (or last) message"),
    Action("f9", "toggle_sidebar", "Toggle sidebar", "Show or hide the conversation list"),
    Action("ctrl+l", "focus_input", "Focus input", "Move the cursor to the input"),
    Action("ctrl+q", "quit", "Quit", "Quit (the engine keeps running)", priority=True),
)

# Keys handled by widgets rather than the app, listed for the help screen.
WIDGET_KEYS: tuple[tuple[str, str], ...] = (
    ("enter", "Send the message"),
    ("ctrl+j", "New line (also shift+enter, alt+enter)"),
    ("up / down", "Previous / next message (up: from empty input)"),
    ("c / i / f", "On a message: copy / details / fork here"),
    ("delete", "Remove the focused attachment chip"),
    ("enter in search", "Open the first hit"),
    ("click", "Copy a code block; remove a chip"),
    ("tab / shift+tab", "Move focus: input, chips, messages, list"),
    ("ctrl+p", "Command palette: every action by name"),
    ("/attach PATH", "Attach files (quoted or escaped paths too)"),
)

# Help rows must fit an 80-column terminal: the help table's key
# column plus its description column, each with a cell of padding, inside the dialog.
HELP_KEY_WIDTH, HELP_TEXT_WIDTH = 16, 46


def app_bindings() -> list[Binding]:
    return [Binding(a.key, a.action, a.title, show=a.show, priority=a.priority) for a in ACTIONS]
