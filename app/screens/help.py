"""The help screen: every key binding, from bindings.ACTIONS and WIDGET_KEYS."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from aotx.app.bindings import ACTIONS, WIDGET_KEYS
from aotx.engine.present.format import LEGEND


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box", classes="dialog"):
            yield Static("Keys", classes="dialog-title")
            yield DataTable(id="help-table", cursor_type="row", zebra_stripes=True)
            yield Static("Message positions: " + LEGEND, classes="dialog-note", markup=False)
            yield Static("Esc closes this screen.", classes="dialog-note")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("key", "does")
        for a in ACTIONS:
            table.add_row(a.key, a.help)
        for key, does in WIDGET_KEYS:
            table.add_row(key, does)
