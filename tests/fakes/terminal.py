"""What a terminal sends, delivered the way Textual's own driver delivers it.

``bracketed_paste(app, text)`` writes ``ESC[200~ text ESC[201~`` (a bracketed paste,
as every modern terminal sends a paste or a dropped file) through Textual's
``XTermParser`` and hands each event it yields to the app's driver
(``Driver.process_message``), as the Linux driver's input thread does. A test
that pastes this way sees exactly what a user pasting in a real terminal sees."""

from __future__ import annotations

from textual._xterm_parser import XTermParser

PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"


def terminal_events(data: str) -> list:
    """The events Textual's parser makes of the bytes ``data`` (already decoded)."""
    return list(XTermParser().feed(data))


def bracketed_paste(app, text: str) -> list:
    """Paste ``text`` into ``app`` as a terminal does; returns the events delivered."""
    events = terminal_events(PASTE_START + text + PASTE_END)
    for event in events:
        app._driver.process_message(event)
    return events
