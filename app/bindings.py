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
    Action("f1", "help", "Help", "Show every key binding", show=True),
    Action("ctrl+n", "new_conversation", "New conversation", "Start a new conversation", show=True),
    Action("escape", "cancel", "Cancel reply", "Cancel the reply being written (or leave edit mode)"),
    Action("ctrl+r", "retry", "Retry", "Drop the last reply and ask the last question again", show=True),
    Action("ctrl+t", "edit_last", "Edit last message", "Put your last message back in the input to edit and resend"),
    Action("ctrl+o", "pick_model", "Pick model", "Pick the model of the open conversation (or of the next new one)",
           show=True),
    Action("ctrl+b", "copy_last", "Copy last reply", "Copy the last reply to the clipboard"),
    Action("f2", "rename", "Rename conversation", "Rename the open conversation"),
    Action("f3", "search", "Search conversations", "Search conversations by title"),
    Action("f4", "settings", "System prompt & sampling", "Edit the open conversation's system prompt and sampling"),
    Action("f5", "attach", "Attach file", "Pick an image or audio file to attach"),
    Action("f6", "toggle_theme", "Next theme", "Switch to the next theme (remembered)", show=True),
    Action("f7", "details_last", "Details of last message", "Show the last message's position and receipt"),
    Action("f8", "delete", "Delete conversation", "Delete the open conversation"),
    Action("ctrl+g", "fork", "Fork conversation",
           "Fork the open conversation at the focused message (or the last one) into a new one"),
    Action("f9", "toggle_sidebar", "Toggle sidebar", "Show or hide the conversation list"),
    Action("ctrl+l", "focus_input", "Focus input", "Move the cursor to the message input"),
    Action("ctrl+q", "quit", "Quit", "Quit aotx-chat (the engine keeps running)", priority=True),
)

# Keys handled by widgets rather than the app, listed for the help screen.
WIDGET_KEYS: tuple[tuple[str, str], ...] = (
    ("enter", "Send the message (in the input)"),
    ("ctrl+j", "New line in the input (also shift+enter / alt+enter where the terminal sends them)"),
    ("c", "Copy the focused message"),
    ("i", "Details and receipt of the focused message"),
    ("f", "Fork the conversation at the focused message"),
    ("click a code block", "Copy the code block"),
    ("click a chip", "Remove that attachment"),
    ("tab / shift+tab", "Move focus (input, messages, sidebar)"),
    ("ctrl+p", "Command palette: every action above by name"),
    ("/attach PATH", "Type in the input: attach a file (several paths, quoted or escaped, work too)"),
)


def app_bindings() -> list[Binding]:
    return [Binding(a.key, a.action, a.title, show=a.show, priority=a.priority) for a in ACTIONS]
