"""The model picker (Ctrl+O, and from F4): every installed model, choose the conversation's.

Owns: the table of models the engine lists (``ListModels``: name, size, architecture,
quantization, context, loaded or not, what it needs in memory; remote endpoints too)
and the choice. Dismisses with the chosen model's name, or None. Leaves the switch
(``SwitchModel``: the history is kept, the new model reads it again) to the app.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from aotx.engine.ipc import protocol as P
from aotx.engine.units import fmt_bytes


def model_row(m: P.ModelInfo, current: str) -> tuple[str, ...]:
    """The table cells of one model (pure: tested without a screen). "context": what a loaded
    model serves (its slots' length), else the file's trained context."""
    mark = "▸" if m.name == current else " "
    state = "unusable" if m.error else ("loaded" if m.loaded else "")
    return (f"{mark} {m.name}", fmt_bytes(m.size_bytes) if m.size_bytes else ("remote" if m.kind == "remote" else "-"),
            m.arch or "-", m.quant or "-", str((m.n_ctx if m.loaded and m.n_ctx else m.n_ctx_train) or "-"),
            fmt_bytes(m.needs_bytes) if m.needs_bytes else "-", state)


class ModelPicker(ModalScreen[str | None]):
    """``models``: the engine's list; ``current``: the open conversation's model."""

    BINDINGS = [Binding("escape", "dismiss_none", "Close")]

    def __init__(self, models: list[P.ModelInfo], current: str) -> None:
        super().__init__()
        self.models = [m for m in models]
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="model-box", classes="dialog"):
            yield Static("Model of this conversation", classes="dialog-title")
            yield DataTable(id="model-table", cursor_type="row", zebra_stripes=True)
            yield Static("Enter picks it: the next message runs on it and it reads the history again (the old "
                         "model's saved state stays valid for it). Esc keeps the current one.", classes="dialog-note")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("model", "size", "arch", "quant", "context", "needs", "")
        for m in self.models:
            table.add_row(*model_row(m, self.current), key=m.name)
        for i, m in enumerate(self.models):
            if m.name == self.current:
                table.move_cursor(row=i)
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        name = event.row_key.value
        m = next((m for m in self.models if m.name == name), None)
        if m is not None and m.error:
            self.notify(f"{m.name} cannot be used: {m.error}", severity="error")
            return
        self.dismiss(name)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
